"""Online violation alarm with a false-alarm rate that holds under checking at every step.

The monitor counts, for the pooled observations and for each parameter tensor, the
outcomes of the fixed threshold attack (in when value >= 0.5). At each check it computes
an anytime-valid lower bound on mu (estimators.sequential) for every group and raises
the alarm for a group the first time the bound exceeds that group's claimed mu.

Error budget: alpha = 1 - confidence, split Bonferroni-style: half for the pooled test,
half shared equally by the per-tensor tests (all of it to the pooled test when there is
one tensor). A `reserved` part of the pooled half goes to tests run outside the monitor
(the noise-repeat and noise-correlation tests), which report through `flag`. With each group's confidence
sequence valid uniformly over time, a correct implementation raises any alarm with
probability <= alpha over the whole run.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np
from scipy.special import ndtri

from ..estimators.bounds import DEFAULT_THRESHOLD as THRESHOLD  # the estimators' fixed threshold
from ..estimators.sequential import anytime_mu_lower
from .schema import Field, Section, is_int, is_whole

POOLED = -1
REPEATS = -2  # the noise-repeat test (NoiseFingerprints), flagged by the auditor
CORRELATED = -4  # the noise-correlation test (NoiseCorrelation), flagged by the record
SETUP = -3  # set-up problems found with certainty outside the canaries (distributed.py), flagged by the auditor
SPECIAL_GROUPS = (POOLED, REPEATS, SETUP, CORRELATED)


def _groups(value, ctx) -> "str | None":
    """Keys are groups: the special ones, or a tensor (observation group) below ctx["groups"]."""
    groups = ctx.get("groups")
    for key in value:
        if not is_int(key) or (key < 0 and key not in SPECIAL_GROUPS) or (groups is not None and key >= groups):
            within = f"0 to {groups - 1}" if groups is not None else "0 and up"
            return f"has group {key!r}; groups are {', '.join(map(str, SPECIAL_GROUPS))} and the tensors {within}"
    return None


def _count_row(row, ctx) -> "str | None":
    values = np.asarray(row, dtype=object).ravel().tolist() if np.ndim(row) else [row]
    if np.shape(row) != (4,) or not all(is_whole(v) and v >= 0 for v in values):
        return f"are {values}; counts are 4 whole numbers >= 0"
    return None


# One claim segment's monitor (claim_segments.py keeps the first one's at the top level of its state).
MONITOR = Section(
    "monitor",
    Field("counts", "map", rule=_groups, items=Field("row", "any", rule=_count_row), label="{parent} counts for group {key}"),
    Field("bounds", "map", rule=_groups, items=Field("bound", "real", low=0.0, finite="no-nan")),
    Field("first_violation", "map", rule=_groups, items=Field("step", "int", low=0)),
)


class AnytimeMonitor:
    def __init__(self, claimed_mu: Dict[int, float], pooled_claim: float, *, confidence: float, reserved: float = 0.0):
        self.confidence = confidence
        alpha = 1.0 - confidence
        if not 0.0 <= reserved < alpha / 2:
            raise ValueError(f"Unexpected value for `reserved`: {reserved}; it must lie in [0, {alpha / 2})")
        layers = sorted(claimed_mu)
        self.claims = {POOLED: pooled_claim, **claimed_mu}
        if len(layers) <= 1:
            self.alpha = {POOLED: alpha - reserved}
        else:
            self.alpha = {POOLED: alpha / 2 - reserved, **{l: alpha / (2 * len(layers)) for l in layers}}
        self.num_layers = len(layers)
        self.counts = {g: np.zeros(4, dtype=np.int64) for g in self.alpha}  # tp, fn, fp, tn
        self.bounds = {g: 0.0 for g in self.alpha}
        self._bounded: Dict[int, tuple] = {}  # group -> (counts, claim) its bound was last computed from
        self.first_violation: Dict[int, int] = {}
        self._flagged: List[int] = []  # flagged since the last check

    def update(self, layers: Sequence[int], is_in: np.ndarray, values: np.ndarray) -> None:
        said_in = np.asarray(values) >= THRESHOLD
        is_in = np.asarray(is_in, dtype=bool)
        outcome = np.where(is_in, np.where(said_in, 0, 1), np.where(said_in, 2, 3))  # tp, fn, fp, tn
        per_layer = np.bincount(np.asarray(layers) * 4 + outcome, minlength=4 * self.num_layers).reshape(-1, 4)
        self.counts[POOLED] += per_layer.sum(axis=0)
        for layer in range(self.num_layers):
            if layer in self.counts:
                self.counts[layer] += per_layer[layer]

    def advance(self, steps: np.ndarray, layers: np.ndarray, is_in: np.ndarray, values: np.ndarray) -> None:
        """Add the observations of consecutive steps and test the counts after each of them.

        steps: the step number (from 1) of each observation, non-decreasing. A group whose
        anytime bound exceeds its claim after step t is recorded as violated at t, exactly
        as a check after every step would record it; `check` reports it. The screen runs
        on every step's cumulative counts at once, the exact bound only where it passes.
        """
        steps = np.asarray(steps, dtype=np.int64)
        if steps.size == 0:
            return
        ends = np.flatnonzero(np.diff(steps)) + 1  # first observation of each later step
        labels = steps[np.concatenate([[0], ends])]
        row = np.zeros(steps.size, dtype=np.int64)
        row[ends] = 1
        row = np.cumsum(row)
        said_in = np.asarray(values) >= THRESHOLD
        is_in = np.asarray(is_in, dtype=bool)
        outcome = np.where(is_in, np.where(said_in, 0, 1), np.where(said_in, 2, 3))
        width = 4 * self.num_layers
        per_step = np.bincount(row * width + np.asarray(layers) * 4 + outcome, minlength=len(labels) * width)
        per_step = per_step.reshape(len(labels), self.num_layers, 4)
        groups = [POOLED, *(g for g in self.counts if g >= 0)]
        added = np.concatenate([per_step.sum(axis=1)[None], per_step.transpose(1, 0, 2)[groups[1:]]])
        # (groups, steps, 4): each group's counts after each step
        cumulative = np.stack([self.counts[g] for g in groups])[:, None, :] + np.cumsum(added, axis=1)
        alphas = np.repeat([self.alpha[g] for g in groups], len(labels))
        screen = _screen_mu(cumulative.reshape(-1, 4).astype(float), alphas).reshape(len(groups), len(labels))
        over = screen > np.array([self.claims[g] for g in groups])[:, None]  # the steps the screen passes
        passed = over.any(axis=1)
        for gi, group in enumerate(groups):
            self.counts[group] = cumulative[gi, -1].copy()
            if group in self.first_violation or not passed[gi]:
                continue
            claim = self.claims[group]
            for t in np.flatnonzero(over[gi]):
                tp, fn, fp, tn = cumulative[gi, t]
                if min(tp + fn, fp + tn) == 0:
                    continue
                bound = anytime_mu_lower(tp, fn, fp, tn, alpha=self.alpha[group], mu_anticipated=claim)
                if bound > claim:
                    self.bounds[group] = bound
                    self._bounded.pop(group, None)  # a bound at step t, not of the counts after the last step
                    self.first_violation[group] = int(labels[t])
                    self._flagged.append(group)
                    break

    def check(self, step: int) -> List[int]:
        """Groups whose alarm fires at this check for the first time."""
        fired, self._flagged = self._flagged, []
        groups = list(self.counts)
        screen = _screen_mu(np.array([self.counts[g] for g in groups], dtype=float), np.array([self.alpha[g] for g in groups]))
        for group, upper in zip(groups, screen):
            tp, fn, fp, tn = self.counts[group]
            if group in self.first_violation or min(tp + fn, fp + tn) == 0:
                continue
            claim = self.claims[group]
            if upper <= claim:  # the anytime bound is below this screen, hence below the claim
                continue
            if self._refresh(group) > claim:
                self.first_violation[group] = step
                fired.append(group)
        return fired

    def flag(self, group: int, step: int) -> None:
        """Record a violation found by a test outside the monitor (its alpha is `reserved`)."""
        if group not in self.first_violation:
            self.first_violation[group] = step
            self._flagged.append(group)

    def group_counts(self) -> Dict[int, np.ndarray]:
        """(tp, fn, fp, tn) at threshold 0.5 for the pool and for every tensor."""
        counts = {g: c.copy() for g, c in self.counts.items()}
        if self.num_layers == 1:
            counts[0] = counts[POOLED].copy()
        return counts

    def refresh_bounds(self) -> Dict[int, float]:
        """Anytime-valid mu lower bound of every group, now."""
        for group, (tp, fn, fp, tn) in self.counts.items():
            if min(tp + fn, fp + tn) > 0:
                self._refresh(group)
        return dict(self.bounds)

    def _refresh(self, group: int) -> float:
        """Recompute and store one group's anytime-valid mu lower bound (kept while its counts and claim stay)."""
        tp, fn, fp, tn = self.counts[group]
        basis = (int(tp), int(fn), int(fp), int(tn), self.claims[group])
        if self._bounded.get(group) != basis:
            self.bounds[group] = anytime_mu_lower(tp, fn, fp, tn, alpha=self.alpha[group],
                                                  mu_anticipated=self.claims[group])
            self._bounded[group] = basis
        return self.bounds[group]

    def state_dict(self) -> dict:
        return MONITOR.dump({
            "counts": {int(g): c.tolist() for g, c in self.counts.items()},
            "bounds": {int(g): float(b) for g, b in self.bounds.items()},
            "first_violation": {int(g): int(s) for g, s in self.first_violation.items()},
        })

    def load_state_dict(self, state: dict) -> None:
        """A state MONITOR.check passed (the auditor checks the whole state before loading any part)."""
        for g, c in state.get("counts", {}).items():
            self.counts[int(g)] = np.asarray(c, dtype=np.int64)
        self.bounds.update({int(g): float(b) for g, b in state.get("bounds", {}).items()})
        self._bounded = {}
        self.first_violation = {int(g): int(s) for g, s in state.get("first_violation", {}).items()}


