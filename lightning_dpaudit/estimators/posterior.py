"""Bayesian credible bounds from the posterior of an attack's error rates.

With FP false positives among N_out out-observations and FN false negatives among N_in
in-observations, Jeffreys priors give independent posteriors (Zanella-Beguelin et al.;
Tight Auditing Eq. 14)

    FPR ~ Beta(FP + 1/2, N_out - FP + 1/2),    FNR ~ Beta(FN + 1/2, N_in - FN + 1/2).

A privacy statement is a function of (FPR, FNR); its posterior CDF at a value v is the
posterior mass of the region where the function is <= v (Eq. 11 and 13). The mass is one
integral over FPR, taken on a fixed grid of FPR's posterior quantiles (midpoint rule in
quantile space), of FNR's Beta CDF; the credible bound is the root of CDF(v) = tail.

Null rule. A continuous posterior puts no mass on "no difference" (FPR + FNR = 1) itself,
so a quantile of a privacy parameter is above 0 for every data set, even when in- and
out-observations come from one distribution. Both bounds are therefore 0 unless the
Jeffreys posterior places the attack on one side of chance: the posterior mass of
{FPR + FNR >= 1} (no better than chance) or of {FPR + FNR <= 1} (its flip no better than
chance) must be below `tail`, i.e. the central credible interval at 1 - 2 tail of the
separation 1 - FPR - FNR (or, equally, of the signed mu = Phi^-1(1 - FPR) - Phi^-1(FNR),
which has the same sign) excludes 0. With tail = (1 - confidence) / 2, null data give a
bound above 0 in at most about 1 - confidence of trials (measured 3.0-4.3% at 95%: the
bound under the lean below can still be 0).

Leaning toward errors. The bound is then computed for the attack on that side (or its
flip) under the prior Beta(1, 1/2) on each of its error rates instead of Jeffreys'
Beta(1/2, 1/2): FPR ~ Beta(FP + 1, TN + 1/2), FNR ~ Beta(FN + 1, TP + 1/2), half a count
from Jeffreys toward the Clopper-Pearson upper limits (Beta(k + 1, n - k)). Jeffreys'
upper quantiles are too low when an error count is 0 or 1, and such counts are common for
a strong attack: with them the bounds exceeded the truth in up to 10.5% of trials at 95%
(randomized response at epsilon 3, 60 observations a side); with the lean, at most 4.4%
in the settings of bench/validity/estimator_validity.py (docs/estimators.md). Half a count changes a
bound from a thousand observations a side by 0.002-0.01.

(epsilon, delta). For an attack better than chance the region R(epsilon, delta) (Eq. 8) is
the intersection of two statements, l1 = log((1 - delta - FPR) / FNR) <= epsilon and
l2 = log((1 - delta - FNR) / FPR) <= epsilon. The bound is the larger of their two credible
bounds, each at `tail`. The posterior mass of the whole region is not used: where a tight
mechanism's (FPR, FNR) sits, at the region's corner (randomized response), about a quarter
of a posterior centred there falls inside, so the (1 - confidence) quantile of the region's
mass (privacy-estimates' "joint-beta") exceeds the true epsilon far more often than
1 - confidence (17-18% of 500 trials at 95%, 50 and 500 observations a side).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy.optimize import brentq
from scipy.special import betainc, ndtr
from scipy.stats import beta, norm

_GRID = 4000  # quantile nodes for the FPR integral; the CDF error is far below 1e-4


LEAN = 0.5  # prior Beta(1, 1/2) on an error rate, once the side is known (module docstring)


@lru_cache(maxsize=1024)
def _fpr_nodes(a: float, b: float) -> np.ndarray:
    """Quantiles of FPR's posterior Beta(a, b) at the grid's midpoints (read-only, cached:
    one count per side repeats often)."""
    nodes = beta.ppf((np.arange(_GRID) + 0.5) / _GRID, a, b)
    nodes.setflags(write=False)
    return nodes


class _FNR:
    """FNR's posterior Beta(FN + 1/2, TP + 1/2): CDF and survival function (scipy.special, no frozen object)."""

    def __init__(self, a: float, b: float):
        self.a, self.b = a, b

    def cdf(self, x):
        return betainc(self.a, self.b, np.clip(x, 0.0, 1.0))

    def sf_of_complement(self, y):
        """P[FNR > 1 - y], exact for small y (the survival function at 1 - y)."""
        return betainc(self.b, self.a, np.clip(y, 0.0, 1.0))


def _posteriors(tp: int, fn: int, fp: int, tn: int, side: int = 0):
    """(FPR nodes, FNR) under Jeffreys priors (side 0), or leaning toward errors of the attack
    (side +1: FPR ~ Beta(FP + 1, TN + 1/2), FNR ~ Beta(FN + 1, TP + 1/2)) or of its flip (side -1)."""
    err, ok = (0.5 + LEAN, 0.5) if side > 0 else (0.5, 0.5 + LEAN) if side < 0 else (0.5, 0.5)
    return _fpr_nodes(fp + err, tn + ok), _FNR(fn + err, tp + ok)


