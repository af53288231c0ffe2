"""The anytime alarm when the claim changes during the run (noise and clipping schedules).

Every audited step claims its own mu (its noise multiplier; per tensor, its clipping
bounds). Steps are grouped into segments by claim: one AnytimeMonitor (monitor.py) per
segment, each testing its own observations against its own claim. Claims within 1% of
each other share a segment, whose claim is the largest among its steps: a step that
claims less leaks no more than the segment's claim allows, so its errors are at least
as frequent as the test assumes, and the test stays valid.

Error budget: the segment the run starts in keeps FIRST_SHARE of alpha = 1 - confidence
(with the noise-repeat reserve); the k-th later segment gets
(1 - FIRST_SHARE) alpha 6 / (pi^2 k^2), which sums to the rest over any number of
segments. A correct run therefore raises any alarm with probability <= alpha, however
often and however far its claim changes. A run whose claim never changes is tested as
before with FIRST_SHARE of the budget.
"""

from __future__ import annotations

import math
from typing import Dict, List

import numpy as np

from .monitor import MONITOR, POOLED, AnytimeMonitor, _groups
from .schema import Field, Section

FIRST_SHARE = 0.95
SEGMENT_WIDTH = 0.01  # claims within 1% (in log) share a segment


CLAIMS = Field("claims", "map", rule=_groups, items=Field("claim", "real", low=1e-300))  # claimed mu per group, > 0


def _has_pooled(claims, ctx):
    return None if POOLED in claims else f"has no pooled claim (group {POOLED})"


# A later segment: its claims, then its monitor's state.
SEGMENT = Section("segment", Field("claims", "map", rule=lambda v, c: _groups(v, c) or _has_pooled(v, c),
                                   items=CLAIMS.items), *MONITOR.fields)


def _key_of(claims: dict) -> tuple:
    claims = {int(g): float(c) for g, c in claims.items()}
    pooled = claims.pop(POOLED)
    return claim_key(claims, pooled)


def _opening_claims(state, ctx):
    """The first segment's claims are the set-up's (ctx["claims"], what the auditor starts with), or within
    their 1% segment and above them (a claim of the same segment raised by a later step)."""
    opening, saved = ctx.get("claims"), state.get("claims")
    if opening is None or saved is None:
        return None
    for group, claim in saved.items():
        start = opening.get(int(group))
        if start is None:
            return "claims", f"has group {group}, which this set-up does not have"
        if claim < start * (1 - 1e-9) or claim_key({}, claim) != claim_key({}, start):
            return (f"claims[{group}]", f"is {claim!r}; the set-up claims mu = {start!r} (its noise multiplier and "
                    "clipping bounds): a claim saved by another set-up or altered")
    return None


def _distinct_segments(state, ctx):
    """Segments hold different claims (open() merges equal ones), and `current` is one of them."""
    later = state.get("segments", [])
    keys = [_key_of(s["claims"]) for s in later]
    if state.get("claims") is not None and POOLED in state["claims"]:
        keys.insert(0, _key_of(state["claims"]))
    if len(set(keys)) != len(keys):
        return "segments", "holds two segments of the same claims; segments are saved once per claim"
    current = state.get("current", 0)
    if not current <= len(later):
        return "current", f"is {current}, but the state has {len(later) + 1} segments"
    return None


# Later segments a state may hold. Segments hold distinct claims at least 1% apart in some group (claim_key), and
# a schedule that moves back returns to its earlier segments: 4,096 segments of one group's claim span a factor
# 1.01^4096 = 5e17 in its noise multiplier or clipping bound, far beyond any schedule that trains. Each segment's
# monitor is also tested at every check, so a run with that many would spend its time there.
MAX_SEGMENTS = 4096

# The whole monitor: the first segment's state at the top level (as an unsegmented monitor saves it), later ones in a
# list. An audit state of format 2 holds every field (since=2); a 0.1.0 state has the first segment's alone.
SEGMENTED = Section(
    "monitor", *MONITOR.fields, Field("claims", "map", rule=CLAIMS.rule, items=CLAIMS.items, optional=True, since=2),
    Field("segments", "list", items=SEGMENT, optional=True, since=2, most=MAX_SEGMENTS),
    Field("current", "int", low=0, optional=True, since=2),
    rules=(_opening_claims, _distinct_segments),
)


def later_share(k: int) -> float:
    """The share of alpha of the k-th segment after the first (k >= 1)."""
    return (1.0 - FIRST_SHARE) * 6.0 / (math.pi**2 * k**2)


def claim_key(layer_claims: Dict[int, float], pooled_claim: float) -> tuple:
    """Claims rounded to their segment (bins of SEGMENT_WIDTH in log)."""
    values = [pooled_claim, *(layer_claims[g] for g in sorted(layer_claims))]
    return tuple(int(math.floor(math.log(v) / math.log1p(SEGMENT_WIDTH))) for v in values)


