"""What an audit has seen: observations, the anytime monitor, noise freshness and set-up problems.

Host-side and torch-free. The engine hands over the readings of the steps since the last
check (`StepReading`, one per noised step) and asks, at each check, which alarms fired.
The monitor tests the counts after every step of a batch (AnytimeMonitor.advance), so
the step an alarm records is the one a check after every step would record; only the
moment the alarm is raised waits for the check.

Error budget alpha = 1 - confidence: the claim segments share it (claim_segments.py); in
the first, the noise-repeat test takes REPEAT_ALPHA and the noise-correlation test
FRESHNESS_SHARE * alpha of the pooled share, and the monitor splits the rest (monitor.py).
Both freshness tests are valid at every step over the whole run, so a correct run raises
any alarm with probability <= alpha.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from .claim_segments import SEGMENTED, SegmentedMonitor
from .monitor import CORRELATED, REPEATS, SETUP
from .noise_correlation import CORRELATION, NoiseCorrelation
from .noise_fingerprints import FINGERPRINTS, NoiseFingerprints
from .observations import LOG, ObservationLog
from .results import Finding
from .schema import Field, Section, is_int

SENTINELS = 128  # pool coordinates whose noise is fingerprinted every step
REPEAT_ALPHA = 1e-6  # false-alarm budget of the noise-repeat test, taken from the pooled test's share
FRESHNESS_SHARE = 0.01  # share of alpha taken by the noise-correlation test, from the pooled test's share
LAGS = 512  # recent steps whose noise each step's is correlated with
QUIET_NOISE = 1e-3  # sentinel noise below this RMS (x sigma*C) is no noise: nothing to fingerprint


PROBLEM = Field("problem", "list", rule=lambda v, ctx: None if (
    len(v) == 3 and isinstance(v[0], str) and isinstance(v[1], str) and is_int(v[2]) and v[2] >= 0
) else f"is {v!r}; expected [code, message, first step]")

# Set-up problems a state may hold: note_problem keeps the first of each finding code, and the audit has a few
# dozen codes (17 where this was written); 256 leaves room for codes of later versions.
MAX_PROBLEMS = 256

# What an audit has seen, as saved (ctx: "groups", "sentinels", "claims", "format"; see engine/state.py). Every
# field is written by this version (format 2): the optional ones are absent only from 0.1.0 states.
RECORD = Section(
    "record",
    Field("alerted", "bool", optional=True, since=2),
    Field("detected", "int", low=0, null=True, optional=True),  # absent from states written before it was kept
    Field("failed", "str", null=True, optional=True, since=2),
    Field("correlation", CORRELATION, optional=True, since=2),
    Field("fingerprints", FINGERPRINTS),
    Field("log", LOG),
    Field("monitor", SEGMENTED),
    Field("problems", "list", items=PROBLEM, optional=True, since=2, most=MAX_PROBLEMS),
)


@dataclass(frozen=True)
class StepReading:
    """One noised step, read on the host.

    step   the step's index, from 0
    layer  (k,) parameter-tensor group of each observation
    is_in  (k,) whether each canary entered the release
    value  (k,) normalized observations: N(0, s^2) out, N(1, s^2) in for a correct optimizer
    noise  (SENTINELS,) the release's noise at the sentinel coordinates, in units of sigma*C
           (None when the step has no noise to check)
    segment  the claim segment of the step (claim_segments.py; 0 while the claim never changed)
    """

    step: int
    layer: np.ndarray
    is_in: np.ndarray
    value: np.ndarray
    noise: Optional[np.ndarray]
    segment: int = 0


def quiet_noise(noises: Sequence[np.ndarray]) -> List[bool]:
    """Whether each step's sentinel noise is below QUIET_NOISE in RMS: no noise to fingerprint. Noises of one shape
    are measured together (each row's mean as its own), others one by one."""
    if not noises:
        return []
    if all(n.shape == noises[0].shape for n in noises) and noises[0].ndim == 1:
        return (np.sqrt(np.mean(np.stack(noises) ** 2, axis=1)) < QUIET_NOISE).tolist()
    return [bool(np.sqrt(np.mean(n**2)) < QUIET_NOISE) for n in noises]


class AuditRecord:
    """The observation log, the anytime monitor, the noise-freshness tests and the set-up problems of one audit."""

    def __init__(self, layer_claims: dict, pooled_claim: float, *, confidence: float, kinds: Sequence[str], window: int):
        self.log = ObservationLog(list(kinds), window=window)
        fresh_alpha = FRESHNESS_SHARE * (1.0 - confidence)
        self.monitor = SegmentedMonitor(layer_claims, pooled_claim, confidence=confidence,
                                        reserved=REPEAT_ALPHA + fresh_alpha)
        self.fingerprints = NoiseFingerprints(SENTINELS, alpha=REPEAT_ALPHA)
        self.correlation = NoiseCorrelation(SENTINELS, lags=LAGS, alpha=fresh_alpha)
        self.problems: List[Finding] = []
        self.alerted = False  # the alarm was given
        self.detected: Optional[int] = None  # the step count at the check that gave it
        self.failed: Optional[str] = None  # the first error of the audit's own code, when there was one
        self.scopes: dict = {}  # finding code -> the scope its check declares (declare)

    def add(self, readings: Sequence[StepReading], kind: str) -> None:
        """Log, count and fingerprint the readings of consecutive steps (in step order)."""
        if not readings:
            return
        sizes = [len(r.value) for r in readings]
        steps = np.repeat(np.array([r.step for r in readings], dtype=np.int64), sizes)
        layer = np.concatenate([r.layer for r in readings])
        is_in = np.concatenate([r.is_in for r in readings])
        value = np.concatenate([r.value for r in readings])
        segment = np.repeat(np.array([r.segment for r in readings], dtype=np.int64), sizes)
        self.log.append(step=steps, layer=layer, kind=kind, is_in=is_in, value=value)
        self.monitor.advance(steps + 1, layer, is_in, value, segment)
        noisy = [r for r in readings if r.noise is not None]
        for r, quiet in zip(noisy, quiet_noise([r.noise for r in noisy])):
            if not quiet:
                self._fingerprint(r.noise, r.step + 1)

    def _fingerprint(self, noise: np.ndarray, step: int) -> None:
        """A repeat of an earlier step's noise (or its negation), or noise correlated with a recent
        step's, is a violation. Steps without noise repeat nothing (the canaries see the missing
        noise directly, and quiet_noise leaves them out)."""
        if self.fingerprints.check(noise, step) is not None:
            self.monitor.flag(REPEATS, step)
        if self.correlation.check(noise, step) is not None:
            self.monitor.flag(CORRELATED, step)

    def note_problem(self, code: str, message: Optional[str], step: int, alarm: bool = True) -> bool:
        """Record a set-up problem found outside the canaries (a certainty, not a test); True when new.

        alarm=False: a fault that costs no privacy (reported among the findings, no violation)."""
        if not message or any(code == known.code for known in self.problems):
            return False
        self.problems.append(Finding(code, message, first_step=int(step), scope=self.scopes.get(code, "")))
        if alarm:
            self.monitor.flag(SETUP, int(step))
        return True

    def declare(self, scopes: dict) -> None:
        """The scope of each finding code the audit's checks may report (code -> "mechanism", "data path", "pipeline")."""
        self.scopes.update(scopes)

    def open_claim(self, layer_claims: dict, pooled_claim: float) -> int:
        """The claim segment of the steps from now on (claim_segments.py)."""
        return self.monitor.open(layer_claims, pooled_claim)

    def fired(self, step: int) -> list:
        """Groups whose alarm fired since the last call, tested at `step` as well."""
        return self.monitor.check(step)

    def unalarmed(self) -> list:
        """Groups recorded as violated while no alarm was given (empty once it was)."""
        return [] if self.alerted else sorted(self.monitor.first_violation)

    def state_dict(self) -> dict:
        return RECORD.dump({
            "alerted": self.alerted,
            "detected": self.detected,
            "failed": self.failed,
            "correlation": self.correlation.state_dict(),
            "fingerprints": self.fingerprints.state_dict(),
            "log": self.log.state_dict(),
            "monitor": self.monitor.state_dict(),
            "problems": [[f.code, f.message, f.first_step] for f in self.problems],
        })

    def load_state_dict(self, state: dict) -> None:
        """Restore each part of a state RECORD.check passed; a part that cannot be read raises ValueError naming it."""
        self.alerted, self.failed = bool(state.get("alerted", False)), state.get("failed")
        self.detected = state.get("detected")
        parts = [("fingerprints", self.fingerprints), ("log", self.log), ("monitor", self.monitor)]
        if "correlation" in state:  # a 0.1.0 state, saved before the correlation test: its window starts afresh
            parts.append(("correlation", self.correlation))
        else:
            self.correlation.reset()
        for field, part in parts:
            try:
                part.load_state_dict(state[field])
            except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
                raise ValueError(f"`{field}`: {type(error).__name__}: {error}") from error
        self.problems = [Finding(str(c), str(m), first_step=int(s), scope=self.scopes.get(str(c), ""))
                         for c, m, s in state.get("problems", [])]
