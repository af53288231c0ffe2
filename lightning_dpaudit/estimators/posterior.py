"""Bayesian credible bounds from the Jeffreys posterior of an attack's error rates.

With FP false positives among N_out out-observations and FN false negatives among N_in
in-observations, Jeffreys priors give independent posteriors (Zanella-Beguelin et al.;
Tight Auditing Eq. 14)

    FPR ~ Beta(FP + 1/2, N_out - FP + 1/2),    FNR ~ Beta(FN + 1/2, N_in - FN + 1/2).

A privacy parameter is a function of (FPR, FNR); its posterior CDF at a value v is the
posterior mass of the region where the parameter is <= v (Eq. 11 and 13). The mass is one
integral over FPR, taken on a fixed grid of FPR's posterior quantiles (midpoint rule in
quantile space), of FNR's Beta CDF; the credible bound is the root of CDF(v) = tail.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import brentq
from scipy.stats import beta, norm

_GRID = 4000  # quantile nodes for the FPR integral; the CDF error is far below 1e-4


def _posteriors(tp: int, fn: int, fp: int, tn: int):
    fpr = beta(fp + 0.5, tn + 0.5)
    fnr = beta(fn + 0.5, tp + 0.5)
    nodes = (np.arange(_GRID) + 0.5) / _GRID
    return fpr.ppf(nodes), fnr


def _mass_epsdelta(fpr_nodes: np.ndarray, fnr, epsilon: float, delta: float) -> float:
    """Posterior mass of the (epsilon, delta) privacy region R(epsilon, delta) (Eq. 8)."""
    grow, shrink = math.exp(epsilon), math.exp(-epsilon)
    x = fpr_nodes
    low = np.maximum((1.0 - delta - x) * shrink, 1.0 - delta - grow * x)
    high = np.minimum(1.0 + (delta - x) * shrink, grow * (1.0 - x) + delta)
    mass = fnr.cdf(np.clip(high, 0.0, 1.0)) - fnr.cdf(np.clip(low, 0.0, 1.0))
    return float(np.mean(np.clip(mass, 0.0, 1.0)))


def _mass_gdp(fpr_nodes: np.ndarray, fnr, mu: float) -> float:
    """Posterior mass of {|Phi^-1(1 - FPR) - Phi^-1(FNR)| <= mu} (Eq. 12, 13).

    The absolute value counts an attack and its flipped decision as the same evidence.
    """
    z = norm.isf(fpr_nodes)  # Phi^-1(1 - FPR)
    inside = fnr.cdf(norm.cdf(z + mu)) - fnr.cdf(norm.cdf(z - mu))
    return float(np.mean(np.clip(inside, 0.0, 1.0)))


def _lower_root(mass, tail: float, start: float) -> float:
    """Largest v with mass(v) <= tail, for mass increasing in v from mass(0)."""
    if mass(0.0) >= tail:
        return 0.0
    upper = start
    while mass(upper) < tail:
        upper *= 2.0
        if upper > 1e4:
            return math.inf
    return float(brentq(lambda v: mass(v) - tail, 0.0, upper, xtol=1e-9, rtol=1e-10))


def epsdelta_credible_lower(tp: int, fn: int, fp: int, tn: int, *, delta: float, tail: float) -> float:
    """Epsilon at which the posterior mass of R(epsilon, delta) reaches `tail`."""
    fpr_nodes, fnr = _posteriors(tp, fn, fp, tn)
    return _lower_root(lambda eps: _mass_epsdelta(fpr_nodes, fnr, eps, delta), tail, start=4.0)


def gdp_credible_lower(tp: int, fn: int, fp: int, tn: int, *, tail: float) -> float:
    """mu at which the posterior mass of {|mu(FPR, FNR)| <= mu} reaches `tail`."""
    fpr_nodes, fnr = _posteriors(tp, fn, fp, tn)
    return _lower_root(lambda mu: _mass_gdp(fpr_nodes, fnr, mu), tail, start=2.0)
