"""Bad and unusual input across the public surface: each case runs in its own process and is classified.

    OMP_NUM_THREADS=1 .venv/bin/python bench/robustness/probe.py [--only SUBSTRING] [--list]

Classes (each case states the one it expects):
  refused       a clear ValueError/TypeError/RuntimeError (AuditStateError, ReportError, a CLI usage error)
                naming the option, raised by the call that took the bad input
  handled       ran and gave a valid result (how it was checked is printed beside it)
  late          refused clearly, but only later (at the first step, at fit, or as the audit's own failure)
  raw           an unhelpful internal exception (AttributeError, IndexError, a numpy/torch message)
  silent-wrong  accepted and gave a wrong or misleading result ("OK" with nothing audited, a violation
                from noise, a model that differs from plain Opacus's)
  runaway       over the time limit (60 s) or the memory cap (4 GiB of address space)

Cases run one at a time, each in a process forked from a server that has imported torch, Opacus and
Lightning (multiprocessing's "forkserver"), so a case cannot disturb the next. A progress line is printed
every 25 cases, then the table and the totals per class.

The cases live in probe_cases/, one module per area (probe_cases/__init__.py lists them in order).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import sys
import time
import traceback
from typing import Tuple

from _path import harness
from probe_cases import all_cases
from probe_cases.common import CLASSES, describe, quiet

os.environ.setdefault("OMP_NUM_THREADS", "1")
harness.on_path(".")  # this checkout's lightning_dpaudit, whatever PYTHONPATH says

TIMEOUT = 60.0
MEMORY = 4 * 2**30


def _child(name, connection):
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    sys.stdout = open(os.devnull, "w")  # summaries the cases print (the callback's at the end of fit)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
        quiet()
        case = next(c for c in all_cases() if c.name == name)
        cls, detail = case.run()
    except MemoryError as error:
        cls, detail = "runaway", describe(error)
    except BaseException as error:  # noqa: BLE001  the case's own code failed: report it as raw
        cls, detail = "raw", f"probe: {describe(error)} {traceback.format_exc().splitlines()[-3][:80]}"
    try:
        connection.send((cls, detail))
    finally:
        connection.close()


def run_case(context, name) -> Tuple[str, str, float]:
    receive, send = context.Pipe(duplex=False)
    start = time.perf_counter()
    process = context.Process(target=_child, args=(name, send))
    process.start()
    send.close()
    outcome = None
    if receive.poll(TIMEOUT):
        try:
            outcome = receive.recv()
        except EOFError:
            outcome = None
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join()
        if outcome is None:
            return "runaway", f"over {TIMEOUT:.0f} s", time.perf_counter() - start
    if outcome is None:
        code = process.exitcode
        return "runaway" if code in (-9, -6) else "raw", f"process died (exit {code})", time.perf_counter() - start
    return outcome[0], outcome[1], time.perf_counter() - start


def main(argv=None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--only", default=None, help="run the cases whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--verbose", action="store_true", help="also print each case's line as it ends")
    args = parser.parse_args(argv)
    cases = [c for c in all_cases() if args.only is None or args.only in c.name]
    if args.list:
        for c in cases:
            print(f"{c.expect:8s} {c.name}")
        print(f"{len(cases)} cases")
        return 0
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "opacus", "pytorch_lightning", "sklearn.datasets", "lightning_dpaudit",
                                    "lightning_dpaudit.engine.auditor", "lightning_dpaudit.integrations.callback"])
    rows, totals = [], {c: 0 for c in CLASSES}
    start = time.perf_counter()
    for i, case in enumerate(cases, 1):
        cls, detail, seconds = run_case(context, case.name)
        rows.append((case, cls, detail, seconds))
        totals[cls] += 1
        if args.verbose:
            print(f"  {case.name[:58]:58s} {case.expect:9s} {cls:13s} {seconds:5.1f}  {detail}", flush=True)
        if i % 25 == 0 or i == len(cases):
            print(f"[{i}/{len(cases)}] {time.perf_counter() - start:.0f} s  " +
                  "  ".join(f"{c}={n}" for c, n in totals.items() if n), flush=True)
    print()
    print(f"{'case':58s} {'expected':9s} {'got':13s} {'s':>5s}  detail")
    for case, cls, detail, seconds in rows:
        mark = "" if cls == case.expect else " *"
        print(f"{case.name[:58]:58s} {case.expect:9s} {cls + mark:13s} {seconds:5.1f}  {detail}")
    print()
    print(f"{len(rows)} cases in {time.perf_counter() - start:.0f} s")
    for c in CLASSES:
        print(f"  {c:13s} {totals[c]:4d}  ({100 * totals[c] / max(1, len(rows)):.1f}%)")
    unexpected = sum(1 for case, cls, _, _ in rows if cls != case.expect)
    print(f"  differing from the expected class: {unexpected}")
    bad = totals["late"] + totals["raw"]
    print(f"  late + raw: {bad} ({100 * bad / max(1, len(rows)):.1f}%); silent-wrong: {totals['silent-wrong']}; "
          f"runaway: {totals['runaway']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
