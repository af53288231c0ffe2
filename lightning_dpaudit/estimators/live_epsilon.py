"""Both epsilons of a run, cheap enough to recompute at every log step.

`LiveEpsilon` gives, for an Opacus accountant history [(noise_multiplier, sample_rate,
steps), ...], the accountant's epsilon and the end-to-end lower bound of
`end_to_end_epsilon` (every entry with the empirical noise multiplier 1/mu_step). It
reuses work between calls instead of rebuilding accountants:

- RDP. The per-step RDP curve of each (noise multiplier, sample rate) is computed once
  and scaled by the step counts, as `RDPAccountant.get_epsilon` does from scratch each
  call; the accountant's epsilon uses Opacus's own curve (identical floating point).
  The lower bound rounds mu_step DOWN to a relative grid (`mu_resolution`, 0.1%) so its
  curve is reused while mu_step drifts, and computes that curve with a vectorized form
  of Opacus's series (`_rdp_curve`), only at the orders that can hold the minimum
  (`_lower_rdp_epsilon`: ~1 ms instead of 20-500 ms), lowered by far more than the
  floating-point difference between the two summations (`_lowered`). It is never above
  `end_to_end_epsilon`, and below it by the mu rounding only (0.17% at most over a
  1,000-step digits run, 0.8% over random sample rates, steps and mu).
- GDP. Opacus's closed form (mu of the Poisson-subsampled Gaussian, then brentq on the
  GDP curve) with scipy's ndtr in place of norm.cdf (the same function without
  scipy.stats' per-call overhead): the same numbers in ~0.1 ms instead of ~5 ms. No
  rounding. Like `GaussianAccountant`, only the last history entry counts.
- PRV. Each evaluation discretizes and convolves anew (tens to hundreds of ms), so
  Opacus's computation is repeated exactly (its RDP domain bound from the cached curves)
  but only on a grid of total step counts (`prv_steps_resolution`, 3%: every count up to
  33, then counts ~3% apart) and of mu (`prv_mu_resolution`, 1%). Between grid points
  the accountant's epsilon is the value at the next grid count (the last entry's steps
  extended: rounded UP), and the lower bound the value at the grid mu below mu_step and
  the grid count below (steps removed from the end: rounded DOWN). Epsilon grows with
  steps and with mu, so the accountant's epsilon is never below Opacus's and the lower
  bound never above `end_to_end_epsilon`; a violation is never invented. At grid points
  both equal Opacus's values. Opacus's PRV slows and grows with mu (at 200 steps of
  sample rate 0.036: 0.1 s at mu 1, 0.5 s at 2, 3 s and 0.3 GB at 4; at 8 it raises),
  so the lower bound also caps mu_step at `prv_mu_cap` (2) times the run's largest
  claimed mu: a smaller mu, so a smaller epsilon, which already exceeds the accountant's.

Opacus is imported only when needed, so this module stays free of torch.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from typing import Optional, Sequence, Tuple

import numpy as np
from scipy import special
from scipy.optimize import brentq

from ._checks import check_delta, check_nonnegative
from .composition import ACCOUNTANTS

History = Sequence[Tuple[float, float, int]]

_CACHE_SIZE = 64
_PRV_EPS_ERROR = 0.01  # PRVAccountant.get_epsilon's default, as the auditor calls it
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
        self.cache = _LRU()

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
    """A value <= RDPAccountant's epsilon for `steps_by_q` steps at noise multiplier sigma.

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
        total = sum(n * _lowered(curves.get(sigma, q, want), orders) for q, n in steps_by_q.items())
        known = ~np.isnan(total)
        best = np.min((total + const)[known])
        below = np.maximum.accumulate(np.where(known, index, -1))
        floor = np.where(below >= 0, total[np.maximum(below, 0)], 0.0)
        want = np.flatnonzero(~known & (floor + const < best))
        if not want.size:
            return float(best)


def _opacus_curve(sigma: float, q: float, orders: np.ndarray) -> np.ndarray:
    from opacus.accountants.analysis.rdp import compute_rdp

    return compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(orders))


def _rdp_epsilon(curves_and_steps, orders: np.ndarray, delta: float) -> float:
    """RDPAccountant.get_privacy_spent's epsilon from per-step curves and step counts."""
    from opacus.accountants.analysis.rdp import get_privacy_spent

    rdp = sum([curve * steps for curve, steps in curves_and_steps])
    eps, _ = get_privacy_spent(orders=list(orders), rdp=rdp, delta=delta)
    return float(eps)


# ---------------------------------------------------------------- GDP


