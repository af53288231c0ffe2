"""Catch a broken DP-SGD implementation: noise calibrated to C/B instead of C.

The bug zoo's "mean-sensitivity" optimizer claims the same noise multiplier as Opacus
but adds noise for the batch-mean sensitivity (the Backpropagation Clipping bug). The
audit raises its alarm within a few steps.

    .venv/bin/python examples/catch_a_bug.py [--bug mean-sensitivity] [--steps 300]
"""

import argparse

from lightning_dpaudit import PrivacyAuditFailure, audit_optimizer
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
    args = parser.parse_args()
    main(args.bug, args.steps)
