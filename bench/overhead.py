"""Overhead of the auditor: the same training with and without it, alternating, in one run.

Digits CNN under Opacus (batch 64, Poisson sampling), `--steps` steps per timing. The
runs alternate A (no auditor), B (auditor) so that machine noise hits both alike; the
ratio of the medians is reported for each mode.

    .venv/bin/python bench/overhead.py [--steps 300] [--rounds 5] [--batch-size 64] [--canaries auto]
    .venv/bin/python bench/overhead.py --canary crafted --canaries 32 --modes one-run --steps 1000 --rounds 3

With an input canary kind both runs train on the digits less the 256 held out for the
canaries, and the time of building and re-crafting canaries is included.
"""

import argparse
import time
import warnings

import numpy as np
import torch

from lightning_dpaudit.engine.auditor import PrivacyAuditor
from lightning_dpaudit.integrations.digits import digits_holdout, make_private_digits, train_steps
from lightning_dpaudit.engine.kinds.input_canaries import INPUT_KINDS
from lightning_dpaudit.testing import HOLDOUT


def timed_training(*, steps, batch_size, mode, canaries, canary="dirac"):
    holdout = HOLDOUT if canary in INPUT_KINDS else 0
    model, optimizer, loader, _ = make_private_digits(batch_size=batch_size, seed=0, holdout=holdout)
    if mode is not None:
        extra = {}
        if holdout:
            inputs, labels = digits_holdout(holdout)
            extra = {"module": model, "canary_inputs": inputs, "canary_labels": labels}
        PrivacyAuditor(optimizer, mode=mode, canaries_per_step=canaries, seed=0, canary=canary, **extra)
    start = time.perf_counter()
    train_steps(model, optimizer, loader, steps)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--canaries", default="auto", help="canaries per step (default: the auditor's)")
    parser.add_argument("--modes", nargs="+", default=["one-run", "paired"])
    parser.add_argument("--canary", default="dirac", help="canary kind (gradient or input)")
    args = parser.parse_args()
    args.canaries = args.canaries if args.canaries == "auto" else int(args.canaries)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    timed_training(steps=20, batch_size=args.batch_size, mode="one-run", canaries=args.canaries, canary=args.canary)  # warm-up
    times = {None: [], **{m: [] for m in args.modes}}
    for _ in range(args.rounds):
        for mode in times:
            times[mode].append(
                timed_training(steps=args.steps, batch_size=args.batch_size, mode=mode, canaries=args.canaries, canary=args.canary)
            )
    base = np.median(times[None])
    print(f"canary={args.canary} steps={args.steps} rounds={args.rounds} batch={args.batch_size} canaries/step={args.canaries} threads=1")
    print(f"| run | median seconds | ms/step | ratio to no auditor |")
    print("| --- | --- | --- | --- |")
    print(f"| no auditor | {base:.2f} | {1000 * base / args.steps:.2f} | 1.00 |")
    for mode in args.modes:
        t = np.median(times[mode])
        print(f"| {mode} | {t:.2f} | {1000 * t / args.steps:.2f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
