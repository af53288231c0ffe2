"""Frozen records of an audit's outcome."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

from .verdict import (  # noqa: F401  (the verdict's words, imported from here too)
    DIVERGED,
    DOES_NOT_DESCRIBE,
    PIPELINE_CODES,
    VERDICT,
    pipeline_codes,
    violation_moment,
)


@dataclass(frozen=True)
class LayerAudit:
    """One parameter tensor's share of the audit.

    mu_lower_bound: fixed-sample lower bound on the per-step mu seen by canaries in this
    tensor; mu_claimed: what the optimizer's noise and clipping promise for them;
    mu_lower_bound_anytime: the anytime-valid bound the alarm compares with the claim.
    """

    name: str
    mu_lower_bound: float
    mu_lower_bound_anytime: float
    mu_claimed: float
    n_in: int
    n_out: int
    violation: bool


@dataclass(frozen=True)
class Finding:
    """One named cause of a violation, with the number that shows it.

    code      noise_scale, clipping, noise_repeats, noise_correlated, layer, general (see findings.py),
              or the code of another check that found a set-up problem, or of a fault that costs no
              privacy (training_diverged, opacus_error)
    message   one readable sentence: what was measured, its interval, the likely cause
    first_step the step the evidence first showed (the first alarm of the groups
              concerned, or the first repeating step), None when unknown
    layers    the parameter tensors concerned; empty when it concerns the whole model
    measured  the measured quantity the message names (for noise_scale the noise std
              in units of the claimed sigma * C, for clipping the in-canaries' shift in
              units of C, for noise_repeats the repeating steps, ...)
    claimed   what a correct implementation gives for `measured`
    scope     what the check that reported it covers, as the check declares it: "mechanism", "data path"
              or "pipeline" (the accountant's epsilon does not describe the run); "" for the canaries' own
    """

    code: str
    message: str
    first_step: Optional[int] = None
    layers: Tuple[str, ...] = ()
    measured: float = math.nan
    claimed: float = math.nan
    scope: str = ""


@dataclass(frozen=True)
class AuditResult:
    """What the canaries show about the privacy of the audited steps.

    epsilon_lower_bound   end-to-end epsilon at `delta` implied by mu_lower_bound
                          (per-step noise multiplier 1/mu composed by the run's own
                          accountant type, sample rate and steps; Tight Auditing 5.5)
    epsilon_accountant    the accountant's epsilon at `delta` (nan without accountant)
    mu_lower_bound        per-step GDP mu lower bound from all observations with the
                          `estimator` at `confidence`; a fixed-sample bound, valid when
                          read once (for example at the end of training)
    mu_lower_bound_anytime the pooled anytime-valid bound used by the alarm
    mu_claimed            1 / noise_multiplier, the per-step mu the optimizer promises
    violation             True if at any check the anytime-valid bound of the pooled
                          observations or of a tensor exceeded its claim; a correct
                          implementation shows this with probability <= 1 - confidence
    violating_layers      names of tensors whose own test fired ("pooled" for the pool)
    first_violation_step  the first step the violation concerns (the monitor tests after every step, and a
                          set-up problem names the step it was found at); None without a violation
    detected_step         the step count at the check that gave the alarm: first_violation_step or up to
                          check_every - 1 steps later; None without a violation or before the alarm was given
                          (under several processes it waits for the next check)
    epsilon_step_lower_bound, epsilon_step_claimed: per-step epsilons at `delta` (Eq. 6)
    noise_repeats         steps whose noise repeated an earlier step's (should be 0);
                          first_noise_repeat = (step, the earlier step it repeats) of the first
                          (steps counted from 1), None when there was none
    findings              Finding records naming the cause of a violation (findings.py);
                          empty without a violation, except findings of other checks
    audit_failed          the first error of the audit's own code ("TypeError: ... at step 12");
                          training went on (after an error in a step, without the audit);
                          None when there was none
    data_path             what the exact data-path checks compared (per-sample gradients of real
                          examples, clipped sums), or why they did not run
    notes                 what the claim itself does not cover (e.g. a normalisation that depends
                          on the dataset's size); not a violation
    pipeline              what the run checks compared (sampling, rows per record, independence of
                          examples, tensors outside the DP optimizer), or why they could not
    checks_stopped        (name, "stopped at step N: <error>") of each check that raised and was stopped
                          alone: what it would have verified after that step went unchecked
    epsilon_sampling      epsilon at `delta` under the sampling the run used, where it is not the
                          accountant's and a valid bound exists (shuffled fixed-size batches: one
                          Gaussian step per record an epoch); inf where no bound follows from the
                          noise (batches drawn with replacement or by weight); nan otherwise
    """

    epsilon_lower_bound: float
    epsilon_accountant: float
    mu_lower_bound: float
    mu_lower_bound_anytime: float
    mu_claimed: float
    violation: bool
    violating_layers: Tuple[str, ...]
    n_in: int
    n_out: int
    steps: int
    estimator: str
    confidence: float
    delta: float
    epsilon_step_lower_bound: float
    epsilon_step_claimed: float
    first_violation_step: Optional[int]
    noise_repeats: int
    mode: str
    canary: str
    layers: Tuple[LayerAudit, ...]
    first_noise_repeat: Optional[Tuple[int, int]] = None
    findings: Tuple[Finding, ...] = ()
    audit_failed: Optional[str] = None
    data_path: str = ""
    notes: Tuple[str, ...] = ()
    pipeline: str = ""
    epsilon_sampling: float = math.nan
    checks_stopped: Tuple[Tuple[str, str], ...] = ()
    detected_step: Optional[int] = None

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        """The summary table `dpaudit report` prints: the verdict ("OK: ..." or "VIOLATION: ..."),
        findings, the epsilon and mu rows, the run's facts and one row per tensor."""
        from .summary import summary_table

        return summary_table({"result": self.to_dict()})


def violation_message(r: AuditResult) -> str:
    """The alert: one headline (the verdict and the cause first, the numbers after), then one line per finding.

    The headline reads "DP AUDIT VIOLATION found at step 8 (first violating step 6): noise_scale: noise std ...;
    epsilon >= 12.3 vs accountant 2.1 (delta 1e-05); per-step mu lower bound ...; violating: ...": the step of the
    check that gave the alarm (the result's step count where it has no detection step yet: the alert is made at
    that check) and the first step that violated; the cause is the first finding's code and sentence (the
    alarm's own numbers where there is no finding).
    """
    return _violation_line(r) + "".join(f"\n  - {f.code}: {f.message}" for f in r.findings)


def _violation_line(r: AuditResult) -> str:
    """The verdict, the cause, then the numbers: both epsilons, the bound that crossed its claim (the pool's, else
    the first tensor's) or the repeat, and the groups and tensors whose test fired."""
    tensor = next((layer for layer in r.layers if layer.violation), None)
    repeat = r.first_noise_repeat
    correlated = next((f for f in r.findings if f.code == "noise_correlated"), None)
    if "pooled" not in r.violating_layers and tensor is None and not repeat and correlated is not None:
        crossed = correlated.message.split(":")[0]  # the noise of step t is correlated with step s's, l steps back
    elif "pooled" not in r.violating_layers and tensor is None and not repeat and r.findings:
        crossed = "a set-up problem found outside the canaries"
    elif "pooled" in r.violating_layers or (tensor is None and not repeat):
        crossed = f"per-step mu lower bound {r.mu_lower_bound_anytime:.3f} (anytime, {r.confidence:.0%}) exceeds the claimed {r.mu_claimed:.3f}"
    elif tensor is not None:
        crossed = (
            f"per-step mu lower bound {tensor.mu_lower_bound_anytime:.3f} in {tensor.name} (anytime, {r.confidence:.0%}) "
            f"exceeds the claimed {tensor.mu_claimed:.3f}"
        )
    else:
        crossed = f"the noise of step {repeat[0]} repeats step {repeat[1]}'s"
        repeat = None  # said already
    first = next((f for f in r.findings if f.code in PIPELINE_CODES or f.scope == "pipeline"),
                 r.findings[0] if r.findings else None)
    cause = f"{first.code}: {first.message.rstrip('.')}" if first is not None else crossed
    numbers = []
    if math.isfinite(r.epsilon_accountant):
        numbers.append(f"epsilon >= {r.epsilon_lower_bound:.3g} vs accountant {r.epsilon_accountant:.3g} (delta {r.delta:g})")
    if first is not None and crossed not in first.message:
        numbers.append(crossed)
    numbers.append(f"violating: {', '.join(r.violating_layers)}")
    if repeat and (first is None or f"step {repeat[0]}" not in first.message):
        numbers.append(f"the noise of step {repeat[0]} repeats step {repeat[1]}'s")
    moment = violation_moment(r.first_violation_step, r.steps if r.detected_step is None else r.detected_step)
    return f"{VERDICT} {moment}: {cause}; " + "; ".join(numbers)
