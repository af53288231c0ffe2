"""Rényi-DP curves of the subsampled Gaussian for the live epsilons (see live_epsilon.py).

The per-step RDP curve of each (noise multiplier, sample rate), cached and scaled by step
counts; a vectorized form of Opacus's series for the lower bound, evaluated only at the
orders that can hold the minimum and lowered by more than the floating-point difference
between the two summations. Opacus is imported only when needed (no torch).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
from scipy import special

_CACHE_SIZE = 64
# Per-step curves kept: one per (noise multiplier, sample rate) of a history, so that a noise schedule of many values
# (claim_segments.MAX_SEGMENTS, 4,096) is computed once, not once per call; 151 orders, 1.2 kB a curve, 5 MB at most.
CURVES_CACHE_SIZE = 4096
_STOP = -30.0  # Opacus's cut-off for the fractional-order series


def _alphas() -> np.ndarray:
    from opacus.accountants import RDPAccountant

    return np.asarray(RDPAccountant.DEFAULT_ALPHAS, dtype=float)


class _LRU(OrderedDict):
    def __init__(self, size: int = _CACHE_SIZE):
        super().__init__()
        self.size = size

    def get_or(self, key, compute):
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = compute()
        if len(self) > self.size:
            self.popitem(last=False)
        return value


# ---------------------------------------------------------------- RDP curves


def _logsumexp(x: np.ndarray) -> np.ndarray:
    """log(sum(exp(x))) over the last axis; -inf for rows of -inf."""
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.sum(np.exp(x - m), axis=-1)) + m[..., 0]


def _rdp_curve(q: float, sigma: float, orders: np.ndarray) -> np.ndarray:
    """Per-step RDP of the Poisson-subsampled Gaussian at `orders`, vectorized.

    The same series as opacus.accountants.analysis.rdp._compute_rdp (Mironov, Talwar and
    Zhang 2019, section 3.3), with the same terms (integer orders: the binomial sum;
    fractional orders: both series up to the first term below e^-30), summed with numpy
    instead of term by term; it agrees with Opacus to ~1e-13 in log A_alpha.
    """
    orders = np.asarray(orders, dtype=float)
    if q == 0:
        return np.zeros_like(orders)
    if sigma == 0:
        return np.full_like(orders, np.inf)
    if q == 1.0:
        return orders / (2 * sigma**2)
    out = np.empty_like(orders)
    log_q, log_1q = math.log(q), math.log(1 - q)
    two_s2 = 2 * (sigma**2)
    integer = orders == np.floor(orders)
    if integer.any():
        a = orders[integer][:, None]
        i = np.arange(int(a.max()) + 1, dtype=float)[None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.log(special.binom(a, i)) + i * log_q + (a - i) * log_1q + (i * i - i) / two_s2
        out[integer] = _logsumexp(np.where(i <= a, s, -np.inf)) / (a[:, 0] - 1)
    frac = np.flatnonzero(~integer)
    if frac.size:
        z0 = sigma**2 * math.log(1 / q - 1) + 0.5
        scale = math.sqrt(2) * sigma
        # running log-sums of the positive and the negative terms of A0 and of A1
        sums = np.full((4, frac.size), -np.inf)
        active = np.arange(frac.size)
        start, width = 0, 32
        while active.size:
            a = orders[frac[active]][:, None]
            i = np.arange(start, start + width, dtype=float)[None, :]
            coef = special.binom(a, i)
            log_coef = np.log(np.abs(coef))
            j = a - i
            log_s0 = (
                log_coef + i * log_q + j * log_1q + (i * i - i) / two_s2
                + special.log_ndtr(-((i - z0) / scale) * 2**0.5)
            )
            log_s1 = (
                log_coef + j * log_q + i * log_1q + (j * j - j) / two_s2
                + special.log_ndtr(-((z0 - j) / scale) * 2**0.5)
            )
            stop = np.maximum(log_s0, log_s1) < _STOP
            done = stop.any(axis=1)
            last = np.where(done, np.argmax(stop, axis=1), width - 1)[:, None]
            kept = np.arange(width)[None, :] <= last
            pos, neg = kept & (coef > 0), kept & ~(coef > 0)
            blocks = np.stack([np.where(m, s, -np.inf) for s in (log_s0, log_s1) for m in (pos, neg)])
            sums[:, active] = np.logaddexp(sums[:, active], _logsumexp(blocks))
            active = active[~done]
            start += width
            width *= 2
        with np.errstate(divide="ignore", invalid="ignore"):
            log_a0 = np.where(sums[1] == -np.inf, sums[0], sums[0] + np.log1p(-np.exp(sums[1] - sums[0])))
            log_a1 = np.where(sums[3] == -np.inf, sums[2], sums[2] + np.log1p(-np.exp(sums[3] - sums[2])))
        out[frac] = np.logaddexp(log_a0, log_a1) / (orders[frac] - 1)
    return out


class _Curves:
    """Per-step RDP curves from `_rdp_curve`, each order computed when first needed."""

    def __init__(self, orders: np.ndarray):
        self.orders = orders
        self.cache = _LRU(CURVES_CACHE_SIZE)

    def get(self, sigma: float, q: float, want: np.ndarray) -> np.ndarray:
        """The curve of (sigma, q), nan at orders not computed yet; computes `want` first."""
        curve = self.cache.get_or((sigma, q), lambda: np.full(self.orders.size, np.nan))
        missing = want[np.isnan(curve[want])]
        if missing.size:  # nan marks "not computed", so a failed order counts as 0, its floor
            curve[missing] = np.nan_to_num(_rdp_curve(q, sigma, self.orders[missing]), nan=0.0)
        return curve

    def full(self, sigma: float, q: float) -> np.ndarray:
        return self.get(sigma, q, np.arange(self.orders.size))


def _lowered(curve: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """`curve` lowered by more than its floating-point distance from Opacus's curve.

    1e-11 + 1e-12 |log A_alpha| in log A_alpha: the two summations differ by < 3e-13 over
    sample rates 1e-4..0.99 and noise multipliers 0.3..1000 (tests/test_live_epsilon.py).
    """
    with np.errstate(invalid="ignore"):
        log_a = curve * (orders - 1)
        lowered = (log_a - 1e-11 - 1e-12 * np.abs(log_a)) / (orders - 1)
    return np.where(np.isfinite(curve), np.maximum(lowered, 0.0), curve)  # nan (not computed) and inf stay


def _lower_rdp_epsilon(curves: _Curves, sigma: float, steps_by_q: dict, delta: float) -> float:
    """A value <= RDPAccountant's epsilon for `steps_by_q` steps at noise multiplier sigma (_lower_rdp_epsilon_of)."""
    return _lower_rdp_epsilon_of(curves, {(sigma, q): n for q, n in steps_by_q.items()}, delta)


