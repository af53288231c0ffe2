"""Epsilon lower bound from one run under a Gaussian f-DP claim (Mahloujifar et al., 2024).

m canaries are each included with probability 1/2; the auditor makes r guesses and v are
right. Claim: the mechanism is mu-GDP, with mu the Gaussian mechanism's calibration to
(epsilon, delta) (gdp.epsilon_to_mu), i.e. each canary's inclusion can be told with a
trade-off no better than G_mu(x) = Phi(Phi^-1(1 - x) - mu).

The test bounds, under the claim, how many right guesses are possible with probability
above the level tau = 1 - confidence. Writing g(x) = Phi(Phi^-1(x) - mu), it starts from
the mass the level leaves to the right and wrong guesses,

    p = tau * v / m,   w = tau * (r - v) / m,

and walks down the v right guesses, i = v - 1, ..., 0:

    w' = max(w, g(p)),   p' = min(p + i / (r - i) * (w' - w), 1),

stopping early once w no longer grows. The claim is rejected when p + w > r / m: no
mechanism with that trade-off makes v of r guesses right this often. The bound is the
largest epsilon still rejected; the rejection region shrinks as epsilon grows.

The claim is the Gaussian trade-off curve through (epsilon, delta), which is stronger
than (epsilon, delta)-DP alone: a run can reject it and still be (epsilon, delta)-DP.
It is the right comparison for DP-SGD, whose Gaussian noise the curve describes; the
(epsilon, delta) bound of one_run.py makes no such assumption. For a mechanism whose
trade-off curve is not Gaussian the bound is no lower bound on its epsilon: randomized
response at epsilon 2 gives bounds above 2 in 98-100% of trials (bench/validity/estimator_validity.py),
so wherever it is shown it is labelled as assuming a Gaussian trade-off curve.
"""

from __future__ import annotations

import math

from scipy.optimize import brentq
from scipy.special import ndtr, ndtri

from ._checks import check_confidence, check_delta, check_nonnegative
from .gdp import _MU_MAX, delta_for, epsilon_to_mu
from .one_run import _check_guesses


def one_run_fdp_margin(epsilon: float, *, num_canaries: int, num_guesses: int, num_correct: int, delta: float,
                       confidence: float = 0.95) -> float:
    """p + w - r/m above: > 0 when v right of r guesses reject the Gaussian claim at epsilon."""
    epsilon = check_nonnegative(epsilon, "epsilon")
    m, r, v = _check_guesses(num_canaries, num_guesses, num_correct)
    delta = check_delta(delta, allow_zero=False, why="a Gaussian trade-off curve has epsilon = inf at delta = 0")
    tau = 1.0 - check_confidence(confidence)
    if r == 0:
        return -1.0
    mu = _mu(epsilon, delta)
    right, wrong = tau * v / m, tau * (r - v) / m
    for i in range(v - 1, -1, -1):
        grown = max(wrong, float(ndtr(ndtri(right) - mu)))  # g(1) = 1
        if grown == wrong:
            break
        right, wrong = min(right + i / (r - i) * (grown - wrong), 1.0), grown
    return right + wrong - r / m


def one_run_fdp_epsilon(
    num_canaries: int, num_guesses: int, num_correct: int, *, delta: float, confidence: float = 0.95
) -> float:
    """Largest epsilon whose Gaussian trade-off claim v right of r guesses rejects (0 if none)."""
    m, r, v = _check_guesses(num_canaries, num_guesses, num_correct)

    def margin(eps: float) -> float:
        return one_run_fdp_margin(eps, num_canaries=m, num_guesses=r, num_correct=v, delta=delta, confidence=confidence)

    if v == 0 or margin(0.0) <= 0.0:
        return 0.0
    upper = 1.0
    while margin(upper) > 0.0:
        upper *= 2.0
        if _mu(upper, delta) >= _MU_MAX:
            return math.inf
    return float(brentq(margin, 0.0, upper, xtol=1e-10, rtol=1e-12))


def _mu(epsilon: float, delta: float) -> float:
    """mu of the Gaussian curve through (epsilon, delta); capped where it leaves gdp's range."""
    if delta_for(_MU_MAX, epsilon) < delta:
        return _MU_MAX
    return epsilon_to_mu(epsilon, delta)
