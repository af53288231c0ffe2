"""Gaussian differential privacy (mu-GDP) and its (epsilon, delta) curve.

A mechanism is mu-GDP iff it is (epsilon, delta(epsilon))-DP for every epsilon >= 0 with
(Dong, Roth and Su; Tight Auditing Eq. 6)

    delta(epsilon) = Phi(-epsilon/mu + mu/2) - e^epsilon * Phi(-epsilon/mu - mu/2).

delta(epsilon) falls with epsilon and rises with mu, so each of the three quantities is
a monotone function of the other two; the inverses are found with scipy's brentq.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import brentq
from scipy.special import log_ndtr, ndtr

from ._checks import check_delta, check_nonnegative

_MU_MAX = 200.0  # beyond this delta(epsilon) underflows for every epsilon of interest


def delta_for(mu: float, epsilon: float) -> float:
    """delta such that a mu-GDP mechanism is (epsilon, delta)-DP (Eq. 6)."""
    mu = check_nonnegative(mu, "mu")
    epsilon = check_nonnegative(epsilon, "epsilon")
    if mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    first = ndtr(-epsilon / mu + mu / 2.0)
    # e^eps * Phi(x) computed in log space so that large epsilon does not overflow.
    second = math.exp(epsilon + log_ndtr(-epsilon / mu - mu / 2.0))
    return float(min(1.0, max(0.0, first - second)))


def mu_to_epsilon(mu: float, delta: float) -> float:
    """Smallest epsilon with delta_for(mu, epsilon) <= delta: the (epsilon, delta) of mu-GDP.

    Needs delta > 0: a Gaussian mechanism with mu > 0 has no finite pure-DP epsilon.
    """
    mu = check_nonnegative(mu, "mu")
    delta = check_delta(delta, allow_zero=False, why="the GDP curve has epsilon = inf at delta = 0")
    if mu == 0.0 or delta_for(mu, 0.0) <= delta:
        return 0.0
    if math.isinf(mu):
        return math.inf
    upper = max(1.0, mu * mu)
    while math.isfinite(upper) and delta_for(mu, upper) > delta:
        upper *= 2.0
    if not math.isfinite(upper):  # epsilon near mu**2 / 2, beyond the floats (mu above ~1e154)
        return math.inf
    return float(brentq(lambda eps: delta_for(mu, eps) - delta, 0.0, upper, xtol=1e-12, rtol=1e-14))


def epsilon_to_mu(epsilon: float, delta: float) -> float:
    """The mu whose GDP curve passes through (epsilon, delta): inverse of mu_to_epsilon."""
    epsilon = check_nonnegative(epsilon, "epsilon")
    delta = check_delta(delta, allow_zero=False, why="every mu > 0 has epsilon = inf at delta = 0")
    if math.isinf(epsilon):
        return math.inf
    if delta_for(_MU_MAX, epsilon) < delta:
        raise ValueError(
            f"Unexpected value for `epsilon`: {epsilon} at delta={delta} needs mu > {_MU_MAX}"
        )
    low = 0.0
    if delta_for(np.finfo(float).tiny, epsilon) >= delta:
        return 0.0
    return float(brentq(lambda mu: delta_for(mu, epsilon) - delta, low, _MU_MAX, xtol=1e-13, rtol=1e-14))
