"""Cost of both epsilons per log step: LiveEpsilon against fresh Opacus accountants.

    OMP_NUM_THREADS=1 .venv/bin/python bench/cost/live_epsilon.py [--steps 1000] [--every 50]

A run of `--steps` steps at noise multiplier 1.0 and sample rate 64/1797 (digits, batch
64) is evaluated after every step, as a live view would: the accountant's epsilon and
the end-to-end lower bound for an empirical mu_step that drifts up slowly,
mu(t) = 0.95 * max(0, 1 - 2 / sqrt(t)) (0.76 at step 100, 0.89 at step 1000), as the
auditor's bound does while observations accumulate.

All times in ms per evaluation (both epsilons). cached: one LiveEpsilon over all steps:
median, mean (the amortized cost; in parentheses the process's CPU time, less sensitive
to other load on the machine) and the slowest single evaluation (PRV: where a grid count
is crossed). uncached: the accountant's get_epsilon plus
end_to_end_epsilon, as the auditor computed them, at every `--every`-th step only (each
costs 0.1-1 s); its mean over evenly spaced steps estimates the amortized cost. At those
steps the table also gives how far LiveEpsilon's values are from the exact ones: the
accountant's epsilon may only be above (rounded up), the lower bound only below.
"""

from __future__ import annotations

import math
import time
import warnings

from _path import harness

import numpy as np

from lightning_dpaudit.estimators import end_to_end_epsilon
from lightning_dpaudit.estimators.live_epsilon import LiveEpsilon

DELTA = 1e-5
SIGMA = 1.0
Q = 64 / 1797


def mu_at(t: int) -> float:
    return 0.95 * max(0.0, 1.0 - 2.0 / math.sqrt(t))


def _uncached(kind: str, history, mu: float):
    from opacus.accountants import create_accountant

    acc = create_accountant(kind)
    acc.history = list(history)
    return float(acc.get_epsilon(delta=DELTA)), end_to_end_epsilon(mu, delta=DELTA, history=history, accountant=kind)


def run(kind: str, steps: int, every: int) -> dict:
    live = LiveEpsilon(kind, delta=DELTA)
    cached_ms, exact = [], {}
    values = {}
    cpu_start = time.process_time()
    for t in range(1, steps + 1):
        history = [(SIGMA, Q, t)]
        mu = mu_at(t)
        start = time.perf_counter()
        values[t] = (live.accountant_epsilon(history), live.lower_bound_epsilon(mu, history))
        cached_ms.append(1e3 * (time.perf_counter() - start))
    cpu_ms = 1e3 * (time.process_time() - cpu_start) / steps
    uncached_ms = []
    for t in range(every, steps + 1, every):
        start = time.perf_counter()
        exact[t] = _uncached(kind, [(SIGMA, Q, t)], mu_at(t))
        uncached_ms.append(1e3 * (time.perf_counter() - start))
    over = [values[t][0] / exact[t][0] - 1 for t in exact]
    under = [1 - values[t][1] / exact[t][1] for t in exact if exact[t][1] > 0]
    return {
        "kind": kind,
        "cached_median": float(np.median(cached_ms)),
        "cached_mean": float(np.mean(cached_ms)),
        "cached_cpu": cpu_ms,
        "cached_max": float(np.max(cached_ms)),
        "uncached_median": float(np.median(uncached_ms)),
        "uncached_mean": float(np.mean(uncached_ms)),
        "accountant_over": (min(over), max(over)),
        "lower_under": (min(under), max(under)),
        "final": values[steps],
    }


def main():
    parser = harness.parser(__doc__, steps=1000)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--accountants", default="rdp,gdp,prv")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import opacus.accountants  # noqa: F401  (imports torch, ~2-7 s, already loaded in a training process)
    print(f"{args.steps} evaluations, steps 1..{args.steps}, sigma {SIGMA}, q {Q:.4f}, delta {DELTA}")
    print(harness.header("accountant", "cached median", "cached amortized (CPU)", "cached max", "uncached median",
                         "uncached amortized", "accountant eps above exact", "lower bound below exact",
                         "final eps (accountant, lower)"))
    for kind in args.accountants.split(","):
        r = run(kind, args.steps, args.every)
        (o_lo, o_hi), (u_lo, u_hi) = r["accountant_over"], r["lower_under"]
        print(
            f"| {kind} | {r['cached_median']:.3f} | {r['cached_mean']:.2f} ({r['cached_cpu']:.2f}) "
            f"| {r['cached_max']:.0f} | {r['uncached_median']:.1f} | {r['uncached_mean']:.1f} "
            f"| {100 * o_lo:.2f}% to {100 * o_hi:.2f}% | {100 * u_lo:.2f}% to {100 * u_hi:.2f}% "
            f"| {r['final'][0]:.3f}, {r['final'][1]:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
