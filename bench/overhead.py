"""Overhead of the auditor: the same training with and without it, alternating, in one run.

Digits CNN under Opacus (batch 64, Poisson sampling), `--steps` steps per timing. The
runs alternate A (no auditor), B (auditor) so that machine noise hits both alike; the
ratio of the medians is reported for each mode.

    .venv/bin/python bench/overhead.py [--steps 300] [--rounds 5] [--batch-size 64] [--canaries auto]
    .venv/bin/python bench/overhead.py --canary crafted --canaries 32 --modes one-run --steps 1000 --rounds 3
    .venv/bin/python bench/overhead.py --modes one-run --profile     # and where the audited step's time goes

`--modes` takes the audit's modes (one-run, paired) and `no-checks`: one-run with the exact
data-path checks off (per_sample_check_every=0), so that the checks' own share shows side by
side; the time spent inside the checks is also clocked within the one-run timings. The
auditor is given the loader (`watch_loader`, as the guides show), so the run checks run too: their
per-step work (each batch's fingerprint and records, each step's rows) is clocked on its own, and
their replays at the exact checks' steps count inside the exact checks.
(bench/data_path_overhead.py compares the same two on the 10 M transformer and a dropout model.)

Each mode's row gives the audit's own time per step in milliseconds (its median minus the
plain run's) beside the ratio. `--profile` then times one more audited run of the same length
with each part of the audited step clocked on its own (plant, the canaries' sum, entering and
leaving the clipped sum, the optimizer's own noise, reading the release, recording and checking,
the run checks, the exact checks), in ms per step: a regression shows where.

With an input canary kind both runs train on the digits less the 256 held out for the
canaries, and the time of building and re-crafting canaries is included.

Every timed run starts from the same state of Python's garbage collector: a full collection
just before it (`--no-settle` leaves that out). The collector runs a full pass once the
objects moved into its oldest generation since the last pass exceed a quarter of those
already there; each run moves some there (a batch in flight at a young collection), so
without the settling pass a run pays for the full pass its predecessors made due. With
plain and audited runs alternating, that pass (about 150 ms in this process) fell in the
audited runs at batch 512 in some processes, about 0.75 ms on each of their steps; in others
the plain runs page-faulted memory the audited runs before them had given back. The table
says how many full passes fell inside each configuration's timed runs.
"""

import argparse
import gc
import time
import warnings

import numpy as np
import torch

from lightning_dpaudit.engine.auditor import PrivacyAuditor
from lightning_dpaudit.integrations.digits import digits_holdout, make_private_digits, train_steps
from lightning_dpaudit.engine.canaries.input_canaries import INPUT_KINDS
from lightning_dpaudit.integrations.testing import HOLDOUT


SPENT = {"seconds": 0.0, "run checks": 0.0}  # time inside the exact checks (check and ledger) and the run checks' steps
FULL_PASSES = {"timing": False, "count": 0}  # the collector's full passes inside the timed run under way


def count_full_passes(phase: str, info: dict) -> None:
    """gc callback: counts the collector's full (oldest-generation) passes while a timed run is under way."""
    if FULL_PASSES["timing"] and phase == "start" and info["generation"] == 2:
        FULL_PASSES["count"] += 1


def clocked(function, key: str, spent: dict = SPENT):
    """`function`, its time added to spent[key] at each call."""
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start
    return run


def timed_checks(auditor) -> None:
    """Adds the time the auditor's exact check takes (the check at a step, the ledger's additions) to SPENT, and the
    checks' per-step hooks (each batch, each step) to SPENT["run checks"]. The runner's accumulation hook (the rows
    counted, the ledger's additions at checked steps) is timed with the step it belongs to, not apart."""
    check, runner = auditor.per_sample_check, auditor.checks
    check.check = clocked(check.check, "seconds")
    runner.batch, runner.step = clocked(runner.batch, "run checks"), clocked(runner.step, "run checks")


# the audited step's parts: (owner, attribute, label); a part's time includes the parts it calls
PARTS = (
    ("pipeline", "audited_step", "audited step (all of the below but the run checks and exact checks)"),
    ("kind", "plant", "  plant: the step's canaries"),
    ("path", "canary_sum", "  the canaries' clipped sum (pre-clipped between checks)"),
    ("path", "add_noise", "  the optimizer's own add_noise (also in the plain step)"),
    ("path", "view", "  reading the release at the pool"),
    ("kind", "read", "  the canaries' observations"),
    ("pipeline", "record_pending", "  recording and checking (every check_every steps)"),
    ("checks", "step", "checks' step hooks (run checks)"),
    ("checks", "batch", "checks' batch hooks (run checks)"),
    ("per_sample_check", "check", "exact checks (their steps only, amortised)"),
)