def _sided_posteriors(tp: int, fn: int, fp: int, tn: int, tail: float):
    """(side by the null rule, FPR nodes, FNR leaning toward that side's errors)."""
    side = _side(*_posteriors(tp, fn, fp, tn), tail)
    return (side, *_posteriors(tp, fn, fp, tn, side)) if side else (0, None, None)


def _mean(values) -> float:
    return float(np.clip(np.mean(values), 0.0, 1.0))


def _side(fpr_nodes: np.ndarray, fnr: _FNR, tail: float) -> int:
    """+1 when the attack is credibly better than chance, -1 when its flip is, 0 otherwise (the null rule)."""
    chance = _mean(fnr.sf_of_complement(fpr_nodes))  # P[FNR >= 1 - FPR]
    if chance < tail:
        return 1
    if 1.0 - chance < tail:
        return -1
    return 0


def _mass_statement(fpr_nodes: np.ndarray, fnr: _FNR, epsilon: float, delta: float, statement: int, side: int) -> float:
    """Posterior mass of {l <= epsilon} for one of the two statements of R(epsilon, delta)
    (module docstring), of the attack (side +1) or of its flip (side -1: FPR' = 1 - FNR,
    FNR' = 1 - FPR)."""
    x = fpr_nodes
    grow, shrink = math.exp(min(epsilon, 700.0)), math.exp(-epsilon)
    if side > 0:
        if statement == 1:  # FNR >= (1 - delta - FPR) e^-eps
            return _mean(fnr.sf_of_complement(1.0 - (1.0 - delta - x) * shrink))
        return _mean(fnr.sf_of_complement(np.clip(delta + grow * x, 0.0, 1.0)))  # FNR >= 1 - delta - e^eps FPR
    if statement == 1:  # FNR <= delta + e^eps (1 - FPR)
        return _mean(fnr.cdf(delta + grow * (1.0 - x)))
    return _mean(fnr.cdf(1.0 - (x - delta) * shrink))  # FNR <= 1 - (FPR - delta) e^-eps


def _mass_gdp(fpr_nodes: np.ndarray, fnr: _FNR, mu: float, side: int) -> float:
    """Posterior mass of {side * (Phi^-1(1 - FPR) - Phi^-1(FNR)) <= mu} (Eq. 12, 13).

    side = -1 measures the flipped attack (an attack worse than chance counts as its flip).
    """
    z = norm.isf(fpr_nodes)  # Phi^-1(1 - FPR)
    if side > 0:  # Phi^-1(FNR) >= z - mu
        return _mean(fnr.sf_of_complement(ndtr(mu - z)))
    return _mean(fnr.cdf(ndtr(z + mu)))  # Phi^-1(FNR) <= z + mu


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
    """0 under the null rule; else the larger of the two statements' credible bounds, each
    the epsilon at which its posterior mass reaches `tail` (module docstring)."""
    side, fpr_nodes, fnr = _sided_posteriors(tp, fn, fp, tn, tail)
    if side == 0:
        return 0.0
    return max(
        _lower_root(lambda eps: _mass_statement(fpr_nodes, fnr, eps, delta, statement, side), tail, start=4.0)
        for statement in (1, 2)
    )


def gdp_credible_lower(tp: int, fn: int, fp: int, tn: int, *, tail: float) -> float:
    """Distance from 0 to the central credible interval of the signed mu, `tail` of the
    posterior outside each end: the `tail` quantile of mu for an attack credibly better than
    chance, of its flip's mu for one credibly worse, 0 when the interval holds 0 (the null
    rule)."""
    side, fpr_nodes, fnr = _sided_posteriors(tp, fn, fp, tn, tail)
    if side == 0:
        return 0.0
    return _lower_root(lambda mu: _mass_gdp(fpr_nodes, fnr, mu, side), tail, start=2.0)


def epsdelta_credible_exceeds(tp: int, fn: int, fp: int, tn: int, epsilon: float, *, delta: float, tail: float) -> bool:
    """epsdelta_credible_lower(...) > epsilon (epsilon >= 0), from a few posterior masses
    instead of the root searches: each statement's mass is increasing in epsilon."""
    side, fpr_nodes, fnr = _sided_posteriors(tp, fn, fp, tn, tail)
    if side == 0:
        return False
    return any(_mass_statement(fpr_nodes, fnr, epsilon, delta, statement, side) < tail for statement in (1, 2))


def gdp_credible_exceeds(tp: int, fn: int, fp: int, tn: int, mu: float, *, tail: float) -> bool:
    """gdp_credible_lower(...) > mu (mu >= 0), from two posterior masses."""
    side, fpr_nodes, fnr = _sided_posteriors(tp, fn, fp, tn, tail)
    if side == 0:
        return False
    return _mass_gdp(fpr_nodes, fnr, mu, side) < tail
