"""PrivacyAuditor: the white-box canary audit of an Opacus DPOptimizer, attached in place.

Per noised step (Tight Auditing, Algorithm 2, with the privatized sum read directly):

    S  = summed_grad after the optimizer clipped the real batch (its own code)
    K  = what the optimizer's own clipping makes of the in-canaries' rows
    R  = released gradient after the optimizer's own add_noise = S + K + noise
    observation_i = <w_i, R - S> / C_l                                      (one per canary)
    the update keeps R - K = S + noise, exactly what it would be without the auditor.

Centering on S removes the data's own gradient, so for a correct optimizer an
out-observation is N(0, s^2) and an in-observation N(1, s^2) with s the noise
multiplier in the canary's units: the step is (1/s)-GDP for each canary.

This class is the wiring: options (options.py), the canary kind (canaries/), the release
path for the optimizer's family (release/), the step pipeline (step/), what is
recorded (analysis/record.py), results (analysis/assemble.py) and saved state (state.py).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Optional

import numpy as np
import torch

from ..analysis.assemble import ResultAssembler
from ..analysis.record import AuditRecord
from ..analysis.results import AuditResult, violation_message
from . import assembly
from .claims.adaptive import mechanism_of
from .checks import DATA_PATH, PIPELINE
from .checks.mechanism.setup import SetupCheck
from .claims.step_claim import audited_claim
from .step.divergence import diverged_step
from .findings_sink import FindingSink
from .canaries import ALL_KIND_NAMES, canary_kind_for
from .step.noised_step import NoisedStep
from .step.opacus_step import OpacusStep
from .options import SETTINGS, find_accountant
from .checks.exact.per_sample import DEFAULT_BUDGET, DEFAULT_EVERY, DEFAULT_EXAMPLES
from .checks.run import SamplingCheck, refuse_unwatchable
from .checks.run.watched_loader import WatchedLoader
from .state import AuditStateError, check_state, composed_steps, dump_state, setup_of
from .support.user_warning import warn_at_user_code


class PrivacyViolationWarning(UserWarning):
    """The audited optimizer leaks more than its noise multiplier claims."""


class PrivacyAuditor:
    """Plants canaries in every noised step of `optimizer` and bounds epsilon.

    canary: a gradient canary kind ("dirac", "constant", "random"), an input canary kind
    ("mislabeled", "blank", "adversarial", "crafted") or an InputCanaries object.
    canaries_per_step: canaries per noised step (one-run: half in, half out; paired: all
    in the second release, all out in the first); "auto" (default): 1,024 gradient
    canaries (fewer on models under 2,048 coordinates), 32 input canaries.
    canary_scale: canary norm as a multiple of the clipping bound (> 1 audits clipping).
    moving: fresh coordinates each step. support: coordinates per canary for "constant"
    and "random".
    check_every: steps between checks. A violation is recorded at the step it happens and
    raised at the next check (at most check_every - 1 steps later). "auto" (default): 8
    where the readings stay on the device between checks (gradient canaries on one
    process), 1 where a step reads on the host anyway (input canaries, several processes).
    Input canaries: module (the GradSampleModule) is required; canary_inputs /
    canary_labels are in-distribution examples held out from training, loss_fn the
    summed training loss (default cross-entropy), recraft_every the steps between
    rebuilds of adversarial and crafted canaries.
    observe_steps: plant and observe canaries in the first observe_steps noised steps
    only (None: all steps); later steps run un-audited.
    observation_window: how many of the latest raw observations `observations()` keeps
    (the counts, bounds and histograms cover every observation).
    on_violation: called once with the AuditResult when the alarm first fires (default:
    one PrivacyViolationWarning).
    per_sample_check_every: the steps between exact checks of a few real examples'
    per-sample gradients (ghost clipping: norms and clipping coefficients) against plain
    autograd, first at step 1 (checks/exact/per_sample.py; 0 turns them off);
    per_sample_check_examples: the examples compared at each;
    per_sample_check_budget: the largest share of the run's wall time the exact checks may
    take after step 1's: a due step is skipped when checking it would pass that share, at the
    last check's cost (step 1 never is; 1.0: none is).
    checksum_every: under a DistributedDPOptimizer, the steps between checks that every
    replica holds the same parameters (see distributed.py; 0 turns them off).
    The run beyond the optimizer (checks/run/): data_loader, the loader the loop iterates (`watch_loader`
    for one made later); training_loss(batch), the step's loss, replayed by the independence check;
    other_optimizers, the run's other optimizers (what they hold trains outside DP-SGD).
    checks: the checks to run, replacing the defaults (`default_checks(...)`, built from the options above); add
    your own as `checks=[*default_checks(), MyCheck()]` (checks/base.py: the interface).
    """

    def __init__(
        self, optimizer, *, accountant=None, delta: float = 1e-5, confidence: float = 0.95, canary="dirac",
        canaries_per_step="auto", mode: str = "one-run", estimator: str = "gdp-cp", seed: Optional[int] = None,
        canary_scale: float = 2.0, moving: bool = True, support: int = 16, check_every="auto",
        module: Optional[torch.nn.Module] = None, on_violation: Optional[Callable[[AuditResult], None]] = None,
        canary_inputs: Optional[torch.Tensor] = None, canary_labels: Optional[torch.Tensor] = None,
        loss_fn: Optional[Callable] = None, recraft_every="auto", observe_steps: Optional[int] = None,
        observation_window: int = 65_536, checksum_every: int = 100, per_sample_check_every: int = DEFAULT_EVERY,
        per_sample_check_examples: int = DEFAULT_EXAMPLES, per_sample_check_budget: float = DEFAULT_BUDGET,
        data_loader=None, training_loss: Optional[Callable] = None, other_optimizers=(), checks=None,
    ):
        settings = {name: value for name, value in locals().items() if name in SETTINGS}
        optimizer, path_class, options, checks = assembly.validated(
            optimizer, accountant=accountant, checks=checks, data_loader=data_loader, training_loss=training_loss,
            other_optimizers=other_optimizers, settings=settings)
        seed = path_class.agree_on_seed(options.seed)
        self.optimizer, self.options, self.model, self.on_violation = optimizer, options, module, options.on_violation
        self.accountant = accountant if accountant is not None else find_accountant(optimizer)
        mechanism = mechanism_of(optimizer)  # adaptive clipping: the gradient's noise multiplier (adaptive.py)
        self.setup = setup_of(mechanism, options)
        claim = audited_claim(mechanism)  # noise multiplier 0: no claim, the canaries wait under a stand-in one
        self.kind = canary_kind_for(optimizer, claim, options, module, np.random.default_rng(seed))
        self.record = AuditRecord(self.kind.layer_claims, 1.0 / claim.noise_multiplier, confidence=options.confidence,
                                  kinds=ALL_KIND_NAMES, window=options.observation_window)
        self.results = ResultAssembler(assembly.claim_of(optimizer, mechanism, options))
        findings = FindingSink(self.record)
        self.per_sample_check = exact = assembly.exact_check_of(checks)  # the exact check (None when not run)
        self.path = assembly.release(path_class, optimizer, self.kind, claim, options, findings, seed, exact)
        self.pipeline = assembly.steps(optimizer, self.kind, self.path, self.record, findings, mechanism,
                                       self.accountant, options, alarm=self._alarm, on_claim_change=self._claim_changed)
        self.checks = assembly.run_checks(
            checks, optimizer, mechanism, module, self.kind, self.path, self.pipeline, self.accountant, options, seed,
            other_optimizers=other_optimizers, training_loss=training_loss, exact_options={
                "every": per_sample_check_every, "examples": per_sample_check_examples, "budget": per_sample_check_budget})
        self.path.verify_start(options.canaries_per_step, seed)
        self.noised_step = NoisedStep(optimizer, self.pipeline, exact, self.checks, self.path)
        self.path.attach(self.noised_step)
        self.opacus_step = OpacusStep(optimizer, steps=lambda: self.pipeline.steps, report=self.noised_step.opacus_error,
                                      raised_by_audit=lambda error: error is self.pipeline.raised)
        optimizer._dpaudit_auditor = self
        self.watched: Optional[WatchedLoader] = None
        self.checks.attach()
        if data_loader is not None:
            self.watch_loader(data_loader)

    def detach(self) -> None:
        """Restore the optimizer exactly as it was before the auditor attached."""
        if getattr(self.optimizer, "_dpaudit_auditor", None) is not self:
            return
        self.path.detach()
        self.opacus_step.restore()
        self.checks.close()
        if self.watched is not None:
            self.watched.restore()
            self.watched = None
        del self.optimizer._dpaudit_auditor

    # ------------------------------------------------------------------ what the audit holds

    @property
    def steps(self) -> int:
        return self.pipeline.steps

    @property
    def probe(self):
        """The pool reader the kind and the path share (probe.GradientProbe)."""
        return self.kind.probe

    @property
    def sampler(self):
        return getattr(self.kind, "sampler", None)

    @property
    def input_probe(self):
        return getattr(self.kind, "input_probe", None)

    @property
    def per_step(self) -> int:
        return self.options.canaries_per_step

    @property
    def layer_names(self) -> list:
        return self.kind.layer_names

    @property
    def mu_claimed(self) -> float:
        return self.results.claim.mu_claimed

    @property
    def input(self):
        return self.options.canary if self.options.input else None

    @property
    def log(self):
        """The observation log, with every step read so far."""
        self.pipeline.record_pending()
        return self.record.log

    @property
    def monitor(self):
        self.pipeline.record_pending()
        return self.record.monitor

    @property
    def fingerprints(self):
        self.pipeline.record_pending()
        return self.record.fingerprints

    @property
    def problems(self) -> list:
        """(code, message, step) of the set-up problems found so far."""
        return [(f.code, f.message, f.first_step) for f in self.record.problems]

    def watch_loader(self, loader) -> None:
        """Check the loader the loop iterates (under BatchMemoryManager, the one it yields) and each batch it delivers."""
        refuse_unwatchable("loader", loader)
        if self.watched is not None:
            self.watched.restore()
        self.checks.loader(loader)
        self.watched = WatchedLoader(loader, self.checks.batch)

    def loader(self, loader) -> None:
        """The training loader, when it becomes known (the callback reads the Trainer's); its batches come by `batch`."""
        self.checks.loader(loader)

    def batch(self, batch, step_fn: Optional[Callable] = None) -> None:
        """A batch the loader delivered for the coming step; `step_fn(batch)` replays its training step's loss."""
        self.checks.batch(batch, step_fn)

    def sampling_epsilon(self) -> float:
        """Epsilon under the sampling the run used where a valid bound exists (checks/run/sampling.py); nan where it
        is the accountant's own or no sampling check runs, inf where no valid bound follows from the noise."""
        sampling = self.checks.find(SamplingCheck)
        try:
            return math.nan if sampling is None or sampling.stopped else sampling.epsilon()
        except Exception:  # an accountant that cannot compose a fresh history: no figure rather than a fault
            return math.nan

    @property
    def failed(self) -> Optional[str]:
        """The first error of the audit's own code, when one was recorded (None otherwise)."""
        return self.record.failed

    def note_failure(self, cause: str) -> None:
        """Record an error of the audit's own code met outside the step (the first one is kept)."""
        self.record.failed = self.record.failed or cause

    def check(self) -> None:
        """Record what is pending and alarm once if a violation is recorded and not yet alarmed (under several
        processes every rank calls it at the same point)."""
        self.pipeline.check()

    def check_sample_rate(self, batches_per_epoch: int) -> None:
        """Flag an accountant whose sample rate ignores the world size (checks/mechanism/setup.py)."""
        setup = self.checks.find(SetupCheck)
        if setup is not None and setup.stopped is None:
            self.checks.call(setup, "batches_per_epoch", batches_per_epoch)
        self.pipeline.check()  # every rank calls this method, so every rank reaches the check

    def _claim_changed(self, mechanism) -> None:
        """The optimizer's noise multiplier or clipping bounds changed: the next steps claim the new values. A noise
        multiplier of 0 claims nothing (the result's mu_claimed is inf): the canaries keep the last claim, and no
        step is audited until it is positive again (pipeline.py)."""
        self.results.claim = replace(self.results.claim, noise_multiplier=mechanism.noise_multiplier)
        if mechanism.noise_multiplier == 0:
            return
        self.kind.set_claim(mechanism)
        if hasattr(self.path, "noise_std"):
            self.path.noise_std = mechanism.noise_multiplier * mechanism.max_grad_norm
        self.pipeline.segment = self.record.open_claim(self.kind.layer_claims, 1.0 / mechanism.noise_multiplier)

    def _alarm(self) -> None:
        # the step the alarm is given at, for the alert and every summary: a finding made during a step (before it
        # is counted) is detected at that step
        first = min(self.record.monitor.first_violation.values(), default=0)
        self.record.detected = max(self.steps, first)
        result = self.result()
        with self.pipeline.delivering():  # given from here; what on_violation raises is passed on
            if self.on_violation is not None:
                self.on_violation(result)
            else:
                warn_at_user_code(violation_message(result), PrivacyViolationWarning)

    # ------------------------------------------------------------------ results

    def observations(self) -> dict:
        """The most recent observations (at most `observation_window`; every observation is
        counted in `self.log.histogram()` and the bounds): numpy arrays step, layer, kind, is_in, value."""
        return self.log.arrays()

    def result(self, *, accounting: bool = True) -> AuditResult:
        """The audit so far (see AuditResult for what each number means).

        accounting=False skips the accountant's epsilon and the end-to-end conversion
        (both nan), the costly part with a PRV accountant, for frequent live views. A violation
        recorded and not yet alarmed is alarmed first (under several processes, at the next
        check, which every rank reaches).
        """
        if self.path.local:
            self.pipeline.check()
        else:
            self.pipeline.record_pending()
        result = self.results.result(self.record, self.layer_names, self.steps, self.accountant, accounting=accounting)
        diverged = self.pipeline.diverged
        stopped = "" if diverged is None else f"; stopped: training diverged at step {diverged}"
        notes = tuple(f"{code}: {message}" for code, message in self.checks.notes()) + result.notes
        data_path, pipeline = self.checks.status(DATA_PATH) or "off", self.checks.status(PIPELINE)
        return replace(result, audit_failed=self.record.failed, detected_step=self.record.detected,
                       data_path=data_path + stopped, pipeline=pipeline + stopped,
                       epsilon_sampling=self.sampling_epsilon(), notes=notes,
                       checks_stopped=self.checks.stopped_checks())  # stopped last: asking may stop one

    def _evidence(self, anytime: dict):
        return self.results.evidence(self.record, self.layer_names, anytime)

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict:
        """Plain values and numpy arrays: the set-up, the step count, the kind's and the record's state."""
        self.pipeline.record_pending()
        return dump_state(self.setup, self.steps, self.kind.state_dict(), self.record.state_dict())

    def check_state(self, state: dict, *, composed: Optional[int] = None) -> None:
        """AuditStateError (a ValueError) unless `state` was taken on this set-up and is whole; `composed`: the steps
        the accountant's history composes (default: the accountant's own history)."""
        if composed is None:
            composed = composed_steps(getattr(self.accountant, "history", None))
        check_state(state, self.setup, claims=self.record.monitor.opening, composed=composed)

    def load_state_dict(self, state: dict, *, checked: bool = False) -> None:
        """Resume from `state`; AuditStateError (a ValueError), with the auditor unchanged, if it
        was taken on another set-up or is damaged. checked: `check_state` already passed it."""
        if not checked:
            self.check_state(state)
        saved = self.state_dict()
        try:
            self._load(state)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
            self._load(saved)
            raise AuditStateError(f"the audit state is damaged ({error}); start a new audit") from None

    def _load(self, state: dict) -> None:
        try:
            self.kind.load_state_dict(state)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
            raise ValueError(f"`sampler` or `pool`: {type(error).__name__}: {error}") from error
        self.record.load_state_dict(state)
        self.pipeline.steps = int(state["steps"])
        self.pipeline.diverged = diverged_step(self.record.problems)  # a run that diverged stays unobserved
        self._claim_changed(self.pipeline.claims.mechanism)  # the steps from here claim what the optimizer holds now

    # ------------------------------------------------------------------ summary

    def summary(self) -> str:
        """The audit so far as the summary table `dpaudit report` prints (`str(self.result())`):
        "OK: ..." or "VIOLATION: ...", findings, both epsilons, the mu rows, one row per tensor."""
        return str(self.result())
