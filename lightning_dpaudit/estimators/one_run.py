"""Epsilon lower bound from one training run (Steinke, Nasr and Jagielski, 2023).

m canaries are each included with probability 1/2; the auditor guesses r of them and v
guesses are right. Under (epsilon, delta)-DP, with q = 1 / (1 + e^-epsilon) and
B ~ Binomial(r, q), the chance of at least v right guesses is at most

    p(epsilon) = min(beta + alpha * 2 m delta, 1),
    beta  = P[B >= v],
    alpha = max over i = 1..v of (1/i) * sum over j = 1..i of P[B = v - j].

p grows with epsilon. The lower bound at `confidence` is the largest epsilon whose
p-value is still below 1 - confidence: every smaller epsilon is rejected.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import brentq
from scipy.stats import binom

from ._checks import check_confidence, check_count, check_delta, check_nonnegative

MAX_CANARIES = 10**7  # m: the p-value holds arrays of up to m binomial terms (80 MB each at 10**7)


def one_run_p_value(epsilon: float, *, num_canaries: int, num_guesses: int, num_correct: int, delta: float) -> float:
    """p(epsilon) above: how surprising num_correct is if the run were (epsilon, delta)-DP."""
    epsilon = check_nonnegative(epsilon, "epsilon")
    num_canaries, r, v = _check_guesses(num_canaries, num_guesses, num_correct)
    delta = check_delta(delta)
    q = 1.0 / (1.0 + math.exp(-epsilon)) if epsilon < 700 else 1.0
    tail = float(binom.sf(v - 1, r, q))
    if delta == 0.0 or v == 0:
        return min(tail, 1.0)
    i = np.arange(1, v + 1)
    cdf_below = binom.cdf(v - 1, r, q)
    window = cdf_below - binom.cdf(v - 1 - i, r, q)  # sum_{j=1..i} P[B = v - j]
    alpha = float(np.max(window / i))
    return min(tail + alpha * 2.0 * num_canaries * delta, 1.0)


def one_run_epsilon(
    num_canaries: int, num_guesses: int, num_correct: int, *, delta: float = 0.0, confidence: float = 0.95
) -> float:
    """Largest epsilon rejected at level 1 - confidence by one_run_p_value (0 if none)."""
    m, r, v = _check_guesses(num_canaries, num_guesses, num_correct)
    confidence = check_confidence(confidence)
    delta = check_delta(delta)
    level = 1.0 - confidence

    def excess(eps: float) -> float:
        return one_run_p_value(eps, num_canaries=m, num_guesses=r, num_correct=v, delta=delta) - level

    if v == 0 or excess(0.0) >= 0.0:
        return 0.0
    upper = 1.0
    while excess(upper) < 0.0:
        upper *= 2.0
        if upper > 1e3:  # p stays below the level: delta term too small to matter; no finite bound
            return math.inf
    return float(brentq(excess, 0.0, upper, xtol=1e-10, rtol=1e-12))


def _check_guesses(num_canaries, num_guesses, num_correct):
    m = check_count(num_canaries, "num_canaries")
    if m > MAX_CANARIES:
        raise ValueError(f"Unexpected value for `num_canaries`: {m:,}; at most {MAX_CANARIES:,} (10**7) canaries are bounded")
    r = check_count(num_guesses, "num_guesses")
    v = check_count(num_correct, "num_correct")
    if r > m:
        raise ValueError(f"`num_guesses` ({r}) cannot exceed `num_canaries` ({m})")
    if v > r:
        raise ValueError(f"`num_correct` ({v}) cannot exceed `num_guesses` ({r})")
    return m, r, v
