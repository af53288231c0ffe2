"""Every ```python block in README.md and docs/ runs as the reader sees it, on its own.

tests/test_docs.py runs a page's examples in one namespace, in page order; this module runs each
block in a fresh Python process (the namespace of a script, a fresh working directory, one torch
thread, a time limit), so a block that needs set-up the page does not show fails here.

Markers, each an HTML comment on its own line before the fence (blank lines between are allowed):

    <!-- name: NAME -->            names the block, for later blocks on the page to continue
    <!-- continues: NAME -->       a fragment: runs after the named earlier block (and what that one
                                   continues), in the same namespace; the text before it says so
    <!-- skip: next "REASON" -->   not run (the marker tests/test_docs.py's Sybil reads too), for
                                   blocks that need several processes, GPUs or packages not installed
    <!-- verdict: OK -->           the verdict the page states for the audits the block (with what it
                                   continues) runs: OK or VIOLATION, for every one of them

A block that no later block continues is one test, named by its page and line; a named block
runs inside the tests of the blocks that continue it. Blocks marked not run are skipped tests
with their reason (listed by `-ra`). Invisible set-up (`<!-- invisible-code-block: ... -->`)
is refused.

Each run also records the audits it makes: every PrivacyAuditor that audited a step (the callback's
included) and the last final-model audit of every FinalModelCanaries. A run with audits must end in
the verdict its block's `verdict:` marker states (OK: no violation in any of them; VIOLATION: one in
each), and a run with audits and no such marker fails: a recipe's verdict is tested, not only that
it runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 120  # seconds for one block and the blocks it continues (each is meant to take a few seconds)
PYTHON = {"python", "py", "python3"}  # fence languages that are Python code (```pycon is tests/test_docs.py's)

FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(?P<key>name|continues|skip|verdict)\s*:\s*(?P<value>.*?)\s*-->\s*$")
VERDICTS = ("OK", "VIOLATION")
SKIP_NEXT = re.compile(r'^next\s+"(?P<reason>[^"]+)"$')
COMMENT = re.compile(r"^\s*<!--.*-->\s*$")
INVISIBLE = re.compile(r"^\s*<!--+\s*invisible-code-block")  # as Sybil reads it: at a line's start


@dataclass
class Block:
    page: str  # relative to the repository's root
    line: int  # the fence's line, from 1
    code: str
    name: Optional[str] = None
    continues: Optional[str] = None
    skip: Optional[str] = None  # the reason it is not run
    verdict: Optional[str] = None  # OK or VIOLATION: what the page says its audits end in
    errors: List[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> List[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def parse(page: str, text: str) -> List[Block]:
    """The page's Python blocks with their markers. Fences nest as Markdown says: a fence closes only
    with the same character, at least as many times, so a ```` fence can show ``` blocks."""
    lines = text.splitlines()
    blocks: List[Block] = []
    markers: List[tuple] = []  # (line, key, value) of the comments just before the next fence
    i = 0
    while i < len(lines):
        text = lines[i]
        opening = FENCE.match(text)
        if opening is None:
            marker = MARKER.match(text)
            if marker:
                markers.append((i + 1, marker["key"], marker["value"]))
            elif text.strip() and not COMMENT.match(text):
                markers = []  # prose between a marker and a fence: the marker belongs to no block
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        close = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = i + 1
        while end < len(lines) and not close.match(lines[end]):
            end += 1
        language = (opening["info"].split() or [""])[0].lower()
        if language in PYTHON:
            body = [line[indent:] if line[:indent].strip() == "" else line for line in lines[i + 1 : end]]
            block = Block(page, i + 1, "\n".join(body) + "\n")
            for at, key, value in markers:
                if getattr(block, key) is not None:
                    block.errors.append(f"two `{key}:` markers (line {at})")
                elif key == "skip":
                    reason = SKIP_NEXT.match(value)
                    if reason is None:
                        block.errors.append(f'line {at}: write `<!-- skip: next "the reason" -->`')
                    else:
                        block.skip = reason["reason"]
                elif key == "verdict" and value not in VERDICTS:
                    block.errors.append(f"line {at}: the verdict is one of {', '.join(VERDICTS)}, not {value!r}")
                else:
                    setattr(block, key, value)
            blocks.append(block)
        markers = []
        i = end + 1
    return blocks


def hidden_setup(text: str) -> List[int]:
    """The lines of invisible code blocks outside fences: set-up the reader does not see."""
    found, inside = [], None
    for number, line in enumerate(text.splitlines(), 1):
        opening = FENCE.match(line)
        if inside is None and opening:
            inside = opening["fence"]
        elif inside is not None and re.match(rf"^\s*{re.escape(inside[0])}{{{len(inside)},}}\s*$", line):
            inside = None
        elif inside is None and INVISIBLE.match(line):
            found.append(number)
    return found


TEXTS: Dict[str, str] = {str(path.relative_to(ROOT)): path.read_text(encoding="utf-8") for path in pages()}
BLOCKS: Dict[str, List[Block]] = {page: parse(page, text) for page, text in TEXTS.items()}
EVERY = [block for blocks in BLOCKS.values() for block in blocks]


def chain(block: Block, blocks_of: Dict[str, List[Block]] = BLOCKS) -> List[Block]:
    """The blocks to run for `block`, first to last: what it continues, then itself."""
    named = {b.name: b for b in blocks_of[block.page] if b.name}
    blocks = [block]
    while blocks[0].continues is not None:
        earlier = named.get(blocks[0].continues)
        if earlier is None or earlier.line >= blocks[0].line or earlier in blocks:
            raise LookupError(f"{blocks[0].id} continues {blocks[0].continues!r}: no such block before it")
        blocks.insert(0, earlier)
    return blocks


def problems(texts: Dict[str, str] = TEXTS, blocks_of: Dict[str, List[Block]] = BLOCKS) -> List[str]:
    """What makes a block neither run nor marked not run, or its markers wrong."""
    every = [block for blocks in blocks_of.values() for block in blocks]
    found = [f"{block.id}: {error}" for block in every for error in block.errors]
    for page, blocks in blocks_of.items():
        names = [b.name for b in blocks if b.name]
        found += [f"{page}: two blocks named {name!r}" for name in sorted(set(names)) if names.count(name) > 1]
        found += [f"{page}:{line}: invisible set-up; show it in a block" for line in hidden_setup(texts[page])]
    for block in every:
        if block.continues is None:
            continue
        try:
            blocks = chain(block, blocks_of)
        except LookupError as error:
            found.append(str(error))
            continue
        skipped = [b.id for b in blocks[:-1] if b.skip is not None]
        if skipped and block.skip is None:
            found.append(f"{block.id} continues a block marked not run ({', '.join(skipped)})")
    return found


CONTINUED = {(block.page, block.continues) for block in EVERY if block.continues}
LEAVES = [block for block in EVERY if (block.page, block.name) not in CONTINUED or block.name is None]


def test_every_block_is_run_or_marked_not_run():
    """Each ```python block runs, alone or inside a block that continues it, or is marked not run
    with a reason; markers name blocks that exist; no page hides set-up in an invisible block."""
    assert not problems(), "\n".join(problems())
    fences = sum(1 for text in TEXTS.values() for line in text.splitlines() if re.match(r"^\s*(```|~~~)\s*python\s*$", line))
    assert len(EVERY) == fences >= 15, (len(EVERY), fences)  # the parser sees every block
    run = {b.id for leaf in LEAVES if leaf.skip is None for b in chain(leaf)}
    not_run = [b for b in EVERY if b.skip is not None]
    assert run | {b.id for b in not_run} == {b.id for b in EVERY}
    print(f"{len(EVERY)} python blocks in {len(BLOCKS)} pages: {len(run)} run, {len(not_run)} marked not run")
    for block in not_run:
        print(f"  not run: {block.id}: {block.skip}")


PAGE = """Set-up the reader does not see:

