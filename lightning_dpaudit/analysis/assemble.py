"""From what an audit recorded to an AuditResult: fixed-sample and anytime bounds, end-to-end
epsilon, findings. Torch-free; the accountant is read through its `history` and `mechanism()`.

Per group (pooled, each tensor) the threshold-0.5 attack's counts (tp, fn, fp, tn) give a
fixed-sample mu lower bound (the chosen estimator) and the monitor's anytime-valid one.
The end-to-end lower bound composes sigma_emp = 1 / mu_lower over the accountant's own
history with the accountant's own method (Tight Auditing 5.5; estimators.live_epsilon).
The accountant's epsilon is the accountant's own `get_epsilon(delta)` (asked of a copy, so that
an accountant whose query changes its state is left as it was); inf when an accountant that composes
every entry (RDP, PRV) holds a step without noise, nan with a note when it cannot be computed.
When the claim changed during the run, the pooled bounds become a certified ratio of
actual to claimed mu (estimators.changing_claims), shown in the current claim's units,
and every step of the history is composed at sigma_t / ratio.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import numpy as np

from .. import estimators as est
from ..estimators.changing_claims import ratio_lower_bound
from ..estimators.composition import check_composition_size
from ..estimators.live_epsilon import LiveEpsilon, merge_history
from .findings import Evidence, diagnose
from .monitor import CORRELATED, POOLED, REPEATS, SETUP
from .record import AuditRecord
from .results import AuditResult, LayerAudit


@dataclass(frozen=True)
class Claim:
    """What the audited run claims and how the audit judges it.

    mu_claimed = 1 / noise_multiplier: each step is mu-GDP for every canary (inf at noise multiplier 0: no claim).
    """

    noise_multiplier: float
    delta: float
    confidence: float
    estimator: str
    mode: str
    canary: str
    gradient: bool  # gradient canaries (False: input canaries)
    canary_scale: float
    batch_size: Optional[float] = None

    @property
    def mu_claimed(self) -> float:
        return math.inf if self.noise_multiplier == 0 else 1.0 / self.noise_multiplier

    @property
    def epsilon_step_claimed(self) -> float:
        return est.mu_to_epsilon(self.mu_claimed, self.delta)


class ResultAssembler:
    """Builds AuditResults; keeps the live-epsilon curves of the accountant's kind between calls."""

    def __init__(self, claim: Claim, noise_now: Optional[Callable[[], float]] = None):
        """`noise_now()`: the noise multiplier claimed now, where it changes during the run (None: `claim`'s)."""
        self._claim, self.noise_now = claim, noise_now
        self._live: Optional[LiveEpsilon] = None
        self._asked: Optional[tuple] = None  # (the accountant's class, history, delta), its epsilon

    @property
    def claim(self) -> Claim:
        """What the run claims now (its noise multiplier as the optimizer's last step claimed it)."""
        return self._claim if self.noise_now is None else replace(self._claim, noise_multiplier=self.noise_now())

    def result(self, record: AuditRecord, layer_names: Sequence[str], steps: int, accountant, *, accounting: bool = True) -> AuditResult:
        claim, monitor = self.claim, record.monitor
        counts = monitor.group_counts()
        groups = [POOLED, *range(len(layer_names))]
        mus = self.mu_lower(np.array([counts[g] for g in groups]))
        ratio = None  # actual / claimed mu, where the claim changed during the run
        if len(monitor.segments) > 1:  # pooled over claims: the certified ratio, in the current claim's units
            ratios = [claim_ratio(mu, monitor, g) for g, mu in zip(groups, mus)]
            mus = np.array([monitor.claims[g] * r for g, r in zip(groups, ratios)])
            ratio = ratios[0]
        mu_step = float(mus[0])
        anytime = monitor.refresh_bounds()
        layers = []
        for i, name in enumerate(layer_names):
            tp, fn, fp, tn = counts[i]
            layers.append(
                LayerAudit(
                    name=name,
                    mu_lower_bound=float(mus[i + 1]),
                    mu_lower_bound_anytime=float(anytime.get(i, 0.0)),
                    mu_claimed=float(monitor.claims[i]),
                    n_in=int(tp + fn),
                    n_out=int(fp + tn),
                    violation=i in monitor.first_violation,
                )
            )
        tp, fn, fp, tn = counts[POOLED]
        violating = tuple(group_name(g, layer_names) for g in sorted(monitor.first_violation))
        first = min(monitor.first_violation.values()) if monitor.first_violation else None
        notes: list = []
        eps_accountant, eps_lower = (self.end_to_end(mu_step, accountant, ratio, notes=notes) if accounting
                                     else (math.nan, math.nan))
        findings = diagnose(
            self.evidence(record, layer_names, anytime), violation=bool(violating), first_violation_step=first,
            extra=record.problems, canaries_alarmed=any(g != SETUP for g in monitor.first_violation),
        )
        return AuditResult(
            epsilon_lower_bound=eps_lower,
            epsilon_accountant=eps_accountant,
            mu_lower_bound=mu_step,
            mu_lower_bound_anytime=float(anytime.get(POOLED, 0.0)),
            mu_claimed=claim.mu_claimed,
            violation=bool(violating),
            violating_layers=violating,
            n_in=int(tp + fn),
            n_out=int(fp + tn),
            steps=int(steps),
            estimator=claim.estimator,
            confidence=claim.confidence,
            delta=claim.delta,
            epsilon_step_lower_bound=est.mu_to_epsilon(mu_step, claim.delta),
            epsilon_step_claimed=claim.epsilon_step_claimed,
            first_violation_step=first,
            noise_repeats=record.fingerprints.matches,
            first_noise_repeat=record.fingerprints.first_repeat,
            mode=claim.mode,
            canary=claim.canary,
            layers=tuple(layers),
            findings=findings,
            notes=tuple(notes),
        )

    def evidence(self, record: AuditRecord, layer_names: Sequence[str], anytime: dict) -> Evidence:
        """The numpy state findings.diagnose reads: moments per tensor, claims, alarms, noise repeats."""
        claim, monitor = self.claim, record.monitor
        tensors = len(layer_names)
        moments = np.zeros((tensors, 2, 3))
        logged = record.log.moments()[:tensors]
        moments[: len(logged)] = logged
        return Evidence(
            moments=moments,
            claims=np.array([monitor.claims[i] for i in range(tensors)], dtype=float),
            names=tuple(layer_names),
            confidence=claim.confidence,
            noise_multiplier=claim.noise_multiplier,
            mu_claimed=claim.mu_claimed,
            gradient=claim.gradient,
            alarms=dict(monitor.first_violation),
            mu_anytime=dict(anytime),
            first_repeat=record.fingerprints.first_repeat,
            repeats=record.fingerprints.matches,
            first_negated=record.fingerprints.first_negated,
            correlation=record.correlation.evidence(claim.confidence),
            batch_size=claim.batch_size,
            canary_scale=claim.canary_scale,
        )

    def mu_lower(self, counts: np.ndarray) -> np.ndarray:
        """Fixed-sample mu lower bounds from the threshold-0.5 attack's counts, one row (tp, fn, fp, tn) per group."""
        claim = self.claim
        counts = np.asarray(counts, dtype=np.int64)
        if claim.estimator.startswith("gdp"):
            return np.atleast_1d(est.mu_from_counts(*counts.T, method=claim.estimator, confidence=claim.confidence))
        mus = []
        for row in counts:
            e = est.epsilon_from_counts(*(int(c) for c in row), delta=claim.delta, method=claim.estimator, confidence=claim.confidence)
            mus.append(float(e.mu) if e.mu is not None else est.epsilon_to_mu(e.epsilon, claim.delta) if e.epsilon > 0 else 0.0)
        return np.array(mus)

    def end_to_end(self, mu_step: float, accountant, ratio: Optional[float] = None, *, notes: Optional[list] = None):
        """(accountant epsilon, end-to-end lower bound), the curves cached per accountant kind (LiveEpsilon).

        With one claim, sigma_emp = 1 / mu_step at every step; when the claim changed, every
        step of the accountant's history at sigma_t / ratio (ratio: actual / claimed mu).
        Either one that cannot be computed is nan, with a note saying why appended to `notes`.
        """
        if accountant is None or not accountant.history:
            return math.nan, math.nan
        kind = accountant.mechanism()
        if self._live is None or self._live.accountant != kind:
            self._live = LiveEpsilon(kind, delta=self.claim.delta)
        history = accountant.history
        notes = [] if notes is None else notes
        epsilon = _unless_it_fails(lambda: self.accountant_epsilon(accountant), "the accountant's epsilon", history, notes)
        lower = _unless_it_fails(lambda: (self._live.lower_bound_epsilon(mu_step, history) if ratio is None
                                          else self._live.lower_bound_epsilon_scaled(ratio, history)),
                                 "the end-to-end lower bound", history, notes)
        return epsilon, lower

    def accountant_epsilon(self, accountant) -> float:
        """What `accountant.get_epsilon(delta)` returns now, exactly.

        Opacus's RDP and Gaussian accountants are computed by LiveEpsilon (the same numbers, RDP in identical
        floating point, from curves cached between calls); any other accountant (PRV, whose LiveEpsilon value
        rounds the steps up to a grid, a subclass, a patched get_epsilon) is asked itself, on a shallow copy
        with its own copy of the history (Opacus's RDP and PRV accountants: consecutive equal entries merged, the
        same composition), and the answer kept until the history changes. A step composed at noise multiplier 0
        releases its batch's gradients as they are: inf, without asking (Opacus's PRV and GDP accountants raise).
        """
        if any(float(entry[0]) == 0 for entry in accountant.history):
            return math.inf
        kind, delta = accountant.mechanism(), self.claim.delta
        method = getattr(type(accountant), "get_epsilon", None)
        if kind in ("rdp", "gdp") and getattr(method, "__module__", None) == f"opacus.accountants.{kind}":
            return self._live.accountant_epsilon(accountant.history)
        key = (type(accountant), tuple(tuple(entry) for entry in accountant.history), delta)
        if self._asked is not None and self._asked[0] == key:
            return self._asked[1]
        try:
            asked = copy.copy(accountant)
            own = kind in ("rdp", "prv") and getattr(method, "__module__", None) == f"opacus.accountants.{kind}"
            # Opacus's own composes each entry: runs of equal ones as one (its PRV accountant spends seconds per entry)
            asked.history = merge_history(accountant.history) if own else list(accountant.history)
            if own and kind == "prv":  # one that would not fit in memory is refused before it allocates
                check_composition_size(asked.history, delta=delta, accountant="prv")
            epsilon = float(asked.get_epsilon(delta=delta))
        except Exception:  # an accountant that cannot be copied or asked: Opacus's computation for its kind
            return self._live.accountant_epsilon(accountant.history)
        self._asked = (key, epsilon)
        return epsilon