def _screen_mu(counts: np.ndarray, alphas: np.ndarray) -> np.ndarray:
    """Cheap upper bound on every group's anytime mu bound, to skip hopeless checks.

    The beta-binomial mixture never exceeds the maximum likelihood ratio L(p_hat)/L(p),
    and KL(p_hat || p) <= (p - p_hat)^2 / (p (1 - p)), so every p with
    n (p - p_hat)^2 < log(1/alpha) p (1 - p) lies inside the confidence sequence. The
    largest such p is Wilson's upper bound with z^2 = log(1/alpha); Eq. 12 on those
    bounds is therefore >= the anytime bound, and a group at or below its claim here
    cannot be in violation.
    """
    tp, fn, fp, tn = counts.T
    z2 = np.log(2.0 / alphas)  # each rate gets alpha / 2

    def wilson_upper(k, n):
        n = np.maximum(n, 1)
        p = k / n
        return (2 * n * p + z2 + np.sqrt(4 * n * p * (1 - p) * z2 + z2**2)) / (2 * (n + z2))

    with np.errstate(divide="ignore", invalid="ignore"):
        mu = -ndtri(np.minimum(wilson_upper(fp, fp + tn), 1.0)) - ndtri(np.minimum(wilson_upper(fn, tp + fn), 1.0))
    return np.where(np.isnan(mu), np.inf, mu)
