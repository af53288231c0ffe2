"""Where an audited step's time goes: the auditor's phases timed inside one training run.

Digits CNN, batch 64, default auditor, 1 thread; each phase is wrapped with a timer and
reported in ms per step next to the whole step.

    .venv/bin/python bench/cost/step_cost.py [--steps 300] [--batch-size 64] [--check-every 8]
"""

import collections
import time
import warnings

from _path import harness

import torch

from lightning_dpaudit.engine.auditor import PrivacyAuditor
from lightning_dpaudit.engine.options import BATCHED_CHECK_EVERY
from lightning_dpaudit.integrations.digits import make_private_digits, train_steps


def main():
    parser = harness.parser(__doc__, steps=300, batch_size=64)
    parser.add_argument("--check-every", type=int, default=BATCHED_CHECK_EVERY)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    times = collections.defaultdict(float)
    model, optimizer, loader, _ = make_private_digits(batch_size=args.batch_size, seed=0)
    auditor = PrivacyAuditor(optimizer, seed=0, check_every=args.check_every)
    record = auditor.record
    for obj, name, label in [
        (auditor.kind.sampler, "next_step", "plant: draw canaries"),
        (auditor.kind.probe, "canary_rows", "plant: build compressed rows"),
        (auditor.kind.probe, "clip", "release: optimizer's clipping of the canary rows"),
        (auditor.path, "add_noise", "release: add_noise (the step's own)"),
        (auditor.path, "view", "read: gather the release at the pool"),
        (auditor.kind, "read", "read: project the canaries"),
        (auditor.pipeline, "check", "record + check (batched)"),
        (auditor.pipeline.readings, "flush", "  of which: move to the host"),
        (record.fingerprints, "check", "  of which: noise fingerprints"),
        (record.log, "append", "  of which: observation store"),
        (record.monitor, "advance", "  of which: monitor counts and tests"),
    ]:
        harness.clock(obj, name, times, label)
    harness.clock(optimizer, "add_noise", times, "whole audited add_noise")  # the pipeline's audited_step
    start = time.perf_counter()
    train_steps(model, optimizer, loader, args.steps)
    total = time.perf_counter() - start
    print(f"canaries/step={auditor.options.canaries_per_step} batch={args.batch_size} steps={args.steps} check_every={args.check_every} threads=1")
    print(harness.header("phase", "ms/step"))
    print(f"| whole training step | {1000 * total / args.steps:.3f} |")
    for label, seconds in times.items():
        print(f"| {label} | {1000 * seconds / args.steps:.3f} |")


if __name__ == "__main__":
    main()