<!-- invisible-code-block: python
value = 41
-->

<!-- name: first -->

```python
value = 41
```

Markers on blocks that cannot run:

<!-- continues: nowhere -->

```python
print(value)
```

<!-- skip: next -->

```python
print(value)
```

<!-- skip: next "needs 2 processes" -->
<!-- name: launched -->

```python
import torch.distributed
```

<!-- continues: launched -->

```python
print(value)
```

````markdown
<!-- continues: first -->
```python
not a block of this page
```
````
"""


def test_the_markers_are_checked():
    """The inventory itself: hidden set-up, a marker naming no earlier block, a skip without a reason and a
    fragment of a block not run are each reported; a fence inside a longer fence is no block."""
    blocks = parse("page.md", PAGE)
    assert [(b.line, b.name, b.continues, b.skip) for b in blocks] == [
        (9, "first", None, None), (17, None, "nowhere", None), (23, None, None, None),
        (30, "launched", None, "needs 2 processes"), (36, None, "launched", None),
    ]
    assert problems({"page.md": PAGE}, {"page.md": blocks}) == [
        'page.md:23: line 21: write `<!-- skip: next "the reason" -->`',
        "page.md:3: invisible set-up; show it in a block",
        "page.md:17 continues 'nowhere': no such block before it",
        "page.md:36 continues a block marked not run (page.md:30)",
    ]


def test_a_fragment_without_its_marker_fails(runner, tmp_path):
    """The check itself: a block using a name only an earlier block defines fails alone, and runs
    once marked as continuing that block, in the same namespace."""
    first = Block("README.md", 1, "value = 41\n", name="first")
    second = Block("README.md", 5, "assert value + 1 == 42\n", continues="first")
    with pytest.raises(pytest.fail.Exception, match="NameError: name 'value' is not defined"):
        run_blocks(runner, [second], tmp_path)
    run_blocks(runner, [first, second], tmp_path)
    with pytest.raises(pytest.fail.Exception, match="did not finish"):
        run_blocks(runner, [Block("README.md", 9, "import signal\nsignal.raise_signal(signal.SIGALRM)\n")], tmp_path)


AUDITED = """from torch.utils.data import DataLoader
from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.datasets import digits_dataset, make_private_digits, train_steps

