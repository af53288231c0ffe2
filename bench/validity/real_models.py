"""The audit on real model families, under every grad_sample_mode Opacus has: a table.

Each family of tests/model_families.py (Hugging Face transformers and PEFT LoRA from small
random-initialised configs, a GroupNorm ResNet, Opacus's DPLSTM and DPMultiheadAttention, models
returning tuples and dicts) trains `--steps` steps with plain Opacus and again audited (the
auditor given the loader and the step's loss, as the guides show; `--every` sets the exact
checks' cadence, default the audit's own), from the same seeds. A row gives what plain Opacus
did, whether the audited model equals it (largest parameter difference), the exact check's steps
compared, the findings and the verdict. Where Opacus fails, the row names Opacus and its error.

    OMP_NUM_THREADS=1 .venv/bin/python bench/validity/real_models.py [--steps 20] [--every 5] [--only gpt2-tied,bert]
"""

from __future__ import annotations

import time

from _path import harness

import torch

harness.on_path("tests")
from model_families import FAMILIES, MODES, train  # noqa: E402

TOLERANCE = 1e-5  # the canaries' R - K rounding


def row(name: str, mode: str, steps: int, audit: dict) -> tuple:
    plain = train(FAMILIES[name], mode, steps)
    audited = train(FAMILIES[name], mode, steps, audit=audit)
    if plain.error is not None:
        same = "same error" if audited.error == plain.error else f"audited: {audited.error}"
        return (name, mode, f"Opacus fails: {plain.error[:90]}", same, "-", "-", "-"), "opacus"
    if audited.error is not None:
        return (name, mode, "trains", f"audited run fails: {audited.error[:90]}", "-", "-", "-"), "failed"
    gap = float((plain.params - audited.params).abs().max())
    result = audited.auditor.result(accounting=False)
    check = audited.auditor.per_sample_check
    findings = ", ".join(f"{f.code} (step {f.first_step})" for f in result.findings) or "none"
    verdict = "AUDIT FAILED" if result.audit_failed else ("VIOLATION" if result.violation else "OK")
    outcome = "failed" if result.audit_failed or gap > TOLERANCE else ("alarm" if result.findings else "quiet")
    return (name, mode, "trains", f"{gap:.1e}", str(check.checked), findings, verdict), outcome


def main() -> None:
    parser = harness.parser(__doc__, steps=20)
    parser.add_argument("--every", type=int, default=None, help="the exact checks' cadence (default: the audit's)")
    parser.add_argument("--only", default="", help="families, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = [n for n in args.only.split(",") if n] or list(FAMILIES)
    # a cadence given is kept at every due step (the time budget off), so that the table shows the most it can check
    audit = {} if args.every is None else {"per_sample_check_every": args.every, "per_sample_check_budget": 1.0}
    start, counts = time.perf_counter(), {}
    print(f"steps={args.steps} exact checks every {args.every or 'default'}; sigma 1, C 1, batch 16 (Poisson)\n")
    print(harness.header("family", "mode", "plain Opacus", "audited model vs plain", "steps compared", "findings",
                         "verdict"))
    for name in names:
        for mode in MODES:
            cells, outcome = row(name, mode, args.steps, audit)
            counts[outcome] = counts.get(outcome, 0) + 1
            print(harness.row(*cells), flush=True)
    total = sum(counts.values())
    print(f"\n{total} set-ups: {counts.get('quiet', 0)} quiet, {counts.get('alarm', 0)} with findings, "
          f"{counts.get('failed', 0)} audit failures or changed models, {counts.get('opacus', 0)} where Opacus itself "
          f"fails ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