class SegmentedMonitor:
    """AnytimeMonitors, one per claim segment, seen as one: counts add up, alarms merge, the current claims show."""

    def __init__(self, layer_claims: Dict[int, float], pooled_claim: float, *, confidence: float, reserved: float = 0.0):
        self.confidence, self.reserved = confidence, reserved
        self.segments: List[AnytimeMonitor] = []
        self.keys: Dict[tuple, int] = {}
        self._reported: set = set()  # groups whose alarm check() has returned
        self.opening = {POOLED: float(pooled_claim), **{int(g): float(c) for g, c in layer_claims.items()}}
        self.current = self.open(layer_claims, pooled_claim)

    def open(self, layer_claims: Dict[int, float], pooled_claim: float) -> int:
        """The segment of these claims (a new one when no segment holds them); it becomes the current one."""
        key = claim_key(layer_claims, pooled_claim)
        if key in self.keys:
            segment = self.segments[self.keys[key]]
            for group, claim in {POOLED: pooled_claim, **layer_claims}.items():
                segment.claims[group] = max(segment.claims[group], float(claim))
        else:
            k = len(self.segments)
            share = FIRST_SHARE if k == 0 else later_share(k)
            alpha = (1.0 - self.confidence) * share
            self.segments.append(AnytimeMonitor(
                {g: float(c) for g, c in layer_claims.items()}, float(pooled_claim), confidence=1.0 - alpha,
                reserved=self.reserved if k == 0 else 0.0,
            ))
            self.keys[key] = k
        self.current = self.keys[key]
        return self.current

    # ---------------------------------------------------------------- what the engine calls

    def advance(self, steps: np.ndarray, layers: np.ndarray, is_in: np.ndarray, values: np.ndarray,
                segments: np.ndarray) -> None:
        """AnytimeMonitor.advance, each run of observations to its segment's monitor (steps in order)."""
        segments = np.asarray(segments)
        if segments.size == 0:
            return
        starts = np.concatenate([[0], np.flatnonzero(np.diff(segments)) + 1, [segments.size]])
        for a, b in zip(starts[:-1], starts[1:]):
            self.segments[int(segments[a])].advance(steps[a:b], layers[a:b], is_in[a:b], values[a:b])

    def check(self, step: int) -> List[int]:
        """Groups whose alarm fires for the first time, in any segment."""
        fired = []
        for segment in self.segments:
            fired += [g for g in segment.check(step) if g not in self._reported and g not in fired]
        self._reported.update(fired)
        return fired

    def flag(self, group: int, step: int) -> None:
        """A violation found outside the canaries (noise repeats, set-up): the first segment holds its budget."""
        self.segments[0].flag(group, step)

    # ---------------------------------------------------------------- what results read

    @property
    def claims(self) -> Dict[int, float]:
        """The current segment's claimed mu per group."""
        return self.segments[self.current].claims

    @property
    def first_violation(self) -> Dict[int, int]:
        out: Dict[int, int] = {}
        for segment in self.segments:
            for group, step in segment.first_violation.items():
                out[group] = min(step, out.get(group, step))
        return out

    @property
    def bounds(self) -> Dict[int, float]:
        """Anytime mu lower bounds in the current claim's units: current claim x the largest certified ratio."""
        out = {}
        for group, claim in self.claims.items():
            ratios = [s.bounds[group] / s.claims[group] for s in self.segments if group in s.bounds]
            out[group] = claim * max(ratios, default=0.0)
        return out

    def group_counts(self) -> Dict[int, np.ndarray]:
        """(tp, fn, fp, tn) per group over every segment."""
        total: Dict[int, np.ndarray] = {}
        for segment in self.segments:
            for group, counts in segment.group_counts().items():
                total[group] = total.get(group, 0) + counts
        return total

    def segment_counts(self) -> List[tuple]:
        """(claims, counts) of every segment: what the ratio bound of changing claims reads."""
        return [(s.claims, s.group_counts()) for s in self.segments]

    def refresh_bounds(self) -> Dict[int, float]:
        for segment in self.segments:
            segment.refresh_bounds()
        return self.bounds

    # ---------------------------------------------------------------- saved state

    def state_dict(self) -> dict:
        """The first segment's state at the top level (as an unsegmented monitor saves it), later ones in a list."""
        later = [SEGMENT.dump({"claims": {int(g): float(c) for g, c in s.claims.items()}, **s.state_dict()})
                 for s in self.segments[1:]]
        first_claims = {int(g): float(c) for g, c in self.segments[0].claims.items()}
        return SEGMENTED.dump({**self.segments[0].state_dict(), "claims": first_claims, "segments": later,
                               "current": self.current})

    def load_state_dict(self, state: dict) -> None:
        """A state SEGMENTED.check passed (with ctx["claims"] = this monitor's `opening`)."""
        first = self.segments[0]
        del self.segments[1:]
        self.keys = {key: i for key, i in self.keys.items() if i == 0}
        first.load_state_dict(state)
        for group, claim in state.get("claims", {}).items():
            first.claims[int(group)] = float(claim)
        for saved in state.get("segments", []):
            claims = {int(g): float(c) for g, c in saved["claims"].items()}
            pooled = claims.pop(POOLED)
            self.segments[self.open(claims, pooled)].load_state_dict(saved)
        current = int(state.get("current", 0))
        if not 0 <= current < len(self.segments):
            raise ValueError(f"current segment {current} of {len(self.segments)}")
        self.current = current
        self._reported = set(self.first_violation)
