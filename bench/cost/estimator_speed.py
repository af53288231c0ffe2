"""Speed of epsilon_lower_bound on 10^6 observations per side, and of the Bayesian methods.

    .venv/bin/python bench/cost/estimator_speed.py [--n 1000000] [--repeats 5]

Prints the median wall time of each method at a fixed threshold (sort once, count with
searchsorted), and of the Bayesian methods from counts.
"""

import time

from _path import harness

import numpy as np

from lightning_dpaudit.estimators import METHODS, epsilon_from_counts, epsilon_lower_bound


def _median_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main():
    parser = harness.parser(__doc__)
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    ins, outs = rng.normal(1, 1, args.n), rng.normal(0, 1, args.n)
    print(harness.header("method", f"{args.n:,} observations per side (s)", "from counts (s)"))
    for method in METHODS:
        delta = 0.0 if method == "katz" else 1e-5
        scores = _median_seconds(lambda: epsilon_lower_bound(ins, outs, delta=delta, method=method), args.repeats)
        counts = _median_seconds(
            lambda: epsilon_from_counts(690_000, 310_000, 310_000, 690_000, delta=delta, method=method), args.repeats
        )
        print(f"| {method} | {scores:.3f} | {counts:.4f} |", flush=True)


if __name__ == "__main__":
    main()
