"""Overhead of the audit in `dpaudit demo`: the same command with and without --no-audit.

Runs `dpaudit demo --steps N` and `dpaudit demo --steps N --no-audit` alternately, each
in a fresh process, and reports the ratio of the median wall times (whole command:
start-up, training, logging, report).

    .venv/bin/python bench/cost/demo_overhead.py [--steps 600] [--rounds 3]
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _path import harness


def timed(args, out):
    command = [sys.executable, "-m", "lightning_dpaudit.app.cli", "demo", "--no-progress-bar", "--out", out, *args]
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - start


def main():
    parser = harness.parser(__doc__, steps=600, rounds=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        times = harness.alternate({
            "no audit": lambda _: timed(["--steps", str(args.steps), "--no-audit"], str(Path(out) / "a")),
            "audit": lambda _: timed(["--steps", str(args.steps)], str(Path(out) / "b")),
        }, args.rounds)
    medians = harness.medians(times)
    base, audited = medians["no audit"], medians["audit"]
    print(f"dpaudit demo --steps {args.steps}, {args.rounds} rounds alternating")
    print(harness.header("run", "median seconds", "ratio"))
    print(f"| --no-audit | {base:.1f} | 1.00 |")
    print(f"| audited (default) | {audited:.1f} | {audited / base:.2f} |")


if __name__ == "__main__":
    main()
