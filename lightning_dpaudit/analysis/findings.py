"""Findings: which part of DP-SGD a violation comes from, from the audit's sufficient statistics.

numpy/scipy only. Units: for gradient canaries in tensor l with claimed per-step mu_l
(1 / sigma for flat clipping, C_l / (sigma C) for per-layer clipping), an
out-observation of a correct step is N(0, 1 / mu_l^2) and an in-observation
N(1, 1 / mu_l^2): the noise added is sigma * C, and a canary planted with norm
canary_scale * C_l leaves clipping with norm C_l. Scaled by mu_l, z = mu_l * out is
N(0, 1). From the running count, sum and sum of squares per (tensor, in/out):

noise_scale  r = sd(z), the noise actually added in units of the claimed sigma * C.
             With n out-observations, (n - 1) sd^2 / r^2 ~ chi2(n - 1), so
             r is in [sd sqrt((n-1) / chi2_{1-a/2}), sd sqrt((n-1) / chi2_{a/2})].
             Evidence: the upper end is below 1.
clipping     d = mean(in) - mean(out) in units of the clipping bound: exactly what a
             clipped canary adds, 1, for a correct optimizer. Welch's t interval
             d -+ t_{1-a/2, df} sqrt(v_in / n_in + v_out / n_out). Evidence: the lower
             end is above 1 (+ 1e-3 for float rounding of the clip factor).
layer        the same two tests on each tensor: the tensors with evidence are named when
             the other tensors, pooled, show none at the same level and their interval
             lies apart from the named tensors' (no overlap); a tensor whose own
             alarm fired while neither test nor a noise repeat explains it and the
             others raised none is named too.
noise_repeats the fingerprint test found a step whose noise repeats an earlier one, or
             its negation (its own false-match budget, 1e-6 over the run).
noise_correlated the correlation test found a lag within the last 512 steps at which the
             noise is correlated (freshness_findings.py; its budget, 1% of alpha). The
             interval tests below assume noise independent across steps: with this
             finding they are not run.
general      a violation none of these explains.

Error budget: the m interval tests (pooled noise and clipping, and per tensor when there
are several) share alpha = 1 - confidence, a = alpha / m each (Bonferroni), so a correct
implementation shows any noise_scale, clipping or layer evidence with probability at
most alpha; findings are computed only after the alarm fired, which a correct run does
with probability at most alpha as well. When the violation comes from another check's
certain finding alone (the canaries' alarm did not fire), the intervals are tested at
UNALARMED_SHARE of that budget: on a correct optimizer they then name a cause with
probability at most UNALARMED_SHARE * alpha, while a blatant bug (clipping left out) is
still named beside the certain finding. The intervals quoted hold together at the
audit's confidence. Input canaries' observations have canary-dependent scales and
in-means below 1, so only noise_repeats and general apply to them. Findings of other
checks (`extra`) come first and are kept whatever the verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
from scipy.special import chdtri, stdtrit  # chi-square upper quantile, Student t quantile

from .freshness_findings import correlated
from .monitor import POOLED
from .noise_correlation import Correlation
from .results import Finding

CODES = ("noise_scale", "clipping", "noise_repeats", "noise_correlated", "layer", "general")
ROUNDING = 1e-3  # float32 clip factors C / (norm + 1e-6) and sums: a clipped canary adds 1 within this
SLACK = 1.05  # a hinted ratio may lie this factor outside the interval
NAMED = 4  # tensors listed by name in a message
UNALARMED_SHARE = 0.01  # of the error budget, for the intervals after a violation the canaries did not alarm


@dataclass(frozen=True)
class Evidence:
    """The auditor's numpy state that findings are read from.

    moments     (tensors, 2, 3): [tensor, is_in] -> (count, sum, sum of squares)
    claims      (tensors,) claimed per-step mu of each tensor's canaries
    names       tensor names; alarms / mu_anytime: monitor group -> first alarm step /
                anytime mu lower bound (tensor index, POOLED, or the repeat test)
    gradient    True for gradient canaries (every code applies), False for input canaries
    """

    moments: np.ndarray
    claims: np.ndarray
    names: Tuple[str, ...]
    confidence: float
    noise_multiplier: float
    mu_claimed: float
    gradient: bool = True
    alarms: Dict[int, int] = field(default_factory=dict)
    mu_anytime: Dict[int, float] = field(default_factory=dict)
    first_repeat: Optional[Tuple[int, int]] = None
    repeats: int = 0
    first_negated: bool = False  # the first repeat is of the negated noise
    correlation: Optional[Correlation] = None  # the correlation test's crossed lag (noise_correlation.py)
    batch_size: Optional[int] = None
    canary_scale: float = 2.0


@dataclass(frozen=True)
class _Interval:
    value: float
    low: float
    high: float

    def text(self, confidence: float, unit: str) -> str:
        return f"{self.value:.3g}{unit} ({confidence:.0%} CI {self.low:.3g}-{self.high:.3g})"


def diagnose(ev: Evidence, *, violation: bool, first_violation_step: Optional[int] = None, extra: Sequence[Finding] = (),
             canaries_alarmed: bool = True):
    """Findings for a result: `extra` (other checks' findings) first, then, if `violation`, this module's codes.
    The noise and clipping intervals have the whole error budget after the canaries' own alarm fired
    (`canaries_alarmed`), UNALARMED_SHARE of it after a violation another check's certain finding set alone."""
    found = list(extra)
    if not violation:
        return tuple(found)
    own = []
    if ev.first_repeat is not None:
        own.append(_repeats(ev))
    if ev.correlation is not None:
        own.append(correlated(ev.correlation))
    if ev.gradient and ev.correlation is None:  # the intervals assume noise independent across steps
        own += _moment_findings(ev, first_violation_step, 1.0 if canaries_alarmed else UNALARMED_SHARE)
    if not own and not found:
        own.append(_general(ev, first_violation_step))
    return tuple(found + own)


# ---------------------------------------------------------------------- statistics


def noise_interval(moments: np.ndarray, claims: np.ndarray, a: float) -> Optional[_Interval]:
    """Std of mu_l * out over the given tensors, with its chi-square interval at level 1 - a; None under 2 values."""
    n, s, q = _scaled(moments[:, 0], claims)
    if n < 2:
        return None
    sd = math.sqrt(max(q - s * s / n, 0.0) / (n - 1))
    return _Interval(sd, sd * math.sqrt((n - 1) / chdtri(n - 1, a / 2)), sd * math.sqrt((n - 1) / chdtri(n - 1, 1 - a / 2)))


def shift_interval(moments: np.ndarray, a: float) -> Optional[_Interval]:
    """mean(in) - mean(out) over the given tensors, with Welch's t interval at level 1 - a; None under 2 values a side."""
    sides = []
    for side in (1, 0):
        n, s, q = moments[:, side].sum(axis=0)
        if n < 2:
            return None
        sides.append((float(n), float(s / n), max(float(q - s * s / n), 0.0) / (n - 1)))
    (n1, m1, v1), (n0, m0, v0) = sides
    se2 = v1 / n1 + v0 / n0
    d = m1 - m0
    if se2 == 0:
        return _Interval(d, d, d)
    df = se2**2 / ((v1 / n1) ** 2 / (n1 - 1) + (v0 / n0) ** 2 / (n0 - 1))
    half = stdtrit(df, 1 - a / 2) * math.sqrt(se2)
    return _Interval(d, d - half, d + half)


def _scaled(side: np.ndarray, claims: np.ndarray):
    """(count, sum, sum of squares) of mu_l * value over tensors, from per-tensor (count, sum, sum of squares)."""
    mu = np.asarray(claims, dtype=float)
    return float(side[:, 0].sum()), float((mu * side[:, 1]).sum()), float((mu**2 * side[:, 2]).sum())


def _low(iv: Optional[_Interval]) -> bool:
    return iv is not None and iv.high < 1.0


def _high(iv: Optional[_Interval]) -> bool:
    return iv is not None and iv.low > 1.0 + ROUNDING


# ---------------------------------------------------------------------- codes


def _moment_findings(ev: Evidence, first_violation_step, share: float = 1.0):
    """noise_scale, clipping and layer findings from the per-tensor moments (see the module doc), the tests sharing
    `share` of the audit's error budget."""
    m, claims = np.asarray(ev.moments, dtype=float), np.asarray(ev.claims, dtype=float)
    tensors = len(ev.names)
    a = share * (1.0 - ev.confidence) / (2 + (2 * tensors if tensors > 1 else 0))
    everything = list(range(tensors))
    noise = (lambda ts: noise_interval(m[ts], claims[ts], a), _low, lambda named, others: others.low > named.high)
    shift = (lambda ts: shift_interval(m[ts], a), _high, lambda named, others: others.high < named.low)
    tests = ((*noise, _noise_layer, _noise_scale), (*shift, _clipping_layer, _clipping))
    found, explained = [], set()
    for interval, shows, apart, layer_finding, model_finding in tests:  # apart: the named and the others differ
        confined = _confined(interval, shows, apart, tensors) if tensors > 1 else None
        if confined is not None:
            named, per_tensor, joint, others = confined
            found.append(layer_finding(ev, named, per_tensor, others, joint, _first(ev, named, first_violation_step)))
            explained.update(named)
        elif shows(pooled := interval(everything)):
            found.append(model_finding(ev, pooled, first_violation_step))
            explained.update(everything)
    alarmed = [l for l in everything if l in ev.alarms]
    if tensors > 1 and alarmed and not explained and len(alarmed) < tensors and ev.first_repeat is None:
        found.append(_alarm_layer(ev, alarmed))
    return found


def _confined(interval, shows, apart, tensors: int):
    """(named tensors, every tensor's interval, the named ones' pooled interval, the others' pooled interval).

    The named tensors are those showing the evidence; the finding is confined to them when
    the other tensors, pooled, show none and their interval lies apart from the named
    tensors' pooled one (a global fault seen in some tensors only is not confined). None
    otherwise.
    """
    per_tensor = [interval([l]) for l in range(tensors)]
    named = [l for l in range(tensors) if shows(per_tensor[l])]
    rest = [l for l in range(tensors) if l not in named]
    if not named or not rest:
        return None
    joint, others = interval(named), interval(rest)
    if others is None or shows(others) or not apart(joint, others):
        return None
    return named, per_tensor, joint, others


def _first(ev: Evidence, tensors, fallback):
    steps = [ev.alarms[l] for l in tensors if l in ev.alarms]
    return min(steps) if steps else fallback


def _listed(ev: Evidence, tensors, describe) -> str:
    parts = [f"{ev.names[l]} {describe(l)}" for l in tensors[:NAMED]]
    more = len(tensors) - NAMED
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _noise_scale(ev: Evidence, iv: _Interval, first_step) -> Finding:
    hint = noise_hint(iv, ev.noise_multiplier, ev.batch_size)
    return Finding(
        code="noise_scale",
        message=f"noise std {iv.text(ev.confidence, ' x claimed')}: {hint}",
        first_step=first_step,
        measured=iv.value,
        claimed=1.0,
    )


def noise_hint(iv: _Interval, sigma: float, batch_size: Optional[int]) -> str:
    """The likely cause of noise at `iv` times the claim: the nearest typical ratio inside the interval, if any."""
    if iv.high < ROUNDING:
        return "no noise reaches the release"
    candidates = [(0.5, f"half the claimed noise (noise multiplier {sigma / 2:.3g} applied, {sigma:.3g} claimed?)")]
    if batch_size:
        candidates.append(
            (1.0 / batch_size, f"about 1/{batch_size}, one over the expected batch size: calibrated to C/B, the batch "
             "mean's sensitivity, instead of C?")
        )
    if sigma > 1.0 / 0.9:
        candidates.append((1.0 / sigma, "noise std C: the noise multiplier left out?"))
    if sigma < 0.9:
        candidates.append((sigma, "noise std sigma^2 C: the variance used as the std?"))
    inside = [(v, h) for v, h in candidates if iv.low / SLACK <= v <= iv.high * SLACK]
    if inside:
        return min(inside, key=lambda c: abs(math.log(c[0] / iv.value)) if iv.value > 0 else 0.0)[1]
    return f"noise multiplier about {iv.value * sigma:.3g} applied, {sigma:.3g} claimed"


def _clipping(ev: Evidence, iv: _Interval, first_step) -> Finding:
    return Finding(
        code="clipping",
        message=(
            f"in-canaries move the release by {iv.text(ev.confidence, ' C')}, a clipped one by 1 C: the canary norm "
            f"above C ({ev.canary_scale:g} C planted) reaches the update: per-example clipping missing, applied to "
            "the batch, or applied after the noise"
        ),
        first_step=first_step,
        measured=iv.value,
        claimed=1.0,
    )


def _noise_layer(ev, low, noise, others: _Interval, joint: _Interval, first_step) -> Finding:
    listed = _listed(ev, low, lambda l: noise[l].text(ev.confidence, " x claimed"))
    return Finding(
        code="layer",
        message=(
            f"noise std below the claim in {len(low)} of {len(ev.names)} tensors: {listed}; the other "
            f"{len(ev.names) - len(low)} agree with the claim ({others.value:.3g} x): noise missing or scaled down there"
        ),
        first_step=first_step,
        layers=tuple(ev.names[l] for l in low),
        measured=joint.value,
        claimed=1.0,
    )


def _clipping_layer(ev, high, shift, others: _Interval, joint: _Interval, first_step) -> Finding:
    listed = _listed(ev, high, lambda l: shift[l].text(ev.confidence, " C"))
    return Finding(
        code="layer",
        message=(
            f"in-canaries move the release by more than C in {len(high)} of {len(ev.names)} tensors: {listed}; the "
            f"other {len(ev.names) - len(high)} clip ({others.value:.3g} C): clipping missing or wrong there"
        ),
        first_step=first_step,
        layers=tuple(ev.names[l] for l in high),
        measured=joint.value,
        claimed=1.0,
    )


def _alarm_layer(ev: Evidence, alarmed) -> Finding:
    worst = max(alarmed, key=lambda l: ev.mu_anytime.get(l, 0.0) / ev.claims[l])
    listed = _listed(ev, alarmed, lambda l: f"mu >= {ev.mu_anytime.get(l, math.nan):.3f} vs {ev.claims[l]:.3f}")
    return Finding(
        code="layer",
        message=(
            f"the alarm fired only in {listed}; the other tensors stay within their claims, and noise and "
            "clipping match the claim: a leak of another kind confined there"
        ),
        first_step=_first(ev, alarmed, None),
        layers=tuple(ev.names[l] for l in alarmed),
        measured=float(ev.mu_anytime.get(worst, math.nan)),
        claimed=float(ev.claims[worst]),
    )


def _repeats(ev: Evidence) -> Finding:
    step, earlier = ev.first_repeat
    what = "the negation of " if ev.first_negated else ""
    return Finding(
        code="noise_repeats",
        message=(
            f"the noise of step {step} repeats {what}step {earlier}'s ({ev.repeats} repeating step{'s' * (ev.repeats != 1)}): "
            + ("the noise is negated and added again (antithetic noise: the two releases' sum carries no noise), or "
               if ev.first_negated else "")
            + "the noise generator is re-seeded (on resume, or in a hook such as an epoch hook) or seeded alike every "
            "step; fix: secure_mode=True in PrivacyEngine, or give make_private its own noise_generator and save and "
            "restore that generator's state with the checkpoint"
        ),
        first_step=int(step),
        measured=float(ev.repeats),
        claimed=0.0,
    )


def _general(ev: Evidence, first_step) -> Finding:
    claims = {POOLED: ev.mu_claimed, **{l: float(c) for l, c in enumerate(ev.claims)}}
    fired = [g for g in ev.alarms if g in claims] or [POOLED]
    worst = max(fired, key=lambda g: ev.mu_anytime.get(g, 0.0) / claims[g])
    mu, where = float(ev.mu_anytime.get(worst, math.nan)), "the pool" if worst == POOLED else ev.names[worst]
    why = (
        "noise scale, clipping, noise freshness and single tensors all match the claim"
        if ev.gradient
        else "input canaries test noise freshness only: audit with gradient canaries (canary='dirac') to tell noise "
        "scale, clipping and layers apart"
    )
    return Finding(
        code="general",
        message=f"per-step mu >= {mu:.3f} (anytime) exceeds the claimed {claims[worst]:.3f} in {where}; {why}",
        first_step=first_step,
        layers=() if worst == POOLED else (ev.names[worst],),
        measured=mu,
        claimed=float(claims[worst]),
    )
