"""What the bench scripts share: the import path, the shared flags, alternating timings, clocks, markdown tables.

A script, run as `python bench/<role>/<name>.py`, imports this module with one line, `from _path import harness`
(bench/<role>/_path.py puts bench/ on the import path).

    ROOT, on_path("tests")                    the repository, and its folders whose set-ups the bench shares
                                              (tests/ghost_setups.py, examples/_transformer.py, ...) importable
    parser(__doc__, steps=300, rounds=5)      an ArgumentParser with the shared flags; flags() adds more of them
    alternate({"A": a, "B": b}, rounds)       each run's times, the runs taking turns; medians(), median_ratio()
    step_by_step({"A": a, "B": b}, steps)     each step's time, the runs taking turns step by step
    clocked(function, spent, key), clock()    a function's or method's time added up at each call
    header("a", "b"), row(x, y)               markdown table lines
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Hashable, List, Optional

ROOT = Path(__file__).resolve().parents[1]  # the repository


# ---------------------------------------------------------------------------------------------- import path


def on_path(*folders: str) -> None:
    """Puts these folders of the repository (names relative to ROOT; "." is ROOT itself, its lightning_dpaudit) first
    on the import path, each before the script's own folder: tests/recipes.py is the module `recipes`, not
    bench/validity/recipes.py."""
    for folder in folders:
        path = str(ROOT / folder)
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)


# ---------------------------------------------------------------------------------------------- flags


def canaries_per_step(text: str):
    """--canaries: "auto" (the auditor's own count) or a number."""
    return text if text == "auto" else int(text)


FLAGS = {  # the flags several scripts take, by keyword: (option, its add_argument keywords but the default)
    "steps": ("--steps", dict(type=int)),
    "rounds": ("--rounds", dict(type=int)),
    "batch_size": ("--batch-size", dict(type=int)),
    "canaries": ("--canaries", dict(type=canaries_per_step, help="canaries per step (default: the auditor's)")),
    "seed": ("--seed", dict(type=int)),
    "seeds": ("--seeds", dict(type=int, nargs="+")),
    "threads": ("--threads", dict(type=int)),
}


def flags(parser: argparse.ArgumentParser, **defaults) -> argparse.ArgumentParser:
    """Adds the shared flags named (keys of FLAGS), in the order given, with these defaults."""
    for name, default in defaults.items():
        option, keywords = FLAGS[name]
        parser.add_argument(option, default=default, **keywords)
    return parser


def parser(doc: str, *, full_doc: bool = False, **defaults) -> argparse.ArgumentParser:
    """The script's parser: its docstring's first line as the description (`full_doc`: the whole docstring, as
    written), then the shared flags named, in the order given."""
    if full_doc:
        made = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    else:
        made = argparse.ArgumentParser(description=doc.splitlines()[0])
    return flags(made, **defaults)


# ---------------------------------------------------------------------------------------------- timings


def alternate(runs: Dict[Hashable, Callable[[int], float]], rounds: int, *, swap: bool = False,
              before: Optional[Callable[[], object]] = None) -> Dict[Hashable, List[float]]:
    """Each run once per round, in turns, so that the machine's noise hits them alike: run(round) returns its time.
    The runs go in the dict's order (reversed every other round with `swap`), `before()` ahead of each."""
    times = {name: [] for name in runs}
    for r in range(rounds):
        order = list(runs)[::-1] if swap and r % 2 else list(runs)
        for name in order:
            if before is not None:
                before()
            times[name].append(runs[name](r))
    return times


def step_by_step(steppers: Dict[Hashable, Callable[[], float]], steps: int, *, warm_up: int = 20,
                 collect_every: int = 100) -> Dict[Hashable, List[float]]:
    """Each stepper's time of each of `steps` steps, the steppers taking turns step by step (the order swapped every
    step), so that noise lasting longer than a step hits them alike. stepper() runs one training step and returns its
    seconds. The garbage collector runs between steps every `collect_every` steps, never inside one."""
    import gc

    names = list(steppers)
    for _ in range(warm_up):
        for name in names:
            steppers[name]()
    times = {name: [] for name in names}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(steps):
            if i % collect_every == 0:
                gc.collect()
            for name in (names if i % 2 == 0 else names[::-1]):
                times[name].append(steppers[name]())
    finally:
        if was_enabled:
            gc.enable()
    return times


def medians(times: Dict[Hashable, List[float]]) -> Dict[Hashable, float]:
    return {name: statistics.median(values) for name, values in times.items()}


def median_ratio(times: Dict[Hashable, List[float]], base: Hashable, other: Hashable) -> float:
    """The median time of `other` over the median time of `base`."""
    return statistics.median(times[other]) / statistics.median(times[base])


def clocked(function: Callable, spent: dict, key: Hashable) -> Callable:
    """`function`, its time added to spent[key] at each call."""
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start
    return run


def clock(obj, name: str, spent: dict, key: Hashable) -> None:
    """obj.name clocked into spent[key] (an attribute of this object: its class is left alone)."""
    setattr(obj, name, clocked(getattr(obj, name), spent, key))


# ---------------------------------------------------------------------------------------------- markdown


def row(*cells) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def header(*columns) -> str:
    """A table's first two lines: the columns' names and the line under them."""
    return row(*columns) + "\n" + row(*["---"] * len(columns))
