"""The `dpaudit` command: `dpaudit demo` trains and audits; `dpaudit report DIR` summarizes.

`dpaudit report DIR` is a CI gate over every audit_report.json at or below DIR (`--latest`: the
newest alone). Each report's status: 0 when it is OK, VIOLATION_EXIT (3) when it records a
violation, FAILED_EXIT (4) when the audit failed (its record is incomplete), DIVERGED_EXIT (5) when
training diverged (nothing after it was audited), 1 when it is damaged;
the command exits with the worst of them (WORST_FIRST), 1 when there is no report, 2 for a bad
argument.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional

from .limits import MIN_NOISE_MULTIPLIER

# Canary kinds of canaries.KINDS and input_canaries.INPUT_KINDS, named here so that
# building the parser does not import torch.
GRADIENT_CANARIES = ("dirac", "constant", "random")
INPUT_CANARIES = ("mislabeled", "blank", "adversarial", "crafted")
FINAL_MODEL_CANARIES = ("ood", "mislabeled", "blank", "crafted")  # final_model.FINAL_MODEL_KINDS
VIOLATION_EXIT = 3  # `dpaudit report` on a report that records a violation
FAILED_EXIT = 4  # `dpaudit report` on a report whose audit failed: its record is incomplete
DIVERGED_EXIT = 5  # `dpaudit report` on a report whose training diverged: the steps from there on went unaudited
DAMAGED_EXIT = 1  # `dpaudit report` with no report, or a damaged one
# The statuses of several reports, worst first: the command exits with the first that any report has. A
# violation is a leak the numbers prove (even from an incomplete record), so it outranks everything; a failed
# audit proves that part of the run went unaudited, so its OK verdict stands on nothing; so does a run whose training
# diverged, for the steps from there on; a damaged report says nothing about its run, but it does not vouch for it
# either; 0 only when every report is OK.
WORST_FIRST = (VIOLATION_EXIT, FAILED_EXIT, DIVERGED_EXIT, DAMAGED_EXIT, 0)


def _demo(args) -> int:
    from ..integrations.bugs import BUGS

    if args.list_bugs:
        for name, description in BUGS.items():
            print(f"{name:24s} {description}")
        return 0
    if args.bug is not None and args.bug not in BUGS:  # "" too: an empty name is no bug of the zoo
        print(f"dpaudit demo: Unexpected value for `--bug`: unknown bug {args.bug!r}; use one of {', '.join(BUGS)} "
              "(`dpaudit demo --list-bugs` describes them)", file=sys.stderr)
        return 2
    from .demo import demo_plan, run_demo

    if not args.no_audit:
        plan = demo_plan(args.canary, args.steps, args.canaries)
        source = f" from the {plan['source']}" if plan["source"] else ""
        print(f"canary {args.canary!r}: {plan['canaries_per_step']} per step{source}, {plan['steps']} steps")
        if args.final_model:
            print(f"final model: {args.final_model} {args.final_model_kind!r} canaries, each trained on with probability 1/2")
    import torch

    torch.set_num_threads(args.threads)  # before any work (DEMO_THREADS by default)
    print(f"torch threads: {torch.get_num_threads()} (--threads)")
    start = time.perf_counter()
    trainer, callback = run_demo(
        steps=args.steps,
        noise_multiplier=args.noise_multiplier,
        canary=args.canary,
        canaries_per_step=args.canaries,
        bug=args.bug,
        audit=not args.no_audit,
        out=args.out,
        seed=args.seed,
        progress_bar=not args.no_progress_bar,
        final_model=args.final_model,
        final_model_kind=args.final_model_kind,
    )
    seconds = time.perf_counter() - start
    log_dir = trainer.logger.log_dir
    print(f"\ntrained {trainer.global_step} steps in {seconds:.1f} s; logs in {log_dir}")
    if callback is not None:
        print(f"see the curves:  .venv/bin/tensorboard --logdir {Path(args.out).resolve()}  (then open http://localhost:6006)")
        print(f"summary again:   .venv/bin/dpaudit report {log_dir}")
        if callback.alerted:
            print("the audit found a leak: see the warning above and the report")
    return 0


def _report(args) -> int:
    """Gate on every report at or below the directory (the newest alone with --latest): print each one's path, summary
    and verdict, and exit with the worst status (WORST_FIRST): VIOLATION_EXIT (3), FAILED_EXIT (4), 1 when there is
    no report or load_report refuses one (damaged, foreign, NaN or out-of-range numbers, a verdict its numbers
    contradict: the message names the field), 0 when every report is OK; 2 when the directory is not one."""
    directory = Path(args.directory)
    if not directory.is_dir():
        print(f"dpaudit report: {directory} is not a directory", file=sys.stderr)
        return 2
    reports = sorted(directory.rglob("audit_report.json"), key=lambda p: (p.stat().st_mtime, str(p)))
    if not reports:
        print(f"no audit_report.json in {directory} or below it", file=sys.stderr)
        return DAMAGED_EXIT
    if args.latest:
        reports = reports[-1:]  # the most recent audit at or below the directory
    statuses = []
    for number, path in enumerate(reports):
        if number:
            print()
        statuses.append(_gate_one(path.parent))
    if len(statuses) > 1:
        counts = {status: statuses.count(status) for status in WORST_FIRST if status in statuses}
        names = {VIOLATION_EXIT: "violation", FAILED_EXIT: "audit failed", DIVERGED_EXIT: "training diverged",
                 DAMAGED_EXIT: "damaged", 0: "OK"}
        print(f"\n{len(statuses)} reports: " + ", ".join(f"{n} {names[status]}" for status, n in counts.items()))
    return next(status for status in WORST_FIRST if status in statuses)


def _gate_one(run: Path) -> int:
    """One report's path line, summary and verdict; its status (0, VIOLATION_EXIT, FAILED_EXIT, DIVERGED_EXIT or
    DAMAGED_EXIT)."""
    from ..analysis.report import summary_table
    from ..analysis.report_reading import ReportError, load_report
    from ..analysis.results import DIVERGED

    try:
        report = load_report(run)
    except ReportError as error:
        print(f"dpaudit report: {error}", file=sys.stderr)
        return DAMAGED_EXIT
    print(f"audit report in {run}")
    print(summary_table(report))
    failed = report["result"].get("audit_failed")
    if failed is not None:
        print(f"the audit failed: its record is incomplete ({failed})")
    diverged = next((f for f in report["result"].get("findings") or () if f["code"] == DIVERGED), None)
    if diverged is not None:
        print(f"the audit covers only the steps before training diverged ({diverged['message'].split(':')[0]})")
    if report["result"]["violation"]:
        return VIOLATION_EXIT  # the stronger claim, even with a failure
    return FAILED_EXIT if failed is not None else DIVERGED_EXIT if diverged is not None else 0


def _at_least(minimum: int, maximum: Optional[int] = None, why: str = ""):
    """An argparse type: an integer >= minimum, and <= maximum if given (`why` says what sets it); argparse
    prints the usage error and exits with 2."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}; use an integer >= {minimum}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{value} is above {maximum}{why}; use an integer in [{minimum}, {maximum}]")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


