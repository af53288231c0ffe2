"""scripts/setup.sh installs the runtime dependencies alone unless asked for the dev tools, and .ci/run runs
the README's test command, which asks for them.

setup.sh runs here in a copy of the repository's layout whose `.venv/bin/python` is a stub that records
what it is asked to do (torch reported as installed): nothing is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUB = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/calls"
"""


def _bash_blocks(page: str) -> list:
    text = (ROOT / page).read_text(encoding="utf-8")
    return [block.strip() for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)]


def _setup(tmp_path, *args) -> tuple:
    """(exit status, stderr, the stub python's calls) of `bash scripts/setup.sh *args` in a copy of the layout."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STUB)
    python.chmod(0o755)
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh"), *args], capture_output=True, text=True, timeout=60)
    calls = python.parent / "calls"
    return done.returncode, done.stderr, calls.read_text().splitlines() if calls.exists() else []


def test_setup_installs_the_runtime_dependencies_alone_by_default(tmp_path):
    status, _, calls = _setup(tmp_path)
    assert status == 0
    assert calls[-1] == "-m pip install --quiet --disable-pip-version-check -e ."


def test_setup_dev_adds_the_test_and_docs_tools(tmp_path):
    status, _, calls = _setup(tmp_path, "--dev")
    assert status == 0
    assert calls[-1] == "-m pip install --quiet --disable-pip-version-check -e .[dev]"


def test_setup_refuses_an_unknown_argument(tmp_path):
    status, stderr, calls = _setup(tmp_path, "--all")
    assert status == 2 and calls == []
    assert "unexpected argument '--all'; usage: bash scripts/setup.sh [--dev]" in stderr


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_quick_start_demo_needs_no_dev_tools_and_the_tests_ask_for_them(page):
    blocks = _bash_blocks(page)
    assert "bash scripts/setup.sh && .venv/bin/dpaudit demo" in blocks
    assert "bash scripts/setup.sh --dev && .venv/bin/python -m pytest -q tests" in blocks


def test_ci_runs_the_readme_test_command_exactly():
    (command,) = [block for block in _bash_blocks("README.md") if "pytest" in block and block.startswith("bash scripts/setup.sh")]
    assert command in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert f"`{command}`" in (ROOT / "README.md").read_text(encoding="utf-8")  # the Tests section names it too
    assert f"`{command}`" in (ROOT / "docs" / "testing-the-project.md").read_text(encoding="utf-8")
