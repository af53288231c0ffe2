"""Every example in README.md and docs/ runs as written, by Sybil.

Sybil parses each page: its ```python blocks (each complete, or continuing an earlier one as its
text says; tests/test_docs_plain.py runs each on its own and refuses invisible set-up), run in page
order in one namespace per page, in a fresh working directory, with one torch thread; ```pycon blocks
(`>>>` sessions) check what they print. Its ```console blocks run their `$ ` commands
and must print what the page shows (tests/doc_console.py). `<!-- skip: next "needs ..." -->` skips
the next example, for examples that cannot run on a CPU machine. ```bash and ```text blocks are
shown, not run. Each example is one test, named by its page and line; selecting one (`-k`) runs the
page's examples before it first. See "How the examples in the docs are tested" in
docs/testing-the-project.md.
"""

from __future__ import annotations

import doctest
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List
from unittest import SkipTest

import pytest
import torch
from doc_console import ConsoleBlockParser, SessionBlockParser, evaluate_console
from sybil import Sybil
from sybil.evaluators.doctest import DocTestEvaluator
from sybil.evaluators.python import PythonEvaluator
from sybil.evaluators.skip import Skipper
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/*.md", "docs/*/*.md"]  # Path.match patterns, from the repository's root

SYBIL = Sybil(
    parsers=[
        PythonCodeBlockParser(),
        SessionBlockParser(doctest_optionflags=doctest.ELLIPSIS),
        ConsoleBlockParser(),
        SkipParser(),
    ],
    path=str(ROOT),
    patterns=PAGES,
)


def _pages() -> List[Path]:
    return sorted(path for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")] if SYBIL.should_parse(path))


DOCUMENTS = {str(path.relative_to(ROOT)): SYBIL.parse(path) for path in _pages()}
EXAMPLES = {page: list(document.examples()) for page, document in DOCUMENTS.items()}


@dataclass
class Page:
    """A page's run: its working directory and how many of its examples have run."""

    directory: Path
    done: int = 0
    failed: List[int] = field(default_factory=list)  # the lines of the examples that failed


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    runs: Dict[str, Page] = {}
    yield runs
    for page in runs:
        DOCUMENTS[page].namespace.clear()


def _count(kind) -> int:
    return sum(1 for examples in EXAMPLES.values() for example in examples if isinstance(example.region.evaluator, kind))


def _params():
    for page, examples in EXAMPLES.items():
        for index, example in enumerate(examples):
            yield pytest.param(page, index, id=f"{page}:{example.line}")


def test_the_pages_have_examples():
    """Collection finds every page and the examples in them (a parser that stopped matching fails here)."""
    every_page = {"README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))}
    assert set(DOCUMENTS) == every_page
    assert len(DOCUMENTS) >= 20
    total = sum(len(examples) for examples in EXAMPLES.values())
    python, sessions = _count(PythonEvaluator), _count(DocTestEvaluator)
    console = sum(1 for examples in EXAMPLES.values() for e in examples if e.region.evaluator is evaluate_console)
    assert python >= 15 and sessions >= 8 and console >= 2, (python, sessions, console)
    assert total == python + sessions + console + _count(Skipper), "an example of another kind"


def _evaluate(example) -> None:
    __tracebackhide__ = True
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        example.evaluate()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("page,index", list(_params()))
def test_example(page, index, pages, tmp_path_factory, monkeypatch):
    __tracebackhide__ = True
    run = pages.get(page)
    if run is None:
        name = page.replace("/", "_").replace(".", "_")
        run = pages[page] = Page(tmp_path_factory.mktemp(name))
    monkeypatch.chdir(run.directory)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    examples = EXAMPLES[page]
    while run.done < index:  # the page's earlier examples, when they were not selected
        earlier = examples[run.done]
        run.done += 1
        try:
            _evaluate(earlier)
        except SkipTest:
            pass
        except Exception:  # noqa: BLE001 - reported below if this example fails too
            run.failed.append(earlier.line)
    run.done = max(run.done, index + 1)
    try:
        _evaluate(examples[index])
    except SkipTest:
        raise
    except Exception:
        if run.failed:  # shown with the failure: a NameError here may come from there
            print(f"{page}: the example(s) at line(s) {', '.join(map(str, run.failed))} failed before this one")
        run.failed.append(examples[index].line)
        raise
