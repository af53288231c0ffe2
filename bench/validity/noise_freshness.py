"""Noise freshness: time per step, memory, and false alarms of the two freshness tests.

The record runs both on every noised step's 128 sentinel noise values: the sign
fingerprints (exact and negated repeats at any distance, alpha 1e-6) and the
correlation test (each of the last L steps, FRESHNESS_SHARE of alpha). This script
measures

  time      CPU microseconds per step of NoiseCorrelation.check at each L, and of both tests
            together as the record runs them, over `--steps` steps of fresh noise (best of 3);
  memory    the correlation window's bytes at each L (fixed: it does not grow with the run);
  false alarms  `--runs` simulated correct runs of `--run-steps` steps each (fresh Gaussian
            noise at a random scale per step), the correlation test at the audit's defaults
            (and the fingerprints too with --fingerprints; their own tests cover 50,000 steps).

  targets   with --targets, the digits CNN at default settings with each freshness bug:
            the step of the first alarm, what fired, and the finding's correlation.

    OMP_NUM_THREADS=1 .venv/bin/python bench/validity/noise_freshness.py [--runs 20000] [--run-steps 1000] [--fingerprints]
    OMP_NUM_THREADS=1 .venv/bin/python bench/validity/noise_freshness.py --targets --runs 0
"""

import time

from _path import harness

import numpy as np

from lightning_dpaudit.analysis.noise_correlation import NoiseCorrelation
from lightning_dpaudit.analysis.noise_fingerprints import NoiseFingerprints
from lightning_dpaudit.analysis.record import FRESHNESS_SHARE, LAGS, REPEAT_ALPHA, SENTINELS

ALPHA = 0.05 * FRESHNESS_SHARE  # at the default confidence 0.95


def _noise(rng, steps):
    return (rng.standard_normal((steps, SENTINELS)) * np.exp(rng.uniform(-3, 3, (steps, 1)))).astype(np.float32)


def per_step_us(lags: int, steps: int, rng, *, both: bool) -> float:
    noise = _noise(rng, steps)
    correlation = NoiseCorrelation(SENTINELS, lags=lags, alpha=ALPHA)
    fingerprints = NoiseFingerprints(SENTINELS, alpha=REPEAT_ALPHA)
    warm = min(steps // 4, lags)  # fill the window first: the full window is the steady state
    for i in range(warm):
        correlation.check(noise[i], i)
    start = time.process_time()  # this process's CPU time: other work on the machine does not count
    for i in range(warm, steps):
        correlation.check(noise[i], i)
        if both:
            fingerprints.check(noise[i], i)
    return (time.process_time() - start) / (steps - warm) * 1e6


def false_alarms(runs: int, steps: int, seed: int, with_fingerprints: bool):
    """(runs where the correlation test crossed, runs where the fingerprints matched)."""
    rng = np.random.default_rng(seed)
    crossed = matched = 0
    for run in range(runs):
        noise = _noise(rng, steps)
        correlation = NoiseCorrelation(SENTINELS, lags=LAGS, alpha=ALPHA)
        fingerprints = NoiseFingerprints(SENTINELS, alpha=REPEAT_ALPHA)
        hit_c = hit_f = False
        for i in range(steps):
            hit_c |= correlation.check(noise[i], i) is not None
            hit_f |= with_fingerprints and fingerprints.check(noise[i], i) is not None
        crossed += hit_c
        matched += hit_f
        if (run + 1) % 1000 == 0:
            print(f"  {run + 1}/{runs} runs: correlation {crossed}" + (f", fingerprints {matched}" if with_fingerprints else ""),
                  flush=True)
    return crossed, matched


TARGETS = [  # (bug, options, target: flagged within this many steps; None: quiet for 1,000 steps)
    (None, {}, None),
    ("antithetic-noise", {}, 10),
    ("correlated-noise", {"correlation": 0.8}, 50),
    ("correlated-noise", {"correlation": 0.3}, 500),
    ("correlated-noise", {"correlation": 0.5, "lag": 300}, 1000),
]


def targets(seed: int) -> None:
    """Each target run on the digits CNN at default settings (seeded, stopped at the alarm's check)."""
    import warnings

    import torch

    from lightning_dpaudit.bugs import inject_bug
    from lightning_dpaudit.testing import train_audited

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print(harness.header("bug", "options", "target", "first alarm (step)", "violating", "finding"))
    for bug, options, within in TARGETS:
        r = train_audited(steps=within or 1000, seed=seed, stop_on_violation=True,
                          transform=(lambda opt, b=bug, o=options: inject_bug(opt, b, **o)) if bug else None)
        first = r.first_violation_step if r.violation else f"none in {r.steps}"
        finding = "; ".join(f"{f.code}: {f.message.split(', where')[0].split(': ')[0]}" for f in r.findings) or "-"
        target = f"within {within}" if within else "quiet for 1000"
        shown = ", ".join(f"{k}={v}" for k, v in options.items()) or "-"
        print(f"| {bug or '(correct Opacus)'} | {shown} | {target} | {first} | {', '.join(r.violating_layers) or '-'} | "
              f"{finding} |", flush=True)


def main():
    parser = harness.parser(__doc__)
    parser.add_argument("--lags", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--steps", type=int, default=5000, help="steps timed per L")
    parser.add_argument("--runs", type=int, default=20_000, help="simulated correct runs (0: none)")
    parser.add_argument("--run-steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fingerprints", action="store_true", help="simulate the fingerprints too")
    parser.add_argument("--targets", action="store_true", help="run the digits CNN targets (and no timing)")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    if args.targets:
        targets(args.seed)
        args.lags = []
    print(f"sentinels={SENTINELS} default L={LAGS} correlation alpha={ALPHA:g} fingerprint alpha={REPEAT_ALPHA:g}")
    if args.lags:
        print(harness.header("L", "correlation test (us/step)", "both tests (us/step)", "window memory (bytes)"))
    for lags in args.lags:
        alone = min(per_step_us(lags, args.steps, rng, both=False) for _ in range(3))
        both = min(per_step_us(lags, args.steps, rng, both=True) for _ in range(3))
        memory = NoiseCorrelation(SENTINELS, lags=lags).memory_bytes()
        print(f"| {lags} | {alone:.1f} | {both:.1f} | {memory:,} |", flush=True)
    if args.runs:
        start = time.perf_counter()
        crossed, matched = false_alarms(args.runs, args.run_steps, args.seed + 1, args.fingerprints)
        print(f"{args.runs} simulated correct runs of {args.run_steps} steps ({time.perf_counter() - start:.0f} s):")
        print(f"  correlation test: {crossed} runs with an alarm = {crossed / args.runs:.3%} (allowed {ALPHA:.2%})")
        if args.fingerprints:
            print(f"  fingerprints:     {matched} runs with a match = {matched / args.runs:.3%} (allowed {REPEAT_ALPHA:.4%})")


if __name__ == "__main__":
    main()
