"""The ```console blocks of README.md and docs/: a command and what it prints, checked.

A block holds one or more commands, each on a line starting with `$ `; the lines after a command,
up to the next one, are its output. The command runs with bash in a fresh directory laid out like
a clone of the repository (`.venv` and `examples` link to the real ones; the virtualenv's `bin` is
first on PATH, so `dpaudit` and `.venv/bin/dpaudit` are the same command), with one thread
(OMP_NUM_THREADS=1). It must exit with status 0, and what it writes (stdout and stderr together,
as a terminal shows them: after a carriage return only the rest of the line counts) must match
the output shown, line by line, trailing spaces ignored. In the output shown:

- `<n>` matches one number (`12`, `-0.5`, `3.59`, `1e-05`, `1,500`, `nan`);
- a run of spaces matches a run of spaces of any length (columns keep their alignment in the page
  whatever the width of the numbers in them);
- `...` inside a line matches any text within that line;
- a line that is only `...` matches any number of lines, none included.

Everything else must be printed exactly. The ```pycon blocks (Python sessions: `>>>` lines and
what they print, run by doctest) check their output by the same rules, or doctest's own. See "How the examples in the docs are tested" in
docs/testing-the-project.md.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

from sybil import Document, Example, Region
from sybil.evaluators.doctest import DocTestEvaluator, OutputChecker
from sybil.parsers.abstract.doctest import DocTestStringParser
from sybil.parsers.markdown import CodeBlockParser

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "$ "
NUMBER = r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?nan|[-+]?inf"
TIMEOUT = 300  # seconds a command may take (the docs' commands take seconds)


def commands_and_outputs(block: str) -> List[Tuple[str, List[str]]]:
    """The block's `$ ` commands, each with the output lines shown under it."""
    pairs: List[Tuple[str, List[str]]] = []
    for line in block.splitlines():
        if line.startswith(PROMPT):
            pairs.append((line[len(PROMPT):].strip(), []))
        elif pairs:
            pairs[-1][1].append(line.rstrip())
        elif line.strip():
            raise ValueError(f"a console block starts with a `$ ` command, not {line!r}")
    if not pairs:
        raise ValueError("a console block holds no `$ ` command")
    return pairs


def expected_pattern(lines: List[str]) -> re.Pattern:
    """The regular expression the shown output stands for (see the module's docstring)."""
    while lines and not lines[-1]:
        lines = lines[:-1]
    parts = []
    for line in lines:
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
            continue
        parts.append(r"[^\n]*?".join(_literal(text) for text in line.split("...")) + r"\n")
    return re.compile("".join(parts))


def _literal(text: str) -> str:
    """A piece of a shown line: `<n>` a number, a run of spaces any run of spaces, the rest itself."""
    numbers = [" +".join(re.escape(word) for word in re.split(r" +", piece)) for piece in text.split("<n>")]
    return f"(?:{NUMBER})".join(numbers)


def terminal_text(output: str) -> str:
    """The output as a terminal leaves it: each line's text after its last carriage return
    (progress bars redraw themselves that way), trailing spaces removed, no trailing blank lines."""
    lines = []
    for line in output.split("\n"):
        segments = [s for s in line.split("\r") if s.strip()]
        lines.append(segments[-1].rstrip() if segments else "")
    while lines and not lines[-1]:
        lines.pop()
    return "".join(line + "\n" for line in lines)


def clone_like_directory() -> Path:
    """A fresh directory, below the current one, in which the docs' relative paths resolve as in a clone."""
    directory = Path(tempfile.mkdtemp(prefix="console_", dir=Path.cwd()))
    (directory / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    (directory / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    return directory


def run(command: str, directory: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",  # stdout and stderr interleave as in a terminal
        PATH=f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        COLUMNS="120",
    )
    env.pop("PYTEST_CURRENT_TEST", None)
    return subprocess.run(  # bytes: text mode would turn a bar's carriage returns into newlines
        ["bash", "-c", command], cwd=directory, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        timeout=TIMEOUT,
    )


def evaluate_console(example: Example) -> Optional[str]:
    """Sybil's evaluator of a console block: None when every command printed what is shown, else why not."""
    directory = clone_like_directory()
    for command, shown in commands_and_outputs(str(example.parsed)):
        done = run(command, directory)
        got = terminal_text(done.stdout.decode("utf-8", "replace").replace("\r\n", "\n"))
        if done.returncode != 0:
            return f"`{command}` exited with status {done.returncode}; its output:\n{got}"
        if expected_pattern(shown).fullmatch(got) is None:
            return (
                f"`{command}` printed something else than the page shows.\n"
                f"--- shown in the page:\n" + "\n".join(shown) + f"\n--- printed:\n{got}"
            )
    return None


class ConsoleBlockParser(CodeBlockParser):
    """Sybil's Markdown code-block parser for ```console blocks, with the evaluator above."""

    def __init__(self) -> None:
        super().__init__(language="console", evaluator=evaluate_console)


class ShownOutputChecker(OutputChecker):
    """doctest's comparison, and where it fails the console blocks' rules above (`<n>`, `...`, spaces)."""

    def check_output(self, want: str, got: str, optionflags: int) -> bool:
        if super().check_output(want, got, optionflags):
            return True
        return expected_pattern([line.rstrip() for line in want.splitlines()]).fullmatch(terminal_text(got)) is not None


class SessionBlockParser:
    """Sybil's Markdown parser for ```pycon blocks (Python sessions: `>>>` lines and what they print),
    as doctest examples whose output is compared as above."""

    def __init__(self, doctest_optionflags: int = 0) -> None:
        self.blocks = CodeBlockParser(language="pycon")
        evaluator = DocTestEvaluator(doctest_optionflags)
        evaluator.runner._checker = ShownOutputChecker()  # doctest.DocTestRunner keeps its checker there
        self.doctest_parser = DocTestStringParser(evaluator)

    def __call__(self, document: Document) -> Iterable[Region]:
        for block in self.blocks(document):  # as Sybil's PythonCodeBlockParser does for `>>>` blocks
            source = block.parsed
            for region in self.doctest_parser(source, document.path):
                region.adjust(block, source)
                yield region