def _unless_it_fails(compute, what: str, history, notes: list) -> float:
    """compute(), the accountant's maths without numpy's floating-point warnings (an infinite or 0 term is an
    answer there, inf or 0, not a problem to warn about); nan, with a note naming the error, when it raises."""
    try:
        with np.errstate(divide="ignore", over="ignore", under="ignore", invalid="ignore"):
            return compute()
    except Exception as error:  # whatever the accountant's maths raises: no figure, rather than no result
        try:
            smallest = f"; the smallest noise multiplier in its history is {min(float(e[0]) for e in history):g}"
        except Exception:  # a history that is not (noise multiplier, sample rate, steps) entries
            smallest = ""
        note = (f"accounting: {what} is not available (nan): computing it from the accountant's history raised "
                f"{type(error).__name__}: {error}{smallest}")
        if note not in notes:
            notes.append(note)
        return math.nan


def claim_ratio(mu_lower: float, monitor, group: int) -> float:
    """The ratio actual / claimed mu that a pooled bound certifies over the claim segments (changing_claims.py)."""
    segments = [(claims[group], counts[group]) for claims, counts in monitor.segment_counts() if group in claims]
    n_in = [c[0] + c[1] for _, c in segments]
    n_out = [c[2] + c[3] for _, c in segments]
    return ratio_lower_bound(mu_lower, n_in, n_out, [claim for claim, _ in segments])


def group_name(group: int, layer_names) -> str:
    if group == POOLED:
        return "pooled"
    if group == REPEATS:
        return "noise repeats"
    if group == CORRELATED:
        return "noise correlated"
    if group == SETUP:
        return "exact checks"
    return layer_names[group]