def _gdp_epsilon(sigma: float, q: float, steps: int, delta: float, *, upper: bool) -> float:
    """opacus.accountants.analysis.gdp.compute_eps_poisson with ndtr for norm.cdf.

    Where Opacus's bracket [0, 500] holds no root (and it raises): 0 when epsilon = 0
    already meets delta; when even epsilon = 500 does not, inf for the accountant
    (upper=True) and 500 for a lower bound.
    """
    mu = np.sqrt(np.exp(sigma ** (-2)) - 1) * np.sqrt(steps) * q

    def excess(eps):
        return special.ndtr(-eps / mu + mu / 2) - np.exp(eps) * special.ndtr(-eps / mu - mu / 2) - delta

    if not np.isfinite(mu) or not excess(500.0) < 0:
        return math.inf if upper else 500.0
    if not excess(0.0) > 0:
        return 0.0
    return float(brentq(excess, 0, 500))


# ---------------------------------------------------------------- PRV


class _StepGrid:
    """Total step counts 1, 2, ..., then each about (1 + resolution) times the previous."""

    def __init__(self, resolution: float):
        self.growth = 1.0 + resolution
        self.points = [1]

    def _cover(self, steps: int) -> None:
        while self.points[-1] < steps:
            last = self.points[-1]
            self.points.append(max(last + 1, int(last * self.growth)))

    def down(self, steps: int) -> int:
        """Largest grid count <= steps (steps >= 1)."""
        self._cover(steps)
        return self.points[bisect.bisect_right(self.points, steps) - 1]

    def up(self, steps: int) -> int:
        """Smallest grid count >= steps (steps >= 1)."""
        self._cover(steps)
        return self.points[bisect.bisect_left(self.points, steps)]


def _prv_epsilon(history, delta: float, curve) -> float:
    """PRVAccountant.get_epsilon(delta) for `history`, with RDP curves from `curve(sigma, q)`.

    The same steps as PRVAccountant._get_dprv and compute_safe_domain_size, in the same
    floating point; only the RDP curves for the domain size come from a cache.
    """
    from opacus.accountants.analysis.prv import (
        Domain,
        PoissonSubsampledGaussianPRV,
        TruncatedPrivacyRandomVariable,
        compose_heterogeneous,
        discretize,
    )

    orders = _alphas()
    eps_error, delta_error = _PRV_EPS_ERROR, delta / 1000
    counts = [n for _, _, n in history]
    total = sum(counts)
    size = _rdp_epsilon([(curve(s, q), n) for s, q, n in history], orders, delta_error / 4)
    for s, q, _ in history:
        size = max(size, _rdp_epsilon([(curve(s, q), 1)], orders, delta_error / (8 * total)))
    size = max(size, eps_error) + 3
    mesh = eps_error / np.sqrt(total * np.log(12 / delta_error) / 2)
    domain = Domain.create_aligned(-size, size, mesh)
    prvs = [PoissonSubsampledGaussianPRV(q, s) for s, q, _ in history]
    dprvs = [discretize(TruncatedPrivacyRandomVariable(p, domain.t_min, domain.t_max), domain) for p in prvs]
    composed = compose_heterogeneous(dprvs=dprvs, num_self_compositions=counts)
    return float(composed.compute_epsilon(delta, delta_error, eps_error)[2])


def _extend(entries, extra: int):
    """`entries` with `extra` more steps of the last entry."""
    s, q, n = entries[-1]
    return entries[:-1] + ((s, q, n + extra),)


def _truncate(entries, total: int):
    """The first `total` steps of `entries`."""
    kept, left = [], total
    for s, q, n in entries:
        if left <= 0:
            break
        kept.append((s, q, min(n, left)))
        left -= n
    return tuple(kept)


# ---------------------------------------------------------------- the live pair


def _entries(history: History) -> Tuple[Tuple[float, float, int], ...]:
    out = []
    for sigma, q, n in history:
        sigma, q, n = float(sigma), float(q), int(n)
        if not 0.0 < q <= 1.0 or n < 0 or not sigma >= 0.0:
            raise ValueError(f"Unexpected history entry: noise_multiplier={sigma}, sample_rate={q}, steps={n}")
        if n > 0:
            out.append((sigma, q, n))
    return tuple(out)