CPUS = os.cpu_count() or 1
# The demo's CNN has 9,802 parameters: its operations are too small to split across threads, and a
# second thread on cores shared with other work waits for them (200 steps: 5-8 s on one thread,
# 65-75 s on two, on a 2-core machine shared with other jobs).
DEMO_THREADS = 1
MAX_STEPS = 10**6  # the demo's optimizer steps: about a day on one thread (200 steps: 5-8 s)
MAX_SEED = 2**32 - 1  # numpy's seeds (the demo's data split, canaries and noise draw from it)
MAX_FINAL_MODEL = 10**6  # final-model canaries: held in memory and scored at once (final_model/canaries.MAX_CANARIES)
MAX_THREADS = 4 * CPUS  # torch.set_num_threads far above the cores can exhaust the process (a crash, not an error)
AUDIT_ONLY = ("--canaries", "--final-model", "--final-model-kind")  # flags that mean nothing under --no-audit


def _check_demo_flags(parser: argparse.ArgumentParser, args) -> None:
    """Flags that contradict each other are an error naming both (argparse's usage error, exit status 2)."""
    given = {"--canaries": args.canaries is not None, "--final-model": args.final_model is not None,
             "--final-model-kind": args.final_model_kind is not None}
    if args.no_audit:
        for flag in AUDIT_ONLY:
            if given[flag]:
                parser.error(f"argument {flag}: not allowed with argument --no-audit (it applies to the audit)")
    if given["--final-model-kind"] and not given["--final-model"]:
        parser.error("argument --final-model-kind: needs argument --final-model (the final-model audit it configures)")
    if args.final_model_kind is None:
        args.final_model_kind = "ood"
    if args.final_model is not None:
        from .demo import demo_max_final_model

        bound = demo_max_final_model(args.final_model_kind)
        if bound is not None and args.final_model > bound[0]:
            parser.error(f"argument --final-model: {args.final_model} is above {bound[0]} for --final-model-kind "
                         f"{args.final_model_kind} ({bound[1]}); use an integer in [2, {bound[0]}]")
    if not args.no_audit:  # the audit refuses a claim float32 cannot hold: said here, as a usage error
        from ..engine.claims.claim_range import noise_problem

        problem = noise_problem(args.noise_multiplier, 1.0)  # the demo clips at C = 1
        if problem is not None:
            parser.error(f"argument --noise-multiplier: {problem}")
    if args.canaries is not None and not args.no_audit:
        from .demo import demo_max_canaries

        most, why = demo_max_canaries(args.canary)
        if args.canaries > most:
            parser.error(f"argument --canaries: {args.canaries} is above {most} for --canary {args.canary} ({why}); "
                         f"use an integer in [2, {most}]")


