"""Catch a broken DP-SGD implementation: noise calibrated to C/B instead of C.

The bug zoo's "mean-sensitivity" optimizer claims the same noise multiplier as Opacus
but adds noise for the batch-mean sensitivity (the Backpropagation Clipping bug). The
audit raises its alarm within a few steps.

    .venv/bin/python examples/catch_a_bug.py [--bug mean-sensitivity] [--steps 300] [--threads 1]

--threads N sets torch's intra-op threads before any work (default 1: the model is small,
so more threads add overhead, and on cores shared with other work they wait for each other).
"""

import argparse

import torch

from lightning_dpaudit.testing import PrivacyAuditFailure, audit_optimizer
from lightning_dpaudit.integrations.bugs import BUGS


def main(bug: str, steps: int) -> None:
    print(f"auditing the bug-zoo optimizer {bug!r}: {BUGS[bug]}")
    try:
        audit_optimizer(bug=bug, steps=steps)
    except PrivacyAuditFailure as failure:
        print(f"caught: {failure}")
    else:
        print("the audit found no leak")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bug", default="mean-sensitivity", choices=sorted(BUGS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: the model is small, more threads only add overhead)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # before any work
    print(f"torch threads: {torch.get_num_threads()} (--threads)")
    main(args.bug, args.steps)