def _lower_rdp_epsilon_of(curves: _Curves, steps: dict, delta: float) -> float:
    """A value <= RDPAccountant's epsilon for `steps` ((noise multiplier, sample rate) -> steps).

    get_privacy_spent minimizes over the orders alpha of
    f(alpha) = rdp(alpha) - (log delta + log alpha) / (alpha - 1) + log((alpha - 1) / alpha).
    The integer orders are cheap and computed first. RDP never decreases with the order,
    so at an order not computed yet f is at least the rdp at the nearest computed order
    below it plus its own constant term (0 below the first computed order); only orders
    where that bound falls under the best f so far are computed, until none is left. The
    minimum over the computed orders of f, with the lowered curves, is then <= Opacus's
    minimum over all orders; at the optimal order the two differ by the lowering only.
    """
    orders = curves.orders
    const = -(np.log(delta) + np.log(orders)) / (orders - 1) + np.log((orders - 1) / orders)
    want = np.flatnonzero(orders == np.floor(orders))
    index = np.arange(orders.size)
    while True:
        total = sum(n * _lowered(curves.get(sigma, q, want), orders) for (sigma, q), n in steps.items())
        known = ~np.isnan(total)
        best = np.min((total + const)[known])
        below = np.maximum.accumulate(np.where(known, index, -1))
        floor = np.where(below >= 0, total[np.maximum(below, 0)], 0.0)
        want = np.flatnonzero(~known & (floor + const < best))
        if not want.size:
            return float(best)


def _opacus_curve(sigma: float, q: float, orders: np.ndarray) -> np.ndarray:
    """Opacus's per-step RDP curve; inf at every order where its series overflows (a noise multiplier so small,
    1e-300, that 1 / sigma**2 is not a float: Opacus's own get_epsilon raises ZeroDivisionError there)."""
    from opacus.accountants.analysis.rdp import compute_rdp

    try:
        return compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(orders))
    except (ZeroDivisionError, OverflowError):
        return np.full(len(orders), np.inf)


def _rdp_epsilon(curves_and_steps, orders: np.ndarray, delta: float) -> float:
    """RDPAccountant.get_privacy_spent's epsilon from per-step curves and step counts."""
    from opacus.accountants.analysis.rdp import get_privacy_spent

    rdp = sum([curve * steps for curve, steps in curves_and_steps])
    eps, _ = get_privacy_spent(orders=list(orders), rdp=rdp, delta=delta)
    return float(eps)


# ---------------------------------------------------------------- GDP
