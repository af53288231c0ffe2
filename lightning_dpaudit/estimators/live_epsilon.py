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
  The audit's results do not use this rounded-up accountant's epsilon: they ask a PRV
  accountant itself (analysis.assemble, `ResultAssembler.accountant_epsilon`), so the
  reported `epsilon_accountant` and the logged `dpaudit/eps_accountant` are Opacus's own.

Opacus is imported only when needed, so this module stays free of torch.
"""

from __future__ import annotations

import bisect
import math
from typing import Optional, Sequence, Tuple

import numpy as np
from scipy import special
from scipy.optimize import brentq

from ._checks import check_delta, check_nonnegative
from .composition import ACCOUNTANTS, MAX_PRV_POINTS
from .rdp_curves import (
    _LRU,
    CURVES_CACHE_SIZE,
    _alphas,
    _Curves,
    _lower_rdp_epsilon,
    _lower_rdp_epsilon_of,
    _opacus_curve,
    _rdp_epsilon,
)

History = Sequence[Tuple[float, float, int]]

_PRV_EPS_ERROR = 0.01  # PRVAccountant.get_epsilon's default, as the auditor calls it


def _gdp_epsilon(sigma: float, q: float, steps: int, delta: float, *, upper: bool) -> float:
    """opacus.accountants.analysis.gdp.compute_eps_poisson with ndtr for norm.cdf.

    Where Opacus's bracket [0, 500] holds no root (and it raises): 0 when epsilon = 0
    already meets delta; when even epsilon = 500 does not, inf for the accountant
    (upper=True) and 500 for a lower bound. A noise multiplier of 0 is mu = inf: no privacy.
    """
    if sigma == 0.0:
        return math.inf if upper else 500.0
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
    if 2 * size / mesh > MAX_PRV_POINTS:  # refused before anything is allocated (composition.check_composition_size)
        raise ValueError(f"the PRV accountant would discretise {total:,} steps on {2 * size / mesh:.3g} points, above "
                         f"the bound of {MAX_PRV_POINTS:,} points (2**23, about 2 GB)")
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


def merge_history(history: History) -> list:
    """`history` with each run of consecutive entries of equal (noise multiplier, sample rate) as one entry of their
    summed steps: the same composition for an accountant that composes every entry (RDP, PRV; Opacus's own merge a
    step into the last entry so), computed once per run instead of once per entry. Not for GDP, which reads the
    last entry alone."""
    merged: list = []
    for sigma, q, n in history:
        if merged and merged[-1][0] == sigma and merged[-1][1] == q:
            merged[-1] = (sigma, q, merged[-1][2] + n)
        else:
            merged.append((sigma, q, n))
    return merged


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
        self._exact_curves = _LRU(CURVES_CACHE_SIZE)  # (sigma, q) -> Opacus's per-step RDP curve
        self._fast_curves = None  # _Curves, for the lower bound
        self._values = _LRU()  # (which, rounded history) -> epsilon
        self._orders = None

    # ------------------------------------------------------------ public

    def accountant_epsilon(self, history: History) -> float:
        """The epsilon Opacus's accountant of this kind reports for `history` at delta.

        RDP and GDP: equal to `get_epsilon(delta)` (RDP in identical floating point, GDP
        to brentq's tolerance). PRV: `get_epsilon(delta)` of the history extended to the
        next grid count of total steps, so never below the value for `history` itself. A step composed at noise
        multiplier 0 released without noise: inf (Opacus's RDP accountant says so; its PRV and GDP ones raise).
        """
        entries = self._composed(history)
        if not entries:
            return 0.0
        if any(s == 0 for s, _, _ in entries):
            return math.inf
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
        exact value, never below 0 (a conversion below 0, at a large delta, means 0).
        """
        return _not_negative(self._lower_bound_epsilon(mu_step, history))

    def _lower_bound_epsilon(self, mu_step: float, history: History) -> float:
        mu_step = check_nonnegative(mu_step, "mu_step")
        entries = self._composed(history)
        edge = _edge_bound(mu_step, entries)
        if edge is not None:
            return edge
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
        entries = tuple(merge_history((sigma, q, n) for _, q, n in entries))
        return self._values.get_or(("lower", entries), lambda: _prv_epsilon(entries, self.delta, self._curves().full))

    def lower_bound_epsilon_scaled(self, ratio: float, history: History) -> float:
        """The end-to-end lower bound when every step leaks `ratio` x its own claim.

        Each history entry (sigma, q, n) becomes (sigma / ratio, q, n), composed by the
        accountant's method: the lower bound of a run whose noise multiplier changes
        (estimators.changing_claims gives the ratio). `ratio` is rounded down to the
        `mu_resolution` grid (PRV: capped at `prv_mu_cap`; RDP: composed from the lowered
        vectorized curves, as `lower_bound_epsilon`), so the value is never above the exact
        one, and never below 0.
        """
        return _not_negative(self._lower_bound_epsilon_scaled(ratio, history))

    def _lower_bound_epsilon_scaled(self, ratio: float, history: History) -> float:
        ratio = check_nonnegative(ratio, "ratio")
        entries = self._composed(history)
        edge = _edge_bound(ratio, entries)
        if edge is not None:
            return edge
        if self.accountant == "prv" and self.prv_mu_cap is not None:
            ratio = min(ratio, self.prv_mu_cap)
        ratio = _round_down(ratio, self.mu_resolution)
        # a step at noise multiplier 0 leaks without bound: leaving it out keeps the value a lower bound
        scaled = tuple((s / ratio, q, n) for s, q, n in entries if s > 0)
        if not scaled:
            return 0.0
        if self.accountant == "gdp":
            s, q, n = scaled[-1]
            return _gdp_epsilon(s, q, n, self.delta, upper=False)
        if self.accountant == "rdp":  # as the one-claim bound: the vectorized curves, lowered, at the orders needed
            steps = {}
            for s, q, n in scaled:
                steps[(s, q)] = steps.get((s, q), 0) + n
            return self._values.get_or(("scaled", scaled), lambda: _lower_rdp_epsilon_of(self._curves(), steps,
                                                                                         self.delta))
        return self._values.get_or(("scaled", scaled), lambda: _prv_epsilon(scaled, self.delta, self._exact_curve))

    def _composed(self, history: History) -> Tuple[Tuple[float, float, int], ...]:
        """The entries the accountant composes: runs of equal entries merged, but for GDP (its last entry alone)."""
        entries = _entries(history)
        return entries if self.accountant == "gdp" else tuple(merge_history(entries))

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


def _not_negative(epsilon: float) -> float:
    """A lower bound on epsilon below 0 (an RDP or PRV conversion at a large delta) is 0; nan stays nan."""
    return 0.0 if epsilon < 0.0 else epsilon


def _edge_bound(leak: float, entries) -> Optional[float]:
    """The lower bound where it needs no composition: 0 with no leak or no steps, inf for an unbounded leak."""
    if leak == 0.0 or not entries:
        return 0.0
    if math.isinf(leak):
        return math.inf
    return None


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