def profiled(auditor) -> dict:
    """Clocks each part of PARTS on this auditor's objects (instance attributes); returns the totals, in seconds."""
    spent = {}
    for owner, name, label in PARTS:
        obj = getattr(auditor, owner, None)
        if obj is None or not hasattr(obj, name):
            continue
        spent[label] = 0.0
        setattr(obj, name, clocked(getattr(obj, name), label, spent))
    return spent


def timed_training(*, steps, batch_size, mode, canaries, canary="dirac", profile=None, settle=True):
    holdout = HOLDOUT if canary in INPUT_KINDS else 0
    model, optimizer, loader, _ = make_private_digits(batch_size=batch_size, seed=0, holdout=holdout)
    if mode is not None:
        extra = {}
        if holdout:
            inputs, labels = digits_holdout(holdout)
            extra = {"module": model, "canary_inputs": inputs, "canary_labels": labels}
        if mode == "no-checks":
            mode, extra["per_sample_check_every"] = "one-run", 0
        auditor = PrivacyAuditor(optimizer, mode=mode, canaries_per_step=canaries, seed=0, canary=canary, **extra)
        if profile is not None:
            profile["spent"] = profiled(auditor)  # filled in as the run goes
        elif mode == "one-run" and "per_sample_check_every" not in extra:
            timed_checks(auditor)
        auditor.watch_loader(loader)
    if settle:
        gc.collect()  # the same collector state for every run: no full pass the runs before made due
    FULL_PASSES["timing"] = True
    start = time.perf_counter()
    try:
        train_steps(model, optimizer, loader, steps)
        return time.perf_counter() - start
    finally:
        FULL_PASSES["timing"] = False


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--canaries", default="auto", help="canaries per step (default: the auditor's)")
    parser.add_argument("--modes", nargs="+", default=["one-run", "paired"])
    parser.add_argument("--canary", default="dirac", help="canary kind (gradient or input)")
    parser.add_argument("--profile", action="store_true", help="then one audited run (the first mode) with its parts clocked")
    parser.add_argument("--no-settle", action="store_true",
                        help="no full garbage collection before each timed run (each run then inherits the others' garbage)")
    args = parser.parse_args()
    args.canaries = args.canaries if args.canaries == "auto" else int(args.canaries)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    timed_training(steps=20, batch_size=args.batch_size, mode="one-run", canaries=args.canaries, canary=args.canary)  # warm-up
    SPENT["seconds"] = SPENT["run checks"] = 0.0
    times = {None: [], **{m: [] for m in args.modes}}
    passes = dict.fromkeys(times, 0)
    gc.callbacks.append(count_full_passes)
    for _ in range(args.rounds):
        for mode in times:
            FULL_PASSES["count"] = 0
            times[mode].append(timed_training(steps=args.steps, batch_size=args.batch_size, mode=mode,
                                              canaries=args.canaries, canary=args.canary, settle=not args.no_settle))
            passes[mode] += FULL_PASSES["count"]
    base = np.median(times[None])
    print(f"canary={args.canary} steps={args.steps} rounds={args.rounds} batch={args.batch_size} canaries/step={args.canaries} threads=1")
    print("| run | median seconds | ms/step | audit ms/step | ratio to no auditor | full collections in its runs |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| no auditor | {base:.2f} | {1000 * base / args.steps:.2f} | | 1.00 | {passes[None]} |")
    for mode in args.modes:
        t = np.median(times[mode])
        print(f"| {mode} | {t:.2f} | {1000 * t / args.steps:.2f} | {1000 * (t - base) / args.steps:.3f} | {t / base:.3f} "
              f"| {passes[mode]} |")
    print("(each timed run " + ("without" if args.no_settle else "after") + " a full garbage collection before it)")
    if "one-run" in args.modes:
        inside = SPENT["seconds"] / sum(times["one-run"])
        line = f"exact data-path checks (default interval): time inside them {inside:.2%} of the one-run timings"
        if "no-checks" in args.modes:
            line += (f"; one-run / no-checks: {np.median(times['one-run']) / np.median(times['no-checks']):.3f} "
                     f"(medians), {sum(times['one-run']) / sum(times['no-checks']):.3f} (sums)")
        print(line)
        print(f"run checks' per-step work (fingerprints, records, rows): {SPENT['run checks'] / sum(times['one-run']):.2%} "
              "of the one-run timings")
    if args.profile:
        profile_parts(args)


def profile_parts(args) -> None:
    """One more audited run of the first mode with each part of PARTS clocked (the clocks' own cost included)."""
    mode = args.modes[0]
    profile: dict = {}
    total = timed_training(steps=args.steps, batch_size=args.batch_size, mode=mode, canaries=args.canaries,
                           canary=args.canary, profile=profile)
    spent = profile["spent"]
    print(f"\nwhere the time of an audited run ({mode}, {1000 * total / args.steps:.2f} ms/step with the clocks) goes:")
    print("| part | ms/step |")
    print("| --- | --- |")
    for label, seconds in spent.items():
        print(f"| {label} | {1000 * seconds / args.steps:.3f} |")


if __name__ == "__main__":
    main()
