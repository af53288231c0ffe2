"""What the bench scripts share: the import path, alternating timings and clocks.

A script, run as `python bench/<role>/<name>.py`, imports this module with one line, `from _path import harness`
(bench/<role>/_path.py puts bench/ on the import path).

    ROOT, on_path("tests")                    the repository, and its folders whose set-ups the bench shares
                                              (tests/ghost_setups.py, examples/_transformer.py, ...) importable
    alternate({"A": a, "B": b}, rounds)       each run's times, the runs taking turns; medians(), median_ratio()
    clocked(function, spent, key), clock()    a function's or method's time added up at each call
"""

from __future__ import annotations

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
