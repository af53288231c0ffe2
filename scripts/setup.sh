#!/usr/bin/env bash
# Create ./.venv and install lightning_dpaudit with its test tools.
# torch is installed first and pinned: an unpinned torch pulled in by another
# package would fetch a multi-GB CUDA build; 2.13.0 is a CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    "${PIP[@]}" "torch==2.13.0"
fi
"${PIP[@]}" -e ".[dev]"
