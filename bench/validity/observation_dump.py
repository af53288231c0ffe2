"""Observations and results of a set of configurations, as digests: two versions of the audit compared bit for bit.

Fourteen configurations (every grad_sample_mode the digits CNN takes, per-layer and adaptive clipping, sum
reduction, paired, each canary family, cadences, shuffled batches) x 2 seeds. Each configuration trains the bundled digits CNN for `--steps` steps under a seed, audited; the digest covers every
observation array and the result's numbers, findings and statuses. Run it on two checkouts and compare the files:

    OMP_NUM_THREADS=1 PYTHONPATH=<checkout> .venv/bin/python bench/validity/observation_dump.py --out before.json
    diff before.json after.json
"""

from __future__ import annotations

import hashlib
import json
import warnings

from _path import harness

import numpy as np

CONFIGS = {
    "hooks": ({}, {}),
    "functorch": ({"grad_sample_mode": "functorch"}, {}),
    "ew": ({"grad_sample_mode": "ew"}, {}),
    "per-layer": ({"clipping": "per_layer"}, {}),
    "sum-loss": ({"loss_reduction": "sum"}, {}),
    "paired": ({}, {"mode": "paired"}),
    "constant": ({}, {"canary": "constant"}),
    "random": ({}, {"canary": "random"}),
    "check-every-1": ({}, {"check_every": 1}),
    "observe-10": ({}, {"observe_steps": 10}),
    "exact-every-3": ({}, {"per_sample_check_every": 3}),
    "mislabeled": ({}, {"canary": "mislabeled", "canaries_per_step": 8}),
    "adaptive": ({"clipping": "adaptive", "target_unclipped_quantile": 0.5, "clipbound_learning_rate": 0.2,
                  "max_clipbound": 10.0, "min_clipbound": 0.1, "unclipped_num_std": 20.0}, {}),
    "not-poisson": ({"poisson_sampling": False}, {}),
}


def digest(config: str, seed: int, steps: int) -> dict:
    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.datasets import digits_holdout, make_private_digits, train_steps

    private, audit = CONFIGS[config]
    model, optimizer, loader, _ = make_private_digits(seed=seed, holdout=100, **private)
    options = dict(audit)
    if options.get("canary") == "mislabeled":
        options["canary_inputs"], options["canary_labels"] = digits_holdout(100)
    options.setdefault("per_sample_check_budget", 1.0)  # the exact checks' steps by cadence alone, not by the clock
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=seed, **options)
    train_steps(model, optimizer, loader, steps)
    result = auditor.result()
    arrays = auditor.observations()
    observed = hashlib.sha256()
    for key in sorted(arrays):
        observed.update(key.encode())
        values = arrays[key]  # object arrays (the kinds' names) by their text, not their pointers
        observed.update("\n".join(map(str, values)).encode() if values.dtype == object else
                        np.ascontiguousarray(values).tobytes())
    trained = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    auditor.detach()
    return {
        "observations": observed.hexdigest(), "model": trained.hexdigest(), "epsilon_lower_bound": result.epsilon_lower_bound,
        "mu_lower_bound": result.mu_lower_bound, "violation": result.violation,
        "findings": [f.code for f in result.findings], "data_path": result.data_path, "pipeline": result.pipeline,
        "notes": list(result.notes),
    }


def main() -> None:
    parser = harness.parser(__doc__, steps=25, seeds=[0, 1])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    table = {f"{c}/{s}": digest(c, s, args.steps) for c in args.configs for s in args.seeds}
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    print(f"{len(table)} configurations written to {args.out}")


if __name__ == "__main__":
    main()