# The smallest noise multiplier the demo takes: the audit claims mu = 1 / sigma per step, and a claim must be a
# finite number (below 1 / 1e-300 = 1e300 it is one, with room for the products the estimators take of it).


def _positive_real(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    if value < MIN_NOISE_MULTIPLIER:
        raise argparse.ArgumentTypeError(
            f"{text} is below {MIN_NOISE_MULTIPLIER:g}: the claimed mu = 1 / {text} is beyond the float range; "
            f"use a finite number >= {MIN_NOISE_MULTIPLIER:g}")
    return value


def _output_directory(text: str) -> str:
    """A directory that exists or can be made (refused before any training)."""
    path = Path(text)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{existing} exists and is not a directory")
    if existing is not None and not os.access(existing, os.W_OK):
        raise argparse.ArgumentTypeError(f"{existing} is not writable")
    missing = [p for p in (path, *path.parents) if existing is None or p not in (existing, *existing.parents)]
    try:  # made and taken away again: refused here, before any training, if it cannot be made; nothing left behind
        path.mkdir(parents=True, exist_ok=True)
        for made in missing:
            made.rmdir()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot create the directory {text} ({error.strerror or error})") from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpaudit", description="Audit differentially private training while it runs.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small CNN on the bundled digits with Opacus and audit it")
    demo.add_argument(
        "--steps", type=_at_least(1, MAX_STEPS, " (10**6: about a day of the demo on one thread)"), default=None,
        help="optimizer steps at batch 256 (default 600; for input canaries the kind's own, see --canary)",
    )
    demo.add_argument("--noise-multiplier", type=_positive_real, default=3.0, help="Opacus noise multiplier (default 3.0)")
    demo.add_argument(
        "--canary", default="dirac", choices=[*GRADIENT_CANARIES, *INPUT_CANARIES],
        help="gradient canaries (default dirac) or input canaries made from the digits held out from training; "
        "each kind has its own count and steps, printed at the start",
    )
    demo.add_argument("--canaries", type=_at_least(2), default=None, help="canaries per step (default: as chosen for the kind)")
    demo.add_argument(
        "--final-model", type=_at_least(2, MAX_FINAL_MODEL, " (10**6: the canaries and their scores are held in memory at once)"),
        nargs="?", const=500, default=None, metavar="M",
        help="also audit the trained model: M canaries (default 500) in the training data, each with probability 1/2",
    )
    demo.add_argument(
        "--final-model-kind", default=None, choices=FINAL_MODEL_CANARIES,
        help="final-model canaries: random out-of-distribution inputs with random labels (ood, default), or "
        "held-out digits with wrong labels (mislabeled), blank images, or crafted ones",
    )
    demo.add_argument("--bug", default=None, help="swap in a broken optimizer from the bug zoo (see --list-bugs)")
    demo.add_argument("--list-bugs", action="store_true", help="list the bug zoo and exit")
    demo.add_argument("--no-audit", action="store_true", help="train identically without the audit (baseline)")
    demo.add_argument("--out", type=_output_directory, default="dpaudit_runs", help="where TensorBoard logs and the report go")
    demo.add_argument("--seed", type=_at_least(0, MAX_SEED, " (2**32 - 1: numpy's largest seed)"), default=0,
                      help=f"the run's seed, 0 to {MAX_SEED} (default 0)")
    demo.add_argument(
        "--no-progress-bar", action="store_true",
        help="no progress output (by default: Lightning's bar on a terminal, about ten lines when the output is "
        "not a terminal, and the progress of crafting input canaries)",
    )
    demo.add_argument(
        "--threads", type=_at_least(1, MAX_THREADS, f" (4 x the {CPUS} CPUs)"), default=DEMO_THREADS,
        help=f"torch intra-op threads, 1 to {MAX_THREADS} (default {DEMO_THREADS}: the demo's small CNN gains nothing "
        "from more, and on cores shared with other work a second thread makes it many times slower)",
    )
    demo.set_defaults(run=_demo, check=_check_demo_flags, parser=demo)
    report = commands.add_parser(
        "report", help="gate on the finished audits under a directory; exit status 0 if all are OK, 3 on a violation, "
        "4 if an audit failed, 5 if training diverged, 1 if a report is missing or damaged",
        description="Print the summary and verdict of every audit report (audit_report.json) at or below DIRECTORY, "
        "or of the most recent one with --latest. Exit status, the worst over the reports: 3 when one records a "
        "violation, 4 when an audit failed (its record is incomplete), 5 when training diverged (the steps from "
        "there on went unaudited), 1 when there is no report or one is damaged, 0 when every one is OK; 2 for a bad "
        "argument.",
    )
    report.add_argument("directory", help="a run's log directory (or a folder above it)")
    report.add_argument("--latest", action="store_true",
                        help="gate on the most recent report at or below DIRECTORY alone (by modification time)")
    report.set_defaults(run=_report)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "check", None) is not None:
        args.check(args.parser, args)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
