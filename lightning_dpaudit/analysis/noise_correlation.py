"""Noise freshness within a window: correlation between a step's noise and each of the previous L steps'.

Signs, as in the fingerprints. Under a correct optimizer the sentinel noise of a step is a
fresh draw of independent centred Gaussians (any scales), so its sign vector s_t is
uniform on {-1, 1}^n (n sentinels) and independent of every earlier step. For a lag l
(counted in recorded steps) let

    X_t(l) = <s_t, s_(t-l)> / sqrt(n),      S_T(l) = X_(l+1)(l) + ... + X_(l+T)(l).

Given the past, X_t(l) is a sum of n independent fair +-1 coins over sqrt(n), so
E[X_t(l) | past] = 0 and E[exp(lam X_t(l)) | past] = cosh(lam / sqrt(n))^n <= exp(lam^2 / 2):
S_T(l) is a martingale with 1-sub-Gaussian increments. Mixing exp(lam S_T - lam^2 T / 2)
over lam ~ N(0, 1 / RHO) gives the nonnegative supermartingale
sqrt(RHO / (T + RHO)) exp(S_T^2 / (2 (T + RHO))), and Ville's inequality the normal-mixture
(Robbins) boundary: with probability >= 1 - a, for every T at once,

    S_T(l)^2 < (T + RHO) (2 log(1 / a) + log((T + RHO) / RHO)).

Each of the L lags gets a = alpha / L, so a correct run crosses any boundary, at any
step, ever, with probability <= alpha, however long it runs and however often it is read.

What it sees. Gaussian noise with correlation r between steps t and t - l has
E[s_t,i s_(t-l),i] = (2 / pi) arcsin(r): S_T(l) drifts by sqrt(n) (2 / pi) arcsin(r) a
step, and the boundary grows like sqrt(T log T), so any fixed correlation at one lag is
found, after about 2 log(L / alpha) pi^2 / (4 n r^2) steps for small r (about 0.5 / r^2
at the defaults): lag-1 correlation 0.3 within tens of steps, antithetic noise (the
negation of the previous step's every second step) within a few. Replays beyond L
steps are the fingerprints' (noise_fingerprints.py).

Interval. With independent coordinates the centred X_t(l) are 1-sub-Gaussian under
correlation too (Hoeffding), so the same boundary at level a gives an anytime interval
for the mean sign correlation c = E[s s'] at a lag, (S_T / T -+ boundary / T) / sqrt(n);
at (1 - confidence) / L it holds for every lag at once, hence for the lag that fired.
sin(pi c / 2) maps it to a Gaussian correlation (exact when the correlation is the same
at every step, as in z_t = a z_(t-l) + b fresh).

Cost: one (L x n) float32 matrix-vector product a step; memory L x n float32 signs, L
sums and L step labels, whatever the run's length.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .schema import Field, Section

QUIET = 1e-3  # |noise| below this (x sigma*C) is no noise: its sign is not counted
RHO = 16.0  # mixture precision: the boundary is tightest around T of a few RHO to a few hundred


@dataclass(frozen=True)
class Correlation:
    """The correlation test's evidence at one lag, read when a result is built.

    lag        recorded steps between the two noises; step, earlier: the pair that crossed
    pairs      step pairs at this lag seen so far; sign: their mean sign correlation c
    value, low, high: sin(pi c / 2) and its interval at `confidence`, every lag at once
    """

    lag: int
    step: int
    earlier: int
    pairs: int
    sign: float
    value: float
    low: float
    high: float
    confidence: float


def boundary(pairs, a: float, rho: float = RHO):
    """The normal-mixture boundary on |S_T| after T = `pairs` pairs at level a (int or array)."""
    t = np.asarray(pairs, dtype=np.float64) + rho
    return np.sqrt(t * (2.0 * math.log(1.0 / a) + np.log(t / rho)))


def _window_shapes(state, ctx):
    """The window holds min(n, lags) steps: a row of signs (one per sentinel, ctx["sentinels"]) and a label for
    each; a sum per lag."""
    lags, rows = state["lags"], min(state["n"], state["lags"])
    wanted = (("signs", (rows, ctx.get("sentinels", "sentinels")), "a row of sentinel signs per step in the window"),
              ("labels", (rows,), "a step per row of signs"), ("sums", (lags,), "a sum per lag"))
    for name, shape, why in wanted:
        held = np.shape(state[name])
        if held != shape and not (name == "signs" and "sentinels" not in ctx and held[:1] == (rows,) and len(held) == 2):
            return name, f"has shape {held}; expected {shape}: {why} ({state['n']} steps seen, {lags} lags)"
    return None


# The noise-correlation test's state (`load_state_dict` reads a state CORRELATION.check passed).
CORRELATION = Section(
    "correlation",
    Field("lags", "int", low=1),
    Field("n", "int", low=0),
    Field("signs", "array", dtype="real", low=-1.0, high=1.0),
    Field("labels", "array", dtype="int", low=0),
    Field("sums", "array", dtype="real"),
    Field("first", "list", null=True, items=Field("step", "int"),
          rule=lambda v, ctx: None if len(v) == 3 else f"is {list(v)!r}; expected (step, earlier step, lag)"),
    rules=(_window_shapes,),
)


class NoiseCorrelation:
    """Per-lag running sums of sign products with the last `lags` steps; reports the first lag that crosses."""

    def __init__(self, bits: int = 128, *, lags: int = 512, alpha: float = 0.0005):
        bits, lags = operator.index(bits), operator.index(lags)
        if bits < 1 or lags < 1:
            raise ValueError(f"bits and lags must be >= 1, got {bits} and {lags}")
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        self.bits, self.lags, self.alpha = bits, lags, float(alpha)
        self._root = np.float32(1.0 / math.sqrt(bits))
        self._t_desc = np.arange(lags, dtype=np.float64) + RHO  # T + RHO at index j, less (n + 1 - lags)
        self._log_term = 2.0 * math.log(lags / self.alpha)
        self.reset()

    def reset(self) -> None:
        """Forget every step: an empty window, zero sums, no crossing."""
        self._signs = np.zeros((self.lags, self.bits), dtype=np.float32)  # ring of signs / sqrt(n), row n % lags next
        self._labels = np.zeros(self.lags, dtype=np.int64)
        self._sums = np.zeros(self.lags)  # S(l), lags in descending order: index j holds l = lags - j
        self.n = 0  # steps recorded
        self.first: Optional[tuple] = None  # (step, earlier step, lag) of the first crossing

    @property
    def sums(self) -> np.ndarray:
        """S(l) for l = 1..lags."""
        return self._sums[::-1].copy()

    def pairs(self) -> np.ndarray:
        """T(l): pairs seen at each lag l = 1..lags."""
        return np.maximum(self.n - np.arange(1, self.lags + 1), 0)

    def signs(self, noise: np.ndarray) -> np.ndarray:
        """+-1 per sentinel, 0 where |noise| < QUIET (no noise there: rounding residues carry no fresh sign)."""
        noise = np.asarray(noise, dtype=np.float32)
        if noise.shape != (self.bits,):
            raise ValueError(f"expected noise of shape ({self.bits},), got {noise.shape}")
        return np.sign(noise) * (np.abs(noise) >= QUIET)

    def check(self, noise: np.ndarray, step: int) -> Optional[int]:
        """Record this step's noise; return the lag that crossed its boundary now, the first time, else None.

        The window oldest to newest is rows slot.. then ..slot - 1 of the ring: two
        matrix-vector products on views give every lag's product in descending lag order.
        """
        signs = self.signs(noise)
        slot, n, lags = self.n % self.lags, self.n, self.lags
        crossed = None
        if n >= lags:
            self._sums[: lags - slot] += self._signs[slot:] @ signs
            self._sums[lags - slot:] += self._signs[:slot] @ signs
        elif n:
            self._sums[lags - n:] += self._signs[:n] @ signs
        if n and self.first is None:
            crossed = self._crossing(min(n, lags))
        if crossed is not None:
            self.first = (operator.index(step), int(self._labels[(slot - crossed) % lags]), crossed)
        np.multiply(signs, self._root, out=self._signs[slot])
        self._labels[slot] = operator.index(step)
        self.n = n + 1
        return crossed

    def _crossing(self, seen: int) -> Optional[int]:
        """The smallest lag whose |S| reaches its boundary after this step, else None.

        T(l) + RHO = n + 1 - l + RHO; a screen without the log term (a lower boundary)
        skips the exact test on almost every step of a correct run.
        """
        s = self._sums[self.lags - seen:]
        t = self._t_desc[self.lags - seen:] + float(self.n + 1 - self.lags)  # T + RHO, lags descending
        s2 = s * s
        if not (s2 >= self._log_term * t).any():
            return None
        over = np.flatnonzero(s2 >= t * (self._log_term + np.log(t / RHO)))
        return None if not over.size else int(seen - over[-1])

    def evidence(self, confidence: float) -> Optional[Correlation]:
        """The crossed lag's correlation and its interval at `confidence` (every lag at once); None before a crossing."""
        if self.first is None:
            return None
        step, earlier, lag = self.first
        pairs = int(self.pairs()[lag - 1])
        scale = pairs * math.sqrt(self.bits)
        half = float(boundary(pairs, (1.0 - confidence) / self.lags)) / scale
        sign = float(self._sums[self.lags - lag]) / scale
        gauss = lambda c: math.sin(math.pi * min(max(c, -1.0), 1.0) / 2.0)  # noqa: E731
        return Correlation(lag, step, earlier, pairs, sign, gauss(sign), gauss(sign - half), gauss(sign + half), confidence)

    def memory_bytes(self) -> int:
        """Bytes held: the window's signs and labels and the per-lag sums, fixed for the run."""
        return self._signs.nbytes + self._labels.nbytes + self._sums.nbytes

    # ----------------------------------------------------------------- state

    def state_dict(self) -> dict:
        """The window (signs as int8, oldest first), its labels, the sums and the first crossing."""
        k = min(self.n, self.lags)
        order = (self.n - k + np.arange(k)) % self.lags
        return CORRELATION.dump({
            "lags": self.lags,
            "n": self.n,
            "signs": np.sign(self._signs[order]).astype(np.int8),
            "labels": self._labels[order].copy(),
            "sums": self.sums,
            "first": None if self.first is None else list(self.first),
        })

    def load_state_dict(self, state: dict) -> None:
        """Replace this object's history by a saved one of the same window and sentinels."""
        if int(state["lags"]) != self.lags:
            raise ValueError(f"state has {state['lags']} lags, this object {self.lags}")
        signs = np.asarray(state["signs"], dtype=np.float32).reshape(-1, self.bits)
        labels = np.asarray(state["labels"], dtype=np.int64)
        n, k = int(state["n"]), len(labels)
        if k != min(n, self.lags) or len(signs) != k or len(state["sums"]) != self.lags:
            raise ValueError(f"inconsistent window: {k} labels, {len(signs)} sign rows, {n} steps")
        self.reset()
        order = (n - k + np.arange(k)) % self.lags
        self._signs[order] = np.sign(signs) * self._root
        self._labels[order] = labels
        self._sums = np.asarray(state["sums"], dtype=np.float64)[::-1].copy()
        self.n = n
        first = state.get("first")
        self.first = None if first is None else tuple(int(v) for v in first)
