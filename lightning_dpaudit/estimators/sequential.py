"""Anytime-valid bounds: checking after every observation without inflating false alarms.

A bound recomputed after every step and compared with the claim each time is a
repeated test; fixed-sample Clopper-Pearson bounds then cross a true value far more
often than 1 - confidence over a run. Here each error rate gets a confidence sequence:
for counts k of n Bernoulli(p) trials and a Beta(a, b) mixing prior, the mixture
likelihood ratio (Robbins' beta-binomial mixture)

    M_n(p) = B(k + a, n - k + b) / (B(a, b) p^k (1 - p)^(n - k))

is a nonnegative martingale under p with mean 1, so by Ville's inequality
P[exists n: M_n(p) >= 1/alpha] <= alpha. The set {p : M_n(p) < 1/alpha} is an interval;
its upper end bounds p at every n simultaneously. No maintained Python package offers
this boundary for current scipy/numpy, so it is computed here from scipy's betaln.

The prior is fixed before the data (it does not affect validity, only where the bound is
tightest): centred on an anticipated rate p0 with standard deviation `spread`.
"""

from __future__ import annotations

import math

from scipy.optimize import brentq
from scipy.special import betaln
from scipy.stats import norm

from ._checks import check_confidence
from .gdp import mu_to_epsilon


def beta_prior(p0: float, spread: float) -> tuple[float, float]:
    """Beta(a, b) with mean p0 and standard deviation `spread` (clamped to a proper prior)."""
    p0 = min(max(p0, 1e-6), 1 - 1e-6)
    total = max(p0 * (1 - p0) / spread**2 - 1.0, 1.0)
    return p0 * total, (1 - p0) * total


def _log_mixture(p: float, k: int, n: int, a: float, b: float) -> float:
    return betaln(k + a, n - k + b) - betaln(a, b) - k * math.log(p) - (n - k) * math.log1p(-p)


def upper_confidence_sequence(k: int, n: int, alpha: float, *, prior: tuple[float, float] = (1.0, 1.0)) -> float:
    """Upper end of the (1 - alpha) beta-binomial confidence sequence for p after k of n."""
    if n == 0 or k >= n:
        return 1.0
    a, b = prior
    level = math.log(1.0 / alpha)
    low = max(k / n, 1e-300)
    if k == 0:
        low = 1e-300
    if _log_mixture(low, k, n, a, b) >= level:  # the point estimate is already excluded: impossible
        return low
    high = 1.0 - 1e-16
    if _log_mixture(high, k, n, a, b) < level:
        return 1.0
    return float(brentq(lambda p: _log_mixture(p, k, n, a, b) - level, low, high, xtol=1e-12, rtol=1e-10))


def anytime_mu_lower(tp: int, fn: int, fp: int, tn: int, *, alpha: float, mu_anticipated: float, spread: float = 0.02) -> float:
    """mu lower bound (Eq. 12) from anytime-valid upper bounds on FPR and FNR.

    Each rate gets alpha / 2. The priors are centred on the rates a correct
    mu_anticipated-GDP mechanism gives at threshold 0.5 on normalized observations,
    Phi(-mu_anticipated / 2), which is where power matters when testing that claim.
    """
    check_confidence(1.0 - alpha)
    prior = beta_prior(norm.cdf(-mu_anticipated / 2.0), spread)
    fpr_up = upper_confidence_sequence(fp, fp + tn, alpha / 2.0, prior=prior)
    fnr_up = upper_confidence_sequence(fn, tp + fn, alpha / 2.0, prior=prior)
    return max(float(norm.isf(fpr_up) - norm.ppf(fnr_up)), 0.0)


def anytime_epsilon_lower(tp: int, fn: int, fp: int, tn: int, *, alpha: float, delta: float, mu_anticipated: float) -> float:
    """Epsilon at delta (Eq. 6) of anytime_mu_lower."""
    return mu_to_epsilon(anytime_mu_lower(tp, fn, fp, tn, alpha=alpha, mu_anticipated=mu_anticipated), delta)
