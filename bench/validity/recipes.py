"""Practitioner DP-SGD recipes under the audit: each correct recipe quiet, each buggy twin flagged.

The recipes are defined once, in tests/recipes.py (tests/test_recipes.py runs each once, briefly). For each
recipe this runs `--runs` seeds (0, 1, ...) of `--steps` steps of the correct recipe and of its twin, audited as
the guides show; a run stops at its first alarm. A correct run passes when it is quiet (no violation, no finding)
and every check compared something or declined saying why where the recipe says it does (a stopped check, a failed
audit, a check that compared nothing without a reason, or a decline the recipe does not name fails it); a twin passes when it is a violation with one of the recipe's expected finding
codes. A recipe marked as a known failure (a correct recipe the audit flags, the limitation named) is printed as
such and does not fail the bench; it fails the bench if it stops failing, so that the mark is removed.

The canaries' alarm has a false-alarm budget of 5% per correct run (tests/test_ghost.py's docstring): over many
seeds a correct recipe may be flagged by it, with a canary finding and no pipeline or data-path finding.

    OMP_NUM_THREADS=1 .venv/bin/python bench/validity/recipes.py [--recipes NAME ...] [--runs 20] [--steps 300] [--fast] [--list]

Exits with status 1 when a recipe fails, 0 otherwise.
"""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import List

from _path import harness

import torch

harness.on_path("tests")  # tests/ first: its recipes.py, not this file, is the module `recipes`
from recipe_runs import Recipe, flagged, quiet, uncompared  # noqa: E402
from recipes import RECIPES  # noqa: E402

FAST = dict(runs=2, steps=40)


@dataclass
class Tally:
    """What one recipe's runs gave."""

    runs: int = 0
    quiet: int = 0
    flagged: int = 0
    codes: List[str] = field(default_factory=list)  # the twin's finding codes, in order of first appearance
    problems: List[str] = field(default_factory=list)  # "seed N correct|twin: why", one a failed run
    declined: List[str] = field(default_factory=list)  # statuses of correct runs' checks that compared nothing, said why
    seconds: float = 0.0


def run_one(recipe: Recipe, seed: int, steps: int, tally: Tally) -> None:
    tally.runs += 1
    for kind in ("correct", "twin"):
        try:
            result = getattr(recipe, kind)(seed, steps)
        except Exception as error:  # the recipe itself broke: a failure, named
            tally.problems.append(f"seed {seed} {kind}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            continue
        if kind == "correct":
            problems = quiet(result)
            declined = uncompared(result)[1]
            tally.declined += [s for s in declined if s not in tally.declined]
            problems += [f"declined: {s}" for s in declined if not any(d in s for d in recipe.declines)]
            tally.quiet += not problems
        else:
            problems = flagged(result, recipe.expected)
            tally.flagged += not problems
            tally.codes += [f.code for f in result.findings if f.code not in tally.codes]
        tally.problems += [f"seed {seed} {kind}: {p}" for p in problems]


def status(recipe: Recipe, tally: Tally) -> str:
    """ok, FAIL, known failure, or FAIL (known failure passes: remove the mark)."""
    twin_ok = tally.flagged == tally.runs
    if recipe.known_failure is not None:
        if tally.quiet == tally.runs and twin_ok:
            return "FAIL (known failure passes: remove the mark)"
        return "known failure" if twin_ok else "FAIL"
    return "ok" if tally.quiet == tally.runs and twin_ok else "FAIL"


def table(rows) -> str:
    header = ("recipe", "quiet runs / runs", "twin flagged", "twin's finding codes", "seconds", "status")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for recipe, tally in rows:
        cells = (recipe.name, f"{tally.quiet} / {tally.runs}", f"{tally.flagged} / {tally.runs}",
                 ", ".join(tally.codes) or "none", f"{tally.seconds:.0f}", status(recipe, tally))
        lines.append(harness.row(*cells))
    return "\n".join(lines)


def details(rows) -> str:
    out = []
    for recipe, tally in rows:
        if recipe.known_failure is not None:
            out.append(f"{recipe.name}: known failure: {recipe.known_failure}")
        for problem in tally.problems[:5]:
            out.append(f"{recipe.name}: {problem[:400]}")
        if len(tally.problems) > 5:
            out.append(f"{recipe.name}: ... {len(tally.problems) - 5} more")
        for declined in tally.declined:
            out.append(f"{recipe.name}: declined by design (correct run): {declined}")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES), metavar="NAME",
                        help=f"recipes to run (default all: {', '.join(RECIPES)})")
    parser.add_argument("--runs", type=int, default=20, help="seeds per recipe (default 20)")
    parser.add_argument("--steps", type=int, default=300, help="steps per run (default 300); a run stops at its alarm")
    parser.add_argument("--fast", action="store_true", help=f"a small subset: {FAST['runs']} runs of {FAST['steps']} steps")
    parser.add_argument("--list", action="store_true", help="list the recipes and exit")
    args = parser.parse_args(argv)
    if args.list:
        for recipe in RECIPES.values():
            mark = " [known failure]" if recipe.known_failure else ""
            print(f"{recipe.name}{mark}: {recipe.summary}; twin: {recipe.twin_summary} ({', '.join(recipe.expected)})")
        return 0
    runs, steps = (FAST["runs"], FAST["steps"]) if args.fast else (args.runs, args.steps)
    if runs < 1 or steps < 1:
        parser.error(f"--runs and --steps must be at least 1, got {runs} and {steps}")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(f"{len(args.recipes)} recipe(s), {runs} run(s) of {steps} steps each (correct and twin)", flush=True)
    rows = []
    for i, name in enumerate(args.recipes, 1):
        recipe, tally = RECIPES[name], Tally()
        start = time.perf_counter()
        for seed in range(runs):
            run_one(recipe, seed, steps, tally)
            tally.seconds = time.perf_counter() - start
            print(f"[{i}/{len(args.recipes)}] {name}: seed {seed + 1}/{runs}, quiet {tally.quiet}, twin flagged "
                  f"{tally.flagged}, {tally.seconds:.0f} s", flush=True)
        rows.append((recipe, tally))
    print()
    print(table(rows))
    text = details(rows)
    if text:
        print()
        print(text)
    return int(any(status(recipe, tally).startswith("FAIL") for recipe, tally in rows))


if __name__ == "__main__":
    sys.exit(main())