model, optimizer, loader, _ = make_private_digits(seed=0)
correct = PrivacyAuditor(optimizer, seed=0)
train_steps(model, optimizer, loader, 2)
correct.detach()
shuffled = DataLoader(digits_dataset(), batch_size=64, shuffle=True)  # never made private: a sampling violation
wrong = PrivacyAuditor(optimizer, seed=0, data_loader=shuffled)
train_steps(model, optimizer, shuffled, 2)
unused = PrivacyAuditor(make_private_digits(seed=1)[1])  # audits no step: no verdict
"""


def test_a_runs_audits_must_end_in_the_verdict_its_page_states(runner, tmp_path):
    """The check itself: each audit that audited a step is recorded with its verdict, in order; a run with
    audits and no `verdict:` marker fails, and so does one whose audits end otherwise than the marker says."""
    found = run_blocks(runner, [Block("README.md", 1, AUDITED)], tmp_path)
    assert found == [["step", "OK"], ["step", "VIOLATION"]]
    with pytest.raises(pytest.fail.Exception, match=r"README.md:1 ends in step audit OK, step audit VIOLATION but states no verdict"):
        check_verdicts([Block("README.md", 1, AUDITED)], found)
    with pytest.raises(pytest.fail.Exception, match=r"README.md:1: the page states OK, the run ends in step audit OK, step audit VIOLATION"):
        check_verdicts([Block("README.md", 1, AUDITED, verdict="OK")], found)
    with pytest.raises(pytest.fail.Exception, match=r"README.md:1 states the verdict OK, but no audit of its run audited anything"):
        check_verdicts([Block("README.md", 1, "x = 1\n", verdict="OK")], [])
    check_verdicts([Block("README.md", 1, AUDITED, verdict="VIOLATION")], [["step", "VIOLATION"], ["final model", "VIOLATION"]])
    marked = parse("page.md", "<!-- verdict: OK -->\n\n```python\nx = 1\n```\n\n<!-- verdict: fine -->\n```python\nx = 2\n```\n")
    assert [(b.verdict, b.errors) for b in marked] == [
        ("OK", []), (None, ["line 7: the verdict is one of OK, VIOLATION, not 'fine'"]),
    ]


# One process per test module imports torch, Lightning, Opacus and the package once, then forks a child
# per run: the child's namespace is a fresh script's, without paying ~5 s of imports for every block.
SERVER = r"""
import functools, json, os, signal, sys, traceback
import matplotlib
matplotlib.use("Agg")
import opacus, pytorch_lightning, torch
import lightning_dpaudit
for name in lightning_dpaudit.__all__:
    getattr(lightning_dpaudit, name)


