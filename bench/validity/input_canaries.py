"""Input canaries on the digits CNN: end-to-end epsilon lower bound / accountant epsilon per kind.

Digits CNN trained on 1,541 digits (256 held out as the canaries' in-distribution sample),
batch 64 (Poisson), delta 1e-5, RDP accountant, 95%, gdp-cp; noise multipliers chosen by
Opacus for an accountant epsilon of about 2, 4, 8 after `--steps` steps. Each row is one
run; "window" rows observe only the first `--window` steps (paper 003, App. D.1).

    .venv/bin/python bench/validity/input_canaries.py [--steps 1000] [--canaries 32] [--window 250]
"""

import time
import warnings

from _path import harness

from opacus.accountants.utils import get_noise_multiplier

from lightning_dpaudit.integrations.testing import HOLDOUT
from lightning_dpaudit.testing import train_audited

SAMPLE_RATE = 1 / 25  # 1,541 training digits at batch 64: Opacus's Poisson rate is 1 / len(loader)


def main():
    parser = harness.parser(__doc__, steps=1000)
    parser.add_argument("--canaries", type=int, default=32, help="canaries per step")
    parser.add_argument("--targets", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    parser.add_argument("--kinds", nargs="+", default=["crafted", "mislabeled", "adversarial", "blank", "dirac"])
    parser.add_argument("--window", type=int, default=250, help="also audit only the first N steps (0: skip)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"steps={args.steps} canaries/step={args.canaries} holdout={HOLDOUT} delta=1e-5 confidence=0.95 gdp-cp")
    print(harness.header("target eps", "sigma", "canary", "observed steps", "eps accountant", "eps lower bound",
                         "ratio", "mu lower / claimed", "n in", "n out", "seconds"))
    windows = [None] + ([args.window] if args.window else [])
    for target in args.targets:
        sigma = get_noise_multiplier(
            target_epsilon=target, target_delta=1e-5, sample_rate=SAMPLE_RATE, steps=args.steps, accountant="rdp"
        )
        for kind in args.kinds:
            for window in windows:
                if window and kind == "dirac":
                    continue
                start = time.perf_counter()
                r = train_audited(
                    steps=args.steps, noise_multiplier=sigma, canary=kind, canaries_per_step=args.canaries,
                    seed=args.seed, holdout=HOLDOUT, observe_steps=window,
                )
                seconds = time.perf_counter() - start
                print(
                    f"| {target:g} | {sigma:.3f} | {kind} | {window or 'all'} | {r.epsilon_accountant:.3f} | "
                    f"{r.epsilon_lower_bound:.3f} | {r.epsilon_lower_bound / r.epsilon_accountant:.3f} | "
                    f"{r.mu_lower_bound / r.mu_claimed:.3f} | {r.n_in} | {r.n_out} | {seconds:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
