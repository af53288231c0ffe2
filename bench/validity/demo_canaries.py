"""Wall time and bound of `dpaudit demo --canary KIND` at each kind's defaults.

Each kind runs in a fresh process (whole command: start-up, training, logging, report);
the table gives the steps and canaries the demo chose, the seconds, the epsilon lower
bound of audit_report.json and the 1-minute load average before and after the run
(the machine's other work shows there).

    .venv/bin/python bench/validity/demo_canaries.py [--kinds crafted blank ...] [--threads N]
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _path import harness

KINDS = ["dirac", "constant", "random", "mislabeled", "blank", "adversarial", "crafted"]


def run(kind, out, threads):
    command = [sys.executable, "-m", "lightning_dpaudit.app.cli", "demo", "--canary", kind, "--no-progress-bar", "--out", out]
    if threads:
        command += ["--threads", str(threads)]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    chosen = next(line for line in done.stdout.splitlines() if line.startswith("canary "))
    result = json.loads(next(Path(out).rglob("audit_report.json")).read_text())["result"]
    return chosen, seconds, result, load_before, os.getloadavg()[0]


def main():
    parser = harness.parser(__doc__)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS)
    parser.add_argument("--threads", type=int, default=None, help="the demo's --threads (default: torch's choice)")
    args = parser.parse_args()
    print(harness.header("canary", "chosen", "seconds", "eps lower bound", "eps accountant", "n in / out",
                         "load before / after"))
    for kind in args.kinds:
        with tempfile.TemporaryDirectory() as out:
            chosen, seconds, r, before, after = run(kind, out, args.threads)
        chosen = chosen.split(": ", 1)[1]
        print(f"| {kind} | {chosen} | {seconds:.1f} | {r['epsilon_lower_bound']:.3f} | {r['epsilon_accountant']:.3f} | "
              f"{r['n_in']} / {r['n_out']} | {before:.1f} / {after:.1f} |", flush=True)


if __name__ == "__main__":
    main()
