"""Tightness of the audit on a real Opacus run: end-to-end epsilon lower bound / accountant epsilon.

Digits CNN, batch 64 (Poisson), 1,000 steps, delta 1e-5, RDP accountant; noise multipliers
chosen by Opacus so that the accountant's epsilon is about 1, 2, 4, 8. One run per seed
and target; the table gives each seed's ratio and their median.

    .venv/bin/python bench/validity/tightness.py [--steps 1000] [--canaries auto] [--seeds 0 1 2 3 4] [--estimators gdp-cp]
"""

import statistics
import time

from _path import harness

from opacus.accountants.utils import get_noise_multiplier

from lightning_dpaudit.testing import train_audited

SAMPLE_RATE = 1 / 29  # make_private_digits: 1,797 examples, batch 64 -> 29 batches


def main():
    parser = harness.parser(__doc__, steps=1000, canaries="auto")
    parser.add_argument("--targets", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--estimators", nargs="+", default=["gdp-cp", "gdp-bayes"])
    parser.add_argument("--mode", default="one-run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    print(f"steps={args.steps} canaries/step={args.canaries} mode={args.mode} seeds={args.seeds} delta=1e-5 confidence=0.95")
    print(harness.header("target eps", "sigma", "estimator", "eps accountant", "eps lower bound", "ratio",
                         "mu lower / claimed", "n in = n out", "seconds"))
    medians = []
    for target in args.targets:
        sigma = get_noise_multiplier(
            target_epsilon=target, target_delta=1e-5, sample_rate=SAMPLE_RATE, steps=args.steps, accountant="rdp"
        )
        for estimator in args.estimators:
            ratios = []
            for seed in args.seeds:
                start = time.perf_counter()
                r = train_audited(
                    steps=args.steps, noise_multiplier=sigma, canaries_per_step=args.canaries,
                    estimator=estimator, seed=seed, mode=args.mode,
                )
                seconds = time.perf_counter() - start
                ratios.append(r.epsilon_lower_bound / r.epsilon_accountant)
                print(
                    f"| {target:g} | {sigma:.3f} | {estimator} | {r.epsilon_accountant:.3f} | {r.epsilon_lower_bound:.3f} | "
                    f"{ratios[-1]:.3f} | {r.mu_lower_bound / r.mu_claimed:.3f} | {r.n_in} | {seconds:.1f} |",
                    flush=True,
                )
            medians.append((target, estimator, statistics.median(ratios), min(ratios)))
    print("\n" + harness.header("target eps", "estimator", "median ratio", "lowest ratio"))
    for target, estimator, median, lowest in medians:
        print(f"| {target:g} | {estimator} | {median:.3f} | {lowest:.3f} |")


if __name__ == "__main__":
    main()
