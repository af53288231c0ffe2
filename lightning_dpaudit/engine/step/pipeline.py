"""One audited step: plant -> release -> read -> record -> check.

Before planting, the step's claim is read from the optimizer (claims/): noise and
clipping schedules change it between steps. A step at noise multiplier 0 claims nothing:
the finding `no_noise` is reported at the first one, and the step is released plain, with
no canary, as without the audit.

    plant    the canary kind draws this step's canaries               (canaries/)
    release  the release path puts them through the optimizer's own   (release/)
             clipping and noise, and leaves the un-audited update
    read     the kind reads each release: observations and sentinel
             noise, kept on the parameters' device                      (readings.py)
    record   at a check, every pending reading moves to the host at
             once: log, monitor, noise fingerprints                     (analysis/record.py)
    check    a violation recorded and not yet alarmed is alarmed, once

Checks come every `check_every` steps, after the last observed step (`observe_steps`),
and whenever results are asked for on one process. The monitor tests the counts after
every step of a batch, so a violation is recorded at the step a check after every step
would record; it is raised at most check_every - 1 steps later. Under several processes
every rank checks at the same steps.

Faults. On one process, an error of the audit's own code during a step (not the alarm,
not the optimizer's own add_noise, not a KeyboardInterrupt) detaches the audit: the step
ends as it would without it (the optimizer's add_noise once on the data's own sum, in
the same draw order), one AuditFailedWarning is issued, and the record keeps the cause.
Under several processes the error is raised (a rank leaving the collectives alone would
hang the others). A noise multiplier the optimizer's own add_noise cannot draw with (a string,
NaN or negative; plain Opacus raises a torch error there) ends the step with the audit's
ValueError naming it instead: the step could not complete without the audit either. What the audit raises
itself (its alarm's error, its own under several processes, that ValueError) is kept as `raised`: an error of
Opacus's own step is any other (opacus_step.py).

Divergence. Each release's finiteness is read from the step's readings on the host (divergence.py); the first step
whose readings are not finite is recorded as `training_diverged` (no alarm), its readings and every later
step's are dropped, and the steps from it on are plain. Before a problem is recorded the tensors are tested now
(a host sync, rare): a comparison of non-finite values is the divergence, not a finding.
"""

from __future__ import annotations

import math
import numbers
import warnings
from contextlib import contextmanager
from typing import Callable, Optional

import torch

from ...analysis.record import AuditRecord
from ..claims.step_claim import NO_NOISE, no_noise_message
from . import divergence
from .readings import PendingReadings


class AuditFailedWarning(RuntimeWarning):
    """The audit's own code raised: it detached itself and training goes on without it."""


class NoiseCalls:
    """Counts the optimizer's own add_noise as the path calls it; what it raises is the optimizer's."""

    def __init__(self, path, pass_on: Callable[[BaseException], None]):
        self.calls = 0
        add_noise = getattr(path, "add_noise", None)
        if add_noise is None:
            return

        def counted():
            self.calls += 1
            try:
                return add_noise()
            except BaseException as error:
                pass_on(error)
                raise

        path.add_noise = counted


def noise_cause(optimizer) -> tuple:
    """(name, value) of the factor of the noise's std the optimizer cannot draw with: max_grad_norm where it is not a
    finite number > 0, else noise_multiplier."""
    bound = getattr(optimizer, "max_grad_norm", None)
    try:
        valid = math.isfinite(float(bound)) and float(bound) > 0
    except (TypeError, ValueError):
        valid = False
    return ("max_grad_norm", bound) if not valid else ("noise_multiplier", getattr(optimizer, "noise_multiplier", None))


def plain_noise_fails(optimizer) -> bool:
    """Whether the optimizer's own add_noise raises on its noise multiplier, as Opacus draws it (std = noise_multiplier
    * max_grad_norm: a string, or a NaN or negative std other than 0); never for a value Opacus draws noise with."""
    sigma = getattr(optimizer, "noise_multiplier", None)
    if isinstance(sigma, str):
        return True
    if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real):
        return False
    try:
        std = sigma * optimizer.max_grad_norm
    except Exception:
        return False
    return isinstance(std, numbers.Real) and std != 0 and (math.isnan(std) or std < 0)


