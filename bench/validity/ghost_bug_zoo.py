"""The bug zoo under ghost clipping: the first alarm and the finding of each bug, and a quiet correct run.

Modes: "single" (one process, DPOptimizerFastGradientClipping), "ddp" (DPDDP + ghost on two
gloo processes) and "fsdp" (FSDP2Wrapper + ghost_fsdp on two gloo processes). The model is
the token classifier of tests/ghost_setups.py (Embedding, two Linear layers, LayerNorm).

    .venv/bin/python bench/validity/ghost_bug_zoo.py [--mode single|ddp|fsdp|all] [--steps 200]
"""

import tempfile
from pathlib import Path

from _path import harness

harness.on_path("tests")  # ghost_setups.py, ddp_scenarios.py

NAMES = ["correct", "halved-linear-norms", "unclamped-coefficients", "wrong-noise", "no-noise", "mean-sensitivity",
         "reused-noise", "unnoised-layer"]


def single(names, steps):
    from ghost_setups import make_ghost, train_ghost

    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.bugs import inject_bug

    rows = {}
    for name in names:
        module, optimizer, criterion, loader = make_ghost(seed=4)
        if name != "correct":
            inject_bug(optimizer, name, module=module)
        auditor = PrivacyAuditor(optimizer, seed=5, on_violation=lambda result: None)
        train_ghost(module, optimizer, criterion, loader, steps)
        result = auditor.result(accounting=False)
        rows[name] = (result.first_violation_step, [f.code for f in result.findings])
    return rows


def distributed(mode, names, steps):
    from ddp_scenarios import launch

    with tempfile.TemporaryDirectory() as out:
        ranks = launch("bugs", Path(out), script="sharded_scenarios.py", timeout=1800, mode=mode, names=names, steps=steps,
                   checks="default")  # the auditor at its defaults, as the single-process column
    return {name: (ranks[0][name]["first_violation_step"], ranks[0][name]["findings"]) for name in names}


def main():
    parser = harness.parser(__doc__)
    parser.add_argument("--mode", default="all", choices=["single", "ddp", "fsdp", "all"])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    modes = ["single", "ddp", "fsdp"] if args.mode == "all" else [args.mode]
    table = {}
    for mode in modes:
        names = NAMES + (["noise-on-other-rank"] if mode == "ddp" else [])
        table[mode] = single(names, args.steps) if mode == "single" else distributed(mode, names, args.steps)
    print(f"first alarm (step) and findings, {args.steps} steps at most")
    print(harness.header("bug", *modes))
    for name in dict.fromkeys(n for mode in modes for n in table[mode]):
        cells = []
        for mode in modes:
            if name not in table[mode]:
                cells.append("")
                continue
            step, findings = table[mode][name]
            cells.append(f"{'quiet' if step is None else step}{' · ' + ', '.join(findings) if findings else ''}")
        print(harness.row(name, *cells))


if __name__ == "__main__":
    main()
