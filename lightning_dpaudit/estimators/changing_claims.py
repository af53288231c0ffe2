"""Observations from steps with different claims: a lower bound on the ratio actual / claimed mu.

When the noise multiplier changes during a run, step t claims mu_t-GDP. In the normalized
units of the audit (out-canaries N(0, 1/mu_t^2), in-canaries N(1, 1/mu_t^2)) the
threshold-0.5 attack errs at step t with probability Phi(-mu_t / 2) on either side.
Model the implementation as leaking r times its claim at every step (actual mu = r mu_t,
the shape of a noise bug that scales every step's noise). Over segments j with n_in_j
in-observations and n_out_j out-observations at claim mu_j, the pooled error rates are

    fnr(r) = sum_j n_in_j Phi(-r mu_j / 2) / sum_j n_in_j,   fpr(r) likewise with n_out_j,

and the mu an estimator reads from the pooled counts estimates
m(r) = -Phi^-1(fpr(r)) - Phi^-1(fnr(r)), increasing in r. A lower bound mu_lower on m
therefore gives the lower bound r_lower = m^-1(mu_lower) on r. With one claim,
m(r) = r mu and r_lower = mu_lower / mu.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from scipy.optimize import brentq
from scipy.special import log_ndtr, ndtri_exp


def mixture_mu(ratio: float, n_in: Sequence[float], n_out: Sequence[float], mu_claims: Sequence[float]) -> float:
    """m(r): the mu of the pooled threshold-0.5 error rates when every step leaks `ratio` x its claim."""
    n_in, n_out, mus = (np.asarray(a, dtype=float) for a in (n_in, n_out, mu_claims))
    log_rates = log_ndtr(-ratio * mus / 2.0)
    return -_log_average_ndtri(log_rates, n_out) - _log_average_ndtri(log_rates, n_in)


def _log_average_ndtri(log_rates: np.ndarray, weights: np.ndarray) -> float:
    """Phi^-1 of the weighted average of exp(log_rates), computed in log space (rates far in the tail)."""
    keep = weights > 0
    if not keep.any():
        return 0.0
    top = log_rates[keep].max()
    log_mean = top + math.log(np.sum(weights[keep] * np.exp(log_rates[keep] - top)) / weights[keep].sum())
    return float(ndtri_exp(min(log_mean, 0.0)))


def ratio_lower_bound(mu_lower: float, n_in: Sequence[float], n_out: Sequence[float], mu_claims: Sequence[float]) -> float:
    """r_lower = m^-1(mu_lower): the largest ratio actual / claimed mu the pooled bound mu_lower certifies.

    0 when mu_lower <= 0; inf when mu_lower is infinite.
    """
    mus = np.asarray(mu_claims, dtype=float)
    if len(mus) == 0 or not np.all(mus > 0):
        raise ValueError(f"Unexpected value for `mu_claims`: {list(mu_claims)}; every claim must be > 0")
    if not mu_lower > 0:
        return 0.0
    if math.isinf(mu_lower):
        return math.inf
    if len(set(mus.tolist())) == 1:
        return float(mu_lower / mus[0])
    # m(r) >= r min(mu_j) and m(r) <= r max(mu_j): the root lies between these
    low, high = mu_lower / mus.max(), mu_lower / mus.min()
    if high <= low * (1 + 1e-12):
        return float(low)
    return float(brentq(lambda r: mixture_mu(r, n_in, n_out, mus) - mu_lower, low * (1 - 1e-9), high * (1 + 1e-9),
                        xtol=1e-10, rtol=1e-10))