class StepPipeline:
    def __init__(self, kind, path, record: AuditRecord, *, paired: bool, check_every: int, observe_steps: Optional[int],
                 alarm: Callable[[], None], claims=None, findings=None):
        """`findings`: the audit's FindingSink (findings_sink.py), whose findings this pipeline records and alarms."""
        self.kind, self.path, self.record, self.claims = kind, path, record, claims
        if findings is not None:
            findings.connect(self.note_problem)
        if claims is not None:
            claims.on_change = self.follow_claim
        self.segment = 0  # the claim segment of the current claim (set when the claim changes)
        self.paired, self.check_every, self.observe_steps = paired, check_every, observe_steps
        self.alarm = alarm
        self.readings = PendingReadings()
        self.steps = 0
        self.failed = False  # the audit's own code raised: every later step is the plain one
        self.diverged: Optional[int] = None  # the step (from 1) training diverged at: every later step is plain
        self.raised: Optional[BaseException] = None  # the last error the audit raised itself (not the optimizer's)
        self._noise: Optional[NoiseCalls] = None
        self._passed: Optional[BaseException] = None  # raised by the alarm or the optimizer: never caught
        self._alarming = False

    def follow_claim(self, mechanism) -> None:
        """The optimizer's noise multiplier or clipping bounds changed: the next steps claim the new values, in a
        claim segment of their own. A noise multiplier of 0 claims nothing: the canaries keep the last claim, and no
        step is audited until it is positive again."""
        if mechanism.noise_multiplier == 0:
            return
        self.kind.set_claim(mechanism)
        if hasattr(self.path, "noise_std"):
            self.path.noise_std = mechanism.noise_multiplier * mechanism.max_grad_norm
        self.segment = self.record.open_claim(self.kind.layer_claims, 1.0 / mechanism.noise_multiplier)

    def audited_step(self) -> None:
        """Stands in for the optimizer's add_noise: plant -> release -> read -> record -> check."""
        if self._noise is None:
            self._noise = NoiseCalls(self.path, self._pass_on)
        past_window = self.observe_steps is not None and self.steps >= self.observe_steps
        if self.failed or self.diverged is not None or past_window:
            self.path.release_plain()  # past the observation window, after a fault or a divergence: the plain step
            if not self.failed:
                self.steps += 1
            return
        step, kind, noised = self.steps, self.kind, self._noise.calls
        try:
            if self.claims is not None and self.claims.before_step(step).noise_multiplier == 0:
                self._without_noise(step)  # this step's claim is void; a new one opens its segment
                return
            segment, readings = self.segment, []
            planted = kind.plant(step, all_in=self.paired)
            self.path.release(
                planted, step=step, paired=self.paired,
                read=lambda view: self._read(planted, view, step, readings),
                done=lambda: self._end_step(step, readings, segment),
            )
        except Exception as error:
            if error is self._passed or not self.path.local:
                if error is not self._passed:
                    self.raised = error  # the audit's own, under several processes
                self._finish_quietly()
                raise
            self.fail(error, step, noised=self._noise.calls > noised)
        except BaseException:
            self._finish_quietly()
            raise

    def _without_noise(self, step: int) -> None:
        """A step at noise multiplier 0: the finding no_noise at the first (claims/step_claim.py), then the plain release (no
        canary: read against a claim of 1 / 0 it would show nothing the finding does not) and the step's end."""
        if not any(found.code == NO_NOISE for found in self.record.problems):
            self.note_problem(NO_NOISE, no_noise_message(step + 1), step + 1)
        self.path.release_plain()
        self._end_step(step, [], self.segment)

    def _read(self, planted, view, step: int, readings: list) -> None:
        """The kind's reading of one release. A kind that reads on the host learns now whether the release is finite
        and reads nothing of one that is not; on the device that is seen with the readings at the next check."""
        if not self.kind.reads_on_device and not divergence.release_finite(view):
            self.diverge(step + 1)
            return
        readings.append(self.kind.read(planted, view))

    def _end_step(self, step: int, readings: list, segment: int) -> None:
        for reading in readings:  # a step's readings are pending once the step is complete
            self.readings.add(step, reading, segment)
        self.kind.finish_step()
        self.steps += 1
        if self.steps % self.check_every == 0 or self.steps == self.observe_steps:
            self.check()

    def record_pending(self) -> None:
        """Move the pending readings to the host and record them (no alarm: that waits for a check); from a step
        whose readings are not finite on, none."""
        readings = self.readings.flush()
        bad = divergence.nonfinite_steps(readings)
        if bad:
            self.diverge(min(bad))
        if self.diverged is not None:
            readings = [r for r in readings if r.step + 1 < self.diverged]
        self.record.add(readings, self.kind.name)

    def diverge(self, step: int) -> None:
        """Training diverged at `step` (from 1): recorded once, no alarm; nothing from it on is observed or checked."""
        if self.diverged is None:
            self.diverged = step
            self.record.note_problem(divergence.CODE, divergence.message(step), step, alarm=False)

    def diverged_by_now(self, agreed: bool = False) -> bool:
        """Whether training diverged by now: the pending readings first, then the parameters, gradients and clipped
        sums as they are (one host sync). `agreed`: where every rank calls it at the same step (the exact checks'),
        the ranks agree (under FSDP each holds other shards)."""
        if self.diverged is None:
            self.record_pending()
        finite = self.diverged is not None or divergence.training_finite(self.kind.probe.params)
        if agreed:
            finite = self.path.all_finite(finite)
        if self.diverged is None and not finite:
            self.diverge(self.steps + 1)
        return self.diverged is not None

    def check(self) -> None:
        """Record what is pending; alarm once if a violation is recorded and was not alarmed (on every rank
        at the same check). The alarm's own call of the results checks nothing."""
        self.record_pending()
        fired = self.record.fired(self.steps)
        if self.record.alerted or self._alarming:
            return
        due = fired or self.record.unalarmed()
        due = self.path.agree(due, lambda: self.record.fired(self.steps) or self.record.unalarmed(), self.note_problem_quietly)
        if due and not self.record.alerted:
            self._alarming = True
            try:
                self.alarm()
            finally:
                self._alarming = False
            self.record.alerted = True

    @contextmanager
    def delivering(self):
        """The alarm's delivery: from here it counts as given, and what it raises is passed on."""
        self.record.alerted = True
        try:
            yield
        except BaseException as error:
            self._pass_on(error)
            self.raised = error
            raise

    def note_problem(self, code: str, message: Optional[str], step: int, alarm: bool = True) -> None:
        """A set-up problem (a certainty): alarms at once on one process, at the next check under several
        (alarm=False: a fault that costs no privacy, reported among the findings). None once training diverged:
        what is compared then is non-finite."""
        if message and code != divergence.CODE and self.diverged_by_now():
            return
        if self.record.note_problem(code, message, step, alarm) and alarm and self.path.local:
            self.check()

    def passes_on(self, error: BaseException) -> bool:
        """Whether `error` is one the audit passes on (its alarm's, the optimizer's own): never a check's fault."""
        return error is self._passed

    def note_problem_quietly(self, code: str, message: str) -> None:
        self.record.note_problem(code, message, self.steps)

    # ------------------------------------------------------------------ faults

    def _pass_on(self, error: BaseException) -> None:
        self._passed = error

    def _finish_quietly(self) -> None:
        """Nothing of a failed step is kept (input canaries' gradients)."""
        try:
            self.kind.finish_step()
        except Exception:
            pass

    def fail(self, error: Exception, step: int, *, noised: bool) -> None:
        """Detach and record; the step's release as without the audit (when the optimizer's add_noise
        has not run, it runs once on the data's own sum, which the path restored; when it has, the
        path left the un-audited update); then one warning."""
        self._finish_quietly()
        self.failed = True
        cause = f"{type(error).__name__}: {error} at step {step + 1}"
        self.record.failed = self.record.failed or cause
        owner = getattr(getattr(self.path, "optimizer", None), "_dpaudit_auditor", None)
        try:
            if owner is not None:
                owner.detach()
        except Exception:  # the plain step from here on all the same (self.failed)
            pass
        optimizer = getattr(self.path, "optimizer", None)
        if not noised and plain_noise_fails(optimizer):
            # the optimizer's own add_noise would raise on its noise multiplier, as plain Opacus does: the step
            # cannot complete either way, and this error says why (before Opacus's own, a torch error)
            if "noise_multiplier" in str(error) or "max_grad_norm" in str(error):
                self.raised = error
                raise error
            name, value = noise_cause(optimizer)
            self.raised = ValueError(f"Unexpected value for the optimizer's {name}: {value!r}; the optimizer's own "
                                     "add_noise cannot draw noise with it (its std noise_multiplier * max_grad_norm "
                                     "must be a finite number > 0)")
            raise self.raised from error
        if not noised:
            for p in self.kind.probe.params:
                data = getattr(p, "summed_grad", None)
                if torch.is_tensor(data) and hasattr(data, "_processed"):
                    del data._processed  # marked noised when the path restored it; not noised yet
            self.path.release_plain()
        warnings.warn(
            f"the privacy audit stopped on an error of its own ({cause}) and detached itself; training goes on "
            "without it, each step as the optimizer makes it", AuditFailedWarning, stacklevel=2,
        )
