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

This class is the audit's face: its parts are made in order by assembly.py (options, the canary kind, the record,
the release path, the step pipeline, the checks); results come from analysis/assemble.py, saved state from state.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import torch

from ..analysis.results import AuditResult, violation_message
from . import assembly
from .checks import DATA_PATH, PIPELINE
from .checks.exact.per_sample import DEFAULT_BUDGET, DEFAULT_EVERY, DEFAULT_EXAMPLES
from .checks.mechanism.setup import SetupCheck
from .checks.run import SamplingCheck, refuse_unwatchable
from .checks.run.watched_loader import WatchedLoader
from .options import OPTIONS_DOC, SETTINGS
from .state import check_state, composed_steps, dump_state, load_parts
from .support.moved import MovedAttributes
from .support.user_warning import warn_at_user_code


class PrivacyViolationWarning(UserWarning):
    """The audited optimizer leaks more than its noise multiplier claims."""


class PrivacyAuditor(MovedAttributes):
    """Plants canaries in every noised step of `optimizer` and bounds epsilon; `result()` is the audit so far."""

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
        parts = assembly.build(optimizer, settings, accountant=accountant, checks=checks, data_loader=data_loader,
                               training_loss=training_loss, other_optimizers=other_optimizers, alarm=self._alarm)
        (self.optimizer, self.options, self.accountant, self.setup, self.kind, self.record, self.results, self.path,
         self.pipeline, self.checks, self.per_sample_check, self.opacus_step) = parts
        self.model, self.watched = module, None
        self.optimizer._dpaudit_auditor = self
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

    # ------------------------------------------------------------------ the run as it goes

    def watch_loader(self, loader) -> None:
        """Check the loader the loop iterates (under BatchMemoryManager, the one it yields) and each batch it delivers."""
        refuse_unwatchable("loader", loader)
        if self.watched is not None:
            self.watched.restore()
        self.checks.loader(loader)
        self.watched = WatchedLoader(loader, self.checks.batch)

    def loader(self, loader) -> None:  # the training loader, once known (the callback's); its batches come by `batch`
        self.checks.loader(loader)

    def batch(self, batch, step_fn: Optional[Callable] = None) -> None:
        """A batch the loader delivered for the coming step; `step_fn(batch)` replays its training step's loss."""
        self.checks.batch(batch, step_fn)

    def check(self) -> None:
        """Record what is pending and alarm once if a violation is recorded and not yet alarmed (under several
        processes every rank calls it at the same point)."""
        self.pipeline.check()

    def check_sample_rate(self, batches_per_epoch: int) -> None:
        """Flag an accountant whose sample rate ignores the world size (checks/mechanism/setup.py); on every rank."""
        setup = self.checks.find(SetupCheck)
        if setup is not None and setup.stopped is None:
            self.checks.call(setup, "batches_per_epoch", batches_per_epoch)
        self.pipeline.check()

    @property
    def failed(self) -> Optional[str]:
        """The first error of the audit's own code, when one was recorded (None otherwise)."""
        return self.record.failed

    def note_failure(self, cause: str) -> None:  # an error of the audit's own code outside the step: the first kept
        self.record.failed = self.record.failed or cause

    def _alarm(self) -> None:
        # the step the alarm is given at: a finding made during a step (before it is counted) is detected at that step
        first = min(self.record.monitor.first_violation.values(), default=0)
        self.record.detected = max(self.steps, first)
        result = self.result()
        with self.pipeline.delivering():  # given from here; what on_violation raises is passed on
            if self.options.on_violation is not None:
                self.options.on_violation(result)
            else:
                warn_at_user_code(violation_message(result), PrivacyViolationWarning)

    # ------------------------------------------------------------------ what the audit holds, and its results

    @property
    def steps(self) -> int:
        return self.pipeline.steps

    def recorded(self):
        """The record (analysis/record.py: observation log, monitor, fingerprints, findings), every step read."""
        self.pipeline.record_pending()
        return self.record

    @property
    def log(self):
        """The observation log, with every step read so far."""
        return self.recorded().log

    @property
    def problems(self) -> list:
        """(code, message, step) of the set-up problems found so far."""
        return [(f.code, f.message, f.first_step) for f in self.record.problems]

    def observations(self) -> dict:
        """The most recent observations (at most `observation_window`; every observation is
        counted in `self.log.histogram()` and the bounds): numpy arrays step, layer, kind, is_in, value."""
        return self.log.arrays()

    def result(self, *, accounting: bool = True) -> AuditResult:
        """The audit so far (AuditResult); accounting=False: no accountant's and end-to-end epsilon (nan), the costly
        part. A violation recorded and not yet alarmed is alarmed first (several processes: at the next check)."""
        self.pipeline.check() if self.path.local else self.pipeline.record_pending()
        result = self.results.result(self.record, self.kind.layer_names, self.steps, self.accountant,
                                     accounting=accounting)
        diverged, sampling = self.pipeline.diverged, self.checks.find(SamplingCheck)
        stopped = "" if diverged is None else f"; stopped: training diverged at step {diverged}"
        notes = tuple(f"{code}: {message}" for code, message in self.checks.notes()) + result.notes  # before statuses
        return replace(result, audit_failed=self.record.failed, detected_step=self.record.detected, notes=notes,
                       data_path=(self.checks.status(DATA_PATH) or "off") + stopped,
                       pipeline=self.checks.status(PIPELINE) + stopped,
                       epsilon_sampling=sampling.epsilon_or_nan() if sampling else float("nan"),
                       checks_stopped=self.checks.stopped_checks())  # stopped last: asking may stop one

    def summary(self) -> str:
        """The summary table `dpaudit report` prints (`str(self.result())`)."""
        return str(self.result())

    # ------------------------------------------------------------------ saved state

    def state_dict(self) -> dict:
        """Plain values and numpy arrays: the set-up, the step count, the kind's and the record's state."""
        return dump_state(self.setup, self.steps, self.kind.state_dict(), self.recorded().state_dict())

    def check_state(self, state: dict, *, composed: Optional[int] = None) -> None:
        """AuditStateError (a ValueError) unless `state` was taken on this set-up and is whole; `composed`: the steps
        the accountant's history composes (default: the accountant's own history)."""
        if composed is None:
            composed = composed_steps(getattr(self.accountant, "history", None))
        check_state(state, self.setup, claims=self.record.monitor.opening, composed=composed)

    def load_state_dict(self, state: dict, *, checked: bool = False) -> None:
        """Resume from `state`; AuditStateError (a ValueError), with the auditor unchanged, if it was taken on another
        set-up or is damaged. checked: `check_state` already passed it."""
        if not checked:
            self.check_state(state)
        load_parts(state, self.kind, self.record, self.pipeline)


PrivacyAuditor.__doc__ += "\n" + OPTIONS_DOC
PrivacyAuditor.MOVED_ATTRIBUTES = {  # version 0.2.0's names of what the parts hold
    "probe": ("kind.probe", lambda a: a.kind.probe),
    "sampler": ("kind.sampler", lambda a: getattr(a.kind, "sampler", None)),
    "input_probe": ("kind.input_probe", lambda a: getattr(a.kind, "input_probe", None)),
    "per_step": ("options.canaries_per_step", lambda a: a.options.canaries_per_step),
    "layer_names": ("kind.layer_names", lambda a: a.kind.layer_names),
    "mu_claimed": ("results.claim.mu_claimed", lambda a: a.results.claim.mu_claimed),
    "input": ("options.canary", lambda a: a.options.canary if a.options.input else None),
    "monitor": ("recorded().monitor", lambda a: a.recorded().monitor),
    "fingerprints": ("recorded().fingerprints", lambda a: a.recorded().fingerprints),
    "notes": ("checks.notes()", lambda a: a.checks.notes()),
    "sampling_epsilon": ("result().epsilon_sampling", lambda a: lambda: a.result(accounting=False).epsilon_sampling),
}