def recording():  # the audits the blocks make, in order: ("step", auditor), ("final model", canaries, [its last result])
    from lightning_dpaudit import FinalModelCanaries, PrivacyAuditor

    audits, init, audit = [], PrivacyAuditor.__init__, FinalModelCanaries.audit

    @functools.wraps(init)  # the same signature: DPAuditCallback reads PrivacyAuditor's options from it
    def recorded_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        audits.append(("step", self))

    def recorded_audit(self, *args, **kwargs):
        result = audit(self, *args, **kwargs)
        last = next((entry[2] for entry in audits if entry[1] is self), None)
        if last is None:
            last = []
            audits.append(("final model", self, last))
        last[:] = [result]  # the end of fit's audit comes last
        return result

    PrivacyAuditor.__init__, FinalModelCanaries.audit = recorded_init, recorded_audit
    return audits


def verdicts(audits):  # [kind, "OK" or "VIOLATION"] of each audit that audited something
    found = []
    for kind, audit, *last in audits:
        result = audit.result() if kind == "step" and audit.steps else last[0][0] if last else None
        if result is not None:
            found.append([kind, "VIOLATION" if result.violation else "OK"])
    return found


print("ready", flush=True)
for request in sys.stdin:
    directory, timeout, sources = json.loads(request)
    pid = os.fork()
    if pid == 0:
        os.chdir(directory)
        output = os.open("output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        signal.alarm(timeout)  # its default action ends the child, even inside C code
        audits = recording()
        namespace = {"__name__": "__main__"}
        status = 0
        try:
            for path, line, code in sources:
                exec(compile("\n" * line + code, path, "exec"), namespace)
            with open("verdicts.json", "w") as out:
                json.dump(verdicts(audits), out)
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
"""


@pytest.fixture(scope="module")
def runner():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert server.stdout.readline().strip() == "ready", "the process that runs the blocks did not start"
    yield server
    server.kill()  # it holds no state: a child is running only while a test waits for it
    server.wait(timeout=60)
    server.stdin.close()
    server.stdout.close()


def run_blocks(runner, blocks: List[Block], directory: Path) -> list:
    """Run the blocks in one namespace in a new process, their line numbers the page's (a traceback points
    at the page's line); fails the test with the end of the output if the run fails or takes too long.
    Returns [kind, verdict] of each audit the run made ("step" or "final model", "OK" or "VIOLATION")."""
    __tracebackhide__ = True
    sources = [(str(ROOT / b.page), b.line, b.code) for b in blocks]
    runner.stdin.write(json.dumps([str(directory), TIMEOUT, sources]) + "\n")
    runner.stdin.flush()
    answer = runner.stdout.readline()
    assert answer, "the process that runs the blocks ended"
    code = json.loads(answer)
    ran = ", ".join(b.id for b in blocks)
    output = (directory / "output.txt").read_text(errors="replace").splitlines()
    tail = "\n".join(output[-40:])
    if code == -signal.SIGALRM:
        pytest.fail(f"{blocks[-1].id} did not finish in {TIMEOUT} s (ran: {ran}):\n{tail}", pytrace=False)
    if code != 0:
        pytest.fail(f"{blocks[-1].id} failed (ran: {ran}):\n{tail}", pytrace=False)
    return json.loads((directory / "verdicts.json").read_text())


def stated_verdict(blocks: List[Block]) -> Optional[str]:
    """The verdict the page states for a run of `blocks`: the last `verdict:` marker among them."""
    return next((b.verdict for b in reversed(blocks) if b.verdict is not None), None)


def check_verdicts(blocks: List[Block], found: list) -> None:
    """The audits of a run end in the verdict the page states; a run with audits states one."""
    __tracebackhide__ = True
    stated, audits = stated_verdict(blocks), ", ".join(f"{kind} audit {verdict}" for kind, verdict in found)
    if found and stated is None:
        pytest.fail(f"{blocks[-1].id} ends in {audits} but states no verdict: say it on the page and mark the block "
                    "`<!-- verdict: OK -->` (or VIOLATION)", pytrace=False)
    if stated is not None and not found:
        pytest.fail(f"{blocks[-1].id} states the verdict {stated}, but no audit of its run audited anything", pytrace=False)
    if any(verdict != stated for _, verdict in found):
        pytest.fail(f"{blocks[-1].id}: the page states {stated}, the run ends in {audits}", pytrace=False)


@pytest.mark.parametrize("block", LEAVES, ids=[block.id for block in LEAVES])
def test_block_runs(block, runner, tmp_path):
    __tracebackhide__ = True
    if block.skip is not None:
        pytest.skip(f"{block.id}: not run: {block.skip}")
    blocks = chain(block)
    check_verdicts(blocks, run_blocks(runner, blocks, tmp_path))


def test_input_canaries_import_from_the_package():
    """The input-canary guide builds InputCanaries from the top level, as every public name."""
    import lightning_dpaudit
    from lightning_dpaudit import InputCanaries
    from lightning_dpaudit.engine.canaries.input_canaries import InputCanaries as defined

    assert InputCanaries is defined and "InputCanaries" in lightning_dpaudit.__all__
    assert "from lightning_dpaudit import InputCanaries" in (ROOT / "docs/guide/input-canaries.md").read_text()


def test_the_package_docstring_opens_with_both_ways_to_use_it():
    """help(lightning_dpaudit) starts with the Lightning callback and the plain-PyTorch auditor,
    each with its lines of code, before the package's layout."""
    import pydoc

    import lightning_dpaudit

    lines = lightning_dpaudit.__doc__.splitlines()
    opening = "\n".join(lines[:10])
    assert "Lightning" in lines[0] and "PyTorch" in lines[0]
    assert "Lightning:" in opening and "DPAuditCallback()" in opening and "callback.auditor.result()" in opening
    assert "Plain PyTorch:" in opening and "PrivacyAuditor(optimizer" in opening and "auditor.result()" in opening
    assert opening.index("DPAuditCallback") < opening.index("PrivacyAuditor(optimizer")
    assert lightning_dpaudit.__doc__.index("PrivacyAuditor(optimizer") < lightning_dpaudit.__doc__.index("Layers")
    synopsis, description = pydoc.splitdoc(pydoc.getdoc(lightning_dpaudit))  # help()'s NAME line and DESCRIPTION
    assert synopsis == lines[0] and description.startswith("Lightning:")


def test_a_correct_runs_summary_has_its_normalisation_note_on_one_short_line(one_thread):
    """Under Opacus's defaults (loss_reduction="mean") the summary's note is one line naming the page that
    explains it; the result keeps the full text."""
    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.datasets import make_private_digits, train_steps

    model, optimizer, loader, _ = make_private_digits(seed=0)
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=0)
    try:
        train_steps(model, optimizer, loader, 3)
        result = auditor.result()
        summary = auditor.summary()
    finally:
        auditor.detach()
    assert not result.violation and summary.startswith("OK: no leak beyond the claim detected")
    notes = [line for line in summary.splitlines() if line.lstrip().startswith("note:")]
    assert notes == [
        "  note: normalisation: the update is divided by expected_batch_size = 61, derived from the dataset's size; "
        "see docs/guide/data-path.md (Normalisation)"
    ]
    assert len(notes[0]) <= 160
    assert "**Normalisation**" in (ROOT / "docs/guide/data-path.md").read_text()  # the page and paragraph it names
    assert [note.split(":")[0] for note in result.notes] == ["normalisation"]
    assert "loss_reduction=\"sum\"" in result.notes[0] and len(result.notes[0]) > 200  # the full text