class LiveEpsilon:
    """The accountant's epsilon and the end-to-end lower bound, reusing work between calls.

    accountant: the kind of Opacus accountant of the run ("rdp", "prv" or "gdp", i.e.
    `accountant.mechanism()`). delta: the delta of both epsilons.
    mu_resolution: relative grid to which the RDP lower bound rounds mu_step down (0:
    no rounding). prv_mu_resolution, prv_steps_resolution: the PRV grids of mu and of
    total steps (0: compute exactly at every call). prv_mu_cap: the PRV lower bound uses
    at most this multiple of the run's largest claimed mu (1 / noise multiplier; None:
    no cap). See the module docstring for what each rounding costs and why its direction
    is safe.
    """

    def __init__(
        self,
        accountant: str = "rdp",
        *,
        delta: float,
        mu_resolution: float = 1e-3,
        prv_mu_resolution: float = 1e-2,
        prv_steps_resolution: float = 3e-2,
        prv_mu_cap: Optional[float] = 2.0,
    ):
        if accountant not in ACCOUNTANTS:
            raise ValueError(
                f"Unexpected value for `accountant`: {accountant!r}; valid accountants are {', '.join(ACCOUNTANTS)}"
            )
        self.accountant = accountant
        self.delta = check_delta(delta, allow_zero=False, why="the composed Gaussian has epsilon = inf at delta = 0")
        for name, value in (
            ("mu_resolution", mu_resolution),
            ("prv_mu_resolution", prv_mu_resolution),
            ("prv_steps_resolution", prv_steps_resolution),
        ):
            if not 0.0 <= float(value) < 1.0:
                raise ValueError(f"Unexpected value for `{name}`: {value}; it must lie in [0, 1)")
        self.mu_resolution = float(mu_resolution)
        self.prv_mu_resolution = float(prv_mu_resolution)
        self.prv_steps_resolution = float(prv_steps_resolution)
        if prv_mu_cap is not None and not float(prv_mu_cap) >= 1.0:
            raise ValueError(f"Unexpected value for `prv_mu_cap`: {prv_mu_cap}; use a number >= 1 or None")
        self.prv_mu_cap = None if prv_mu_cap is None else float(prv_mu_cap)
        self._grid = _StepGrid(self.prv_steps_resolution)
        self._exact_curves = _LRU()  # (sigma, q) -> Opacus's per-step RDP curve
        self._fast_curves = None  # _Curves, for the lower bound
        self._values = _LRU()  # (which, rounded history) -> epsilon
        self._orders = None

    # ------------------------------------------------------------ public

    def accountant_epsilon(self, history: History) -> float:
        """The epsilon Opacus's accountant of this kind reports for `history` at delta.

        RDP and GDP: equal to `get_epsilon(delta)` (RDP in identical floating point, GDP
        to brentq's tolerance). PRV: `get_epsilon(delta)` of the history extended to the
        next grid count of total steps, so never below the value for `history` itself.
        """
        entries = _entries(history)
        if not entries:
            return 0.0
        if self.accountant == "rdp":
            curves = [(self._exact_curve(s, q), n) for s, q, n in entries]
            return _rdp_epsilon(curves, self._alphas(), self.delta)
        if self.accountant == "gdp":
            s, q, n = entries[-1]
            return _gdp_epsilon(s, q, n, self.delta, upper=True)
        total = sum(n for _, _, n in entries)
        if self.prv_steps_resolution > 0:
            entries = _extend(entries, self._grid.up(total) - total)
        return self._values.get_or(("acc", entries), lambda: _prv_epsilon(entries, self.delta, self._exact_curve))

    def lower_bound_epsilon(self, mu_step: float, history: History) -> float:
        """`end_to_end_epsilon(mu_step, history=history)`, or a value just below it.

        RDP: mu_step rounded down to the `mu_resolution` grid. GDP: exact. PRV: mu_step
        capped, then it and the total steps rounded down to their grids. Never above the
        exact value.
        """
        mu_step = check_nonnegative(mu_step, "mu_step")
        entries = _entries(history)
        if mu_step == 0.0 or not entries:
            return 0.0
        if math.isinf(mu_step):
            return math.inf
        if self.accountant == "gdp":
            _, q, n = entries[-1]
            return _gdp_epsilon(1.0 / mu_step, q, n, self.delta, upper=False)
        if self.accountant == "rdp":
            sigma = 1.0 / _round_down(mu_step, self.mu_resolution)
            steps = {}
            for _, q, n in entries:
                steps[q] = steps.get(q, 0) + n
            return _lower_rdp_epsilon(self._curves(), sigma, steps, self.delta)
        least_noise = min(s for s, _, _ in entries)
        if self.prv_mu_cap is not None and least_noise > 0:
            mu_step = min(mu_step, self.prv_mu_cap / least_noise)
        sigma = 1.0 / _round_down(mu_step, self.prv_mu_resolution)
        if self.prv_steps_resolution > 0:
            entries = _truncate(entries, self._grid.down(sum(n for _, _, n in entries)))
        entries = tuple((sigma, q, n) for _, q, n in entries)
        return self._values.get_or(("lower", entries), lambda: _prv_epsilon(entries, self.delta, self._curves().full))

    # ------------------------------------------------------------ caches

    def _alphas(self) -> np.ndarray:
        if self._orders is None:
            self._orders = _alphas()
        return self._orders

    def _exact_curve(self, sigma: float, q: float) -> np.ndarray:
        return self._exact_curves.get_or((sigma, q), lambda: _opacus_curve(sigma, q, self._alphas()))

    def _curves(self) -> _Curves:
        if self._fast_curves is None:
            self._fast_curves = _Curves(self._alphas())
        return self._fast_curves


def _round_down(mu: float, resolution: float) -> float:
    """The largest (1 + resolution)^k <= mu (mu itself when resolution is 0)."""
    if resolution == 0.0:
        return mu
    step = math.log1p(resolution)
    k = math.floor(math.log(mu) / step)
    while math.exp(k * step) > mu:
        k -= 1
    while math.exp((k + 1) * step) <= mu:
        k += 1
    return math.exp(k * step)
