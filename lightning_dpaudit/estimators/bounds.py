"""Empirical epsilon lower bounds from a threshold attack on in- and out-observations.

An observation is a score; larger means "the canary was present". At a threshold t the
attack says "in" when score >= t, which gives counts TP, FN (in-observations) and FP, TN
(out-observations). Every method turns the counts into a lower bound on epsilon:

    epsdelta-cp     Clopper-Pearson intervals on FPR and FNR; the smallest Eq. 9 value
                    eps = max(log((1 - delta - FPR) / FNR), log((1 - delta - FNR) / FPR), 0)
                    over the rectangle they span (the upper corner for a useful attack)
    epsdelta-bayes  credible bounds on the two terms of Eq. 9, the larger of them
                    (posterior.py; Eq. 10, 11, 14)
    gdp-cp          the same with mu = Phi^-1(1 - FPR) - Phi^-1(FNR) (Eq. 12), then
                    eps at delta by Eq. 6
    gdp-bayes       credible bound on mu (posterior.py; Eq. 13), then Eq. 6
    katz            Katz log interval on TPR/FPR and TNR/FNR (Lu et al.): pure eps-DP

Every method splits 1 - confidence evenly over two one-sided statements: the CP intervals
on FPR and FNR, Katz's two likelihood ratios, epsdelta-bayes' two terms of Eq. 9 (each its
(1 - confidence)/2 posterior quantile), gdp-bayes' central credible interval of mu. So
each bound exceeds the truth in at most about 1 - confidence of trials (measured:
bench/validity/estimator_validity.py, docs/estimators.md).

Null rule of the Bayesian methods: the bound is 0 unless the central credible interval at
`confidence` of the separation 1 - FPR - FNR excludes 0, i.e. unless the posterior puts
less than (1 - confidence)/2 of its mass on one side of chance. A continuous posterior has
no mass on "no difference" itself, so without the rule every data set, null data too,
would give a bound above 0; with it null data give 0 in at least about `confidence` of
trials (measured 95.7-97.0% at 95%). The bound itself uses posteriors leaning half a count
toward the attack's errors (posterior.py), which keeps it within budget at small counts.

The GDP methods assume observations of a Gaussian mechanism (one DP-SGD step): their mu is
a bound for any mechanism whose trade-off curve is Gaussian, but their epsilon is the
Gaussian curve's, which for another mechanism (randomized response) can exceed its true
epsilon in every trial.

A bound is valid only if the threshold was fixed before looking at the observations it is
evaluated on. threshold="best" sweeps thresholds on the same data (common, optimistic)
and marks the result valid=False.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
from scipy.stats import beta, norm

from ._checks import check_confidence, check_count, check_counts, check_delta, check_nonnegative, check_scores
from .gdp import _MU_MAX, epsilon_to_mu, mu_to_epsilon
from .posterior import epsdelta_credible_exceeds, epsdelta_credible_lower, gdp_credible_exceeds, gdp_credible_lower

METHODS = ("epsdelta-cp", "epsdelta-bayes", "gdp-cp", "gdp-bayes", "katz")
DEFAULT_THRESHOLD = 0.5
BEST_CANDIDATES = {"epsdelta-cp": 2000, "gdp-cp": 2000, "katz": 2000, "epsdelta-bayes": 40, "gdp-bayes": 40}


@dataclass(frozen=True)
class EpsilonEstimate:
    """An empirical lower bound on epsilon (and, for GDP methods, on mu).

    epsilon     lower bound on epsilon at `delta` (pure epsilon-DP for "katz").
    mu          lower bound on the GDP parameter mu; None for non-GDP methods.
    threshold   decision threshold: the attack says "in" when score >= threshold.
    fpr, fnr    empirical error rates at the threshold (nan when a side is empty).
    n_in, n_out number of in- and out-observations.
    method, confidence, delta: how the bound was computed.
    valid       False when the threshold was chosen on the same observations
                (threshold="best"); such a bound is optimistic, not a guarantee.
    Holds with probability >= confidence (CP, Katz asymptotically) or posterior
    probability >= confidence (Bayes) when valid is True. The Bayesian methods report 0
    unless the central credible interval of the separation 1 - FPR - FNR excludes 0.
    """

    epsilon: float
    mu: Optional[float]
    threshold: float
    fpr: float
    fnr: float
    n_in: int
    n_out: int
    method: str
    confidence: float
    delta: float
    valid: bool


def _check_method(method: str, delta: float) -> None:
    if method not in METHODS:
        raise ValueError(f"Unexpected value for `method`: {method!r}; valid methods are {', '.join(METHODS)}")
    if method.startswith("gdp") and delta == 0.0:
        raise ValueError("`delta` must be > 0 for GDP methods: a Gaussian mechanism has epsilon = inf at delta = 0")
    if method == "katz" and delta != 0.0:
        raise ValueError(f"method 'katz' bounds pure epsilon-DP; pass delta=0 (got delta={delta})")


def clopper_pearson_upper(k, n, level: float):
    """One-sided Clopper-Pearson upper bound on a proportion k/n at `level` (1 when n=0).

    k, n: counts (scalars or arrays of one shape), whole numbers with 0 <= k <= n; level in (0, 1).
    """
    if isinstance(level, bool) or not isinstance(level, (int, float, np.integer, np.floating)) or not 0.0 < level < 1.0:
        raise ValueError(f"Unexpected value for `level`: {level}; it must lie in (0, 1)")
    k, n = np.asarray(k), np.asarray(n)
    for name, a in (("k", k), ("n", n)):
        if not np.issubdtype(a.dtype, np.number) or a.dtype == bool:
            raise ValueError(f"Unexpected value for `{name}`: counts must be whole numbers >= 0; got {a.dtype}")
        bad = ~np.isfinite(a) | (a < 0) | (a != np.round(a))
        if np.any(bad):
            raise ValueError(f"Unexpected value for `{name}`: {a[bad].ravel()[0]}; counts must be whole numbers >= 0")
    over = np.broadcast_arrays(k, n, k > n)
    if np.any(over[2]):
        i = int(np.argmax(over[2]))
        raise ValueError(f"`k` ({over[0].flat[i]}) cannot exceed `n` ({over[1].flat[i]}): k counts successes among n")
    k, n = k.astype(float), n.astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        upper = beta.ppf(level, k + 1.0, np.maximum(n - k, 1e-300))
    return np.where(k >= n, 1.0, upper)


def clopper_pearson_lower(k, n, level: float):
    """One-sided Clopper-Pearson lower bound on a proportion k/n at `level` (0 when k=0)."""
    k, n = np.asarray(k, dtype=float), np.asarray(n, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        lower = beta.ppf(1.0 - level, np.maximum(k, 1e-300), n - k + 1.0)
    return np.where(k <= 0, 0.0, lower)


def _epsdelta_point(fpr, fnr, delta: float):
    """Eq. 9 at one (FPR, FNR) point, flip-symmetric, elementwise."""
    flip = fpr + fnr > 1.0
    fpr, fnr = np.where(flip, 1.0 - fnr, fpr), np.where(flip, 1.0 - fpr, fnr)
    low, high = np.minimum(fpr, fnr), np.maximum(fpr, fnr)
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = np.log((1.0 - delta - high) / low)
    eps = np.where(high > 1.0 - delta - low, 0.0, eps)
    return np.where(low <= 0, np.where(high > 1.0 - delta - low, 0.0, np.inf), eps)


def _gdp_point(fpr, fnr):
    """Eq. 12 at one (FPR, FNR) point, flip-symmetric: |Phi^-1(1 - FPR) - Phi^-1(FNR)|."""
    with np.errstate(invalid="ignore"):
        return np.abs(norm.isf(fpr) - norm.ppf(fnr))


def _over_rectangle(point, fpr_lo, fpr_hi, fnr_lo, fnr_hi):
    """Smallest value of a flip-symmetric privacy function over the confidence rectangle.

    Such a function is 0 on the line FPR + FNR = 1 and grows away from it, so its minimum
    over a rectangle is 0 if the rectangle meets the line and otherwise sits at the corner
    nearest to it.
    """
    meets = (fpr_lo + fnr_lo <= 1.0) & (fpr_hi + fnr_hi >= 1.0)
    return np.where(meets, 0.0, np.minimum(point(fpr_lo, fnr_lo), point(fpr_hi, fnr_hi)))


def _katz_log_lower(hits_a, n_a, hits_b, n_b, z: float):
    """Lower end of the Katz log interval for (hits_a/n_a) / (hits_b/n_b), elementwise.

    Haldane's correction (+1/2 to each cell of the 2x2 table) where a count is zero.
    """
    hits_a, n_a, hits_b, n_b = (np.asarray(v, dtype=float) for v in (hits_a, n_a, hits_b, n_b))
    zero = (hits_a == 0) | (hits_b == 0) | (hits_a == n_a) | (hits_b == n_b)
    pad = np.where(zero, 0.5, 0.0)
    hits_a, hits_b = hits_a + pad, hits_b + pad
    n_a, n_b = n_a + 2 * pad, n_b + 2 * pad
    log_ratio = np.log(hits_a / n_a) - np.log(hits_b / n_b)
    spread = np.sqrt(1.0 / hits_a - 1.0 / n_a + 1.0 / hits_b - 1.0 / n_b)
    return log_ratio - z * spread


def _bound_from_counts(tp, fn, fp, tn, *, method: str, delta: float, confidence: float):
    """(epsilon, mu) arrays for count arrays; mu is nan for non-GDP methods."""
    tp, fn, fp, tn = (np.asarray(v, dtype=float) for v in (tp, fn, fp, tn))
    n_in, n_out = tp + fn, fp + tn
    tail = (1.0 - confidence) / 2.0
    mu = np.full(tp.shape, np.nan)
    if method in ("epsdelta-cp", "gdp-cp"):
        rectangle = (
            clopper_pearson_lower(fp, n_out, 1.0 - tail),
            clopper_pearson_upper(fp, n_out, 1.0 - tail),
            clopper_pearson_lower(fn, n_in, 1.0 - tail),
            clopper_pearson_upper(fn, n_in, 1.0 - tail),
        )
        if method == "epsdelta-cp":
            eps = _over_rectangle(lambda a, b: _epsdelta_point(a, b, delta), *rectangle)
        else:
            mu, eps = _over_rectangle(_gdp_point, *rectangle), None
    elif method == "katz":
        z = norm.isf(tail)
        tpr_over_fpr = _katz_log_lower(tp, n_in, fp, n_out, z)
        tnr_over_fnr = _katz_log_lower(tn, n_out, fn, n_in, z)
        eps = np.maximum(np.maximum(tpr_over_fpr, tnr_over_fnr), 0.0)
    else:
        counts = np.broadcast_arrays(tp, fn, fp, tn)
        flat = [c.ravel().astype(int) for c in counts]
        eps, mus = [], []
        for t_p, f_n, f_p, t_n in zip(*flat):
            if method == "epsdelta-bayes":  # the larger of the two statements' bounds, each at tail; null rule
                eps.append(epsdelta_credible_lower(t_p, f_n, f_p, t_n, delta=delta, tail=tail))
            else:  # lower end of the central credible interval of the signed mu; null rule
                mus.append(gdp_credible_lower(t_p, f_n, f_p, t_n, tail=tail))
        if mus:
            mu, eps = np.array(mus, dtype=float).reshape(tp.shape), None
        else:
            eps = np.array(eps, dtype=float).reshape(tp.shape)
    empty = (n_in == 0) | (n_out == 0)
    mu = np.where(empty & ~np.isnan(mu), 0.0, mu)
    return (None if eps is None else np.where(empty, 0.0, eps)), mu


def _pick(eps, mu, delta: float):
    """Index of the largest bound and its epsilon; GDP epsilon grows with mu (Eq. 6)."""
    if eps is None:
        i = int(np.argmax(mu))
        return i, mu_to_epsilon(float(mu.flat[i]), delta)
    i = int(np.argmax(eps))
    return i, float(eps.flat[i])


def epsilon_from_counts(
    tp: int, fn: int, fp: int, tn: int, *, delta: float, method: str = "gdp-cp", confidence: float = 0.95
) -> EpsilonEstimate:
    """Lower bound on epsilon from the counts of a threshold attack decided in advance."""
    tp, fn, fp, tn = (check_count(v, name) for v, name in zip((tp, fn, fp, tn), ("tp", "fn", "fp", "tn")))
    confidence = check_confidence(confidence)
    delta = check_delta(delta)
    _check_method(method, delta)
    eps, mu = _bound_from_counts(tp, fn, fp, tn, method=method, delta=delta, confidence=confidence)
    _, epsilon = _pick(eps, mu, delta)
    return _estimate(epsilon, mu, math.nan, tp, fn, fp, tn, method, confidence, delta, True)


def mu_from_counts(tp, fn, fp, tn, *, method: str = "gdp-cp", confidence: float = 0.95):
    """Lower bound on the GDP mu alone (no epsilon conversion) for a GDP method's counts.

    Counts may be arrays of equal shape (one bound per entry, in one vectorized pass);
    scalars give a float.
    """
    if method not in ("gdp-cp", "gdp-bayes"):
        raise ValueError(f"Unexpected value for `method`: {method!r}; mu_from_counts takes gdp-cp or gdp-bayes")
    confidence = check_confidence(confidence)
    tp, fn, fp, tn = check_counts(tp, fn, fp, tn)
    _, mu = _bound_from_counts(tp, fn, fp, tn, method=method, delta=1e-5, confidence=confidence)
    return float(mu) if np.ndim(mu) == 0 else mu


def bound_exceeds(
    tp, fn, fp, tn, *, epsilon: float, delta: float, method: str = "gdp-cp", confidence: float = 0.95
):
    """Where epsilon_from_counts(tp, fn, fp, tn, ...).epsilon > `epsilon`: the counts refute the
    claim (epsilon, delta) at `confidence`. Count arrays of one shape give a boolean array of that
    shape, scalars a bool.

    Computed without the Bayesian root searches: their posterior masses increase with the
    parameter, so a Bayesian bound is above a value exactly when the mass there is below the
    tail (one or two masses per distinct count tuple); the CP and Katz bounds are computed in
    one vectorized pass. For validity runs over many simulated trials
    (bench/validity/estimator_validity.py). A gdp-bayes claim beyond mu = 200 is tested at mu = 200.
    """
    epsilon = check_nonnegative(epsilon, "epsilon")
    confidence = check_confidence(confidence)
    delta = check_delta(delta)
    _check_method(method, delta)
    tp, fn, fp, tn = check_counts(tp, fn, fp, tn)
    shape = tp.shape
    if method in ("epsdelta-cp", "gdp-cp", "katz"):
        eps, mu = _bound_from_counts(tp, fn, fp, tn, method=method, delta=delta, confidence=confidence)
        if eps is None:
            values, inverse = np.unique(mu.reshape(-1), return_inverse=True)
            eps = np.array([mu_to_epsilon(float(v), delta) for v in values])[inverse].reshape(shape)
        out = eps > epsilon
        return bool(out) if out.ndim == 0 else out
    tail = (1.0 - confidence) / 2.0
    if method == "gdp-bayes":
        try:
            mu_claim = epsilon_to_mu(epsilon, delta)  # mu_to_epsilon(mu) > epsilon exactly when mu > mu_claim
        except ValueError:
            mu_claim = _MU_MAX
    table = np.stack([np.asarray(c, dtype=np.int64).reshape(-1) for c in (tp, fn, fp, tn)], axis=1)
    rows, inverse = np.unique(table, axis=0, return_inverse=True)
    flags = np.zeros(len(rows), dtype=bool)
    for i, (t_p, f_n, f_p, t_n) in enumerate(rows):
        if t_p + f_n == 0 or f_p + t_n == 0:  # an empty side bounds nothing
            continue
        if method == "epsdelta-bayes":
            flags[i] = epsdelta_credible_exceeds(t_p, f_n, f_p, t_n, epsilon, delta=delta, tail=tail)
        else:
            flags[i] = gdp_credible_exceeds(t_p, f_n, f_p, t_n, mu_claim, tail=tail)
    out = flags[inverse.reshape(-1)].reshape(shape)
    return bool(out) if out.ndim == 0 else out


def _estimate(eps, mu, threshold, tp, fn, fp, tn, method, confidence, delta, valid) -> EpsilonEstimate:
    n_in, n_out = int(tp + fn), int(fp + tn)
    mu = float(mu)
    return EpsilonEstimate(
        epsilon=float(eps),
        mu=None if math.isnan(mu) else mu,
        threshold=float(threshold),
        fpr=fp / n_out if n_out else math.nan,
        fnr=fn / n_in if n_in else math.nan,
        n_in=n_in,
        n_out=n_out,
        method=method,
        confidence=confidence,
        delta=delta,
        valid=valid,
    )


def _counts_at(sorted_in: np.ndarray, sorted_out: np.ndarray, thresholds):
    """(tp, fn, fp, tn) for the rule "in when score >= t", for each t, by binary search."""
    fn = np.searchsorted(sorted_in, thresholds, side="left")
    tn = np.searchsorted(sorted_out, thresholds, side="left")
    return len(sorted_in) - fn, fn, len(sorted_out) - tn, tn


def _best_candidates(sorted_in, sorted_out, limit: int) -> np.ndarray:
    pooled = np.unique(np.concatenate([sorted_in, sorted_out]))
    if len(pooled) > limit:
        pooled = np.unique(np.quantile(pooled, np.linspace(0.0, 1.0, limit)))
    return np.append(pooled, np.inf)


def epsilon_lower_bound(
    in_scores,
    out_scores,
    *,
    delta: float,
    method: str = "gdp-cp",
    confidence: float = 0.95,
    threshold: Union[float, str, None] = None,
) -> EpsilonEstimate:
    """Empirical lower bound on epsilon from scores with (in) and without (out) the canary.

    threshold: a number is used as given; None uses 0.5, the midpoint for normalized
    observations (out ~ N(0, s^2), in ~ N(1, s^2), as the auditor records them), which
    keeps the bound valid because it does not depend on the data; "best" takes the
    threshold with the largest bound on these same observations (valid=False). The
    sweep tries every distinct score, or that many quantiles of them when there are
    more than BEST_CANDIDATES[method].
    """
    in_sorted = np.sort(check_scores(in_scores, "in_scores"))
    out_sorted = np.sort(check_scores(out_scores, "out_scores"))
    confidence = check_confidence(confidence)
    delta = check_delta(delta)
    _check_method(method, delta)
    if isinstance(threshold, str):
        if threshold != "best":
            raise ValueError(f"Unexpected value for `threshold`: {threshold!r}; pass a number, None or 'best'")
        candidates = _best_candidates(in_sorted, out_sorted, BEST_CANDIDATES[method])
        valid = False
    else:
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.integer, np.floating))):
            raise ValueError(f"Unexpected value for `threshold`: {threshold!r}; pass a number, None or 'best'")
        value = DEFAULT_THRESHOLD if threshold is None else float(threshold)
        if math.isnan(value):
            raise ValueError("Unexpected value for `threshold`: nan")
        candidates = np.array([value])
        valid = True
    tp, fn, fp, tn = _counts_at(in_sorted, out_sorted, candidates)
    eps, mu = _bound_from_counts(tp, fn, fp, tn, method=method, delta=delta, confidence=confidence)
    i, epsilon = _pick(eps, mu, delta)
    return _estimate(epsilon, mu[i], candidates[i], tp[i], fn[i], fp[i], tn[i], method, confidence, delta, valid)
