#!/usr/bin/env bash
# Create ./.venv and install lightning_dpaudit: its runtime dependencies only (enough for
# `dpaudit demo`, the examples and your own runs), or with --dev also the test and docs tools
# (pytest, pytest-xdist, Sybil, MkDocs) and the model families some tests build (transformers, peft).
# torch is installed first and pinned: an unpinned torch pulled in by another
# package would fetch a multi-GB CUDA build; 2.13.0 is a CPU wheel.
set -euo pipefail
usage="usage: bash scripts/setup.sh [--dev]"
extras=""
for arg in "$@"; do
    case "$arg" in
        --dev) extras="[dev]" ;;
        -h | --help) echo "$usage"; exit 0 ;;
        *) echo "scripts/setup.sh: unexpected argument '$arg'; $usage (--dev: the test and docs tools too)" >&2; exit 2 ;;
    esac
done
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    "${PIP[@]}" "torch==2.13.0"
fi
"${PIP[@]}" -e ".${extras}"
