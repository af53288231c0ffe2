"""One audited step: plant -> release -> read -> record -> check.

Before planting, the step's claim is read from the optimizer (claims.py): noise and
clipping schedules change it between steps.

    plant    the canary kind draws this step's canaries               (kinds/)
    release  the release path puts them through the optimizer's own   (paths/)
             clipping and noise, and leaves the un-audited update
    read     the kind reads each release: observations and sentinel
             noise, kept on the parameters' device                      (readings.py)
    record   at a check, every pending reading moves to the host at
             once: log, monitor, noise fingerprints                     (analysis/record.py)
    check    alarms that fired since the last check are raised once

Checks come every `check_every` steps (and whenever results or state are asked for).
The monitor tests the counts after every step of a batch, so a violation is recorded at
the step a check after every step would record; it is raised at most check_every - 1
steps later. Under several processes every rank checks at the same steps.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..analysis.record import AuditRecord
from .readings import PendingReadings


class StepPipeline:
    def __init__(self, kind, path, record: AuditRecord, *, paired: bool, check_every: int, observe_steps: Optional[int],
                 alarm: Callable[[], None], claims=None):
        self.kind, self.path, self.record, self.claims = kind, path, record, claims
        self.segment = 0  # the claim segment of the current claim (set when the claim changes)
        self.paired, self.check_every, self.observe_steps = paired, check_every, observe_steps
        self.alarm = alarm
        self.readings = PendingReadings()
        self.steps = 0

    def audited_step(self) -> None:
        """Stands in for the optimizer's add_noise: plant -> release -> read -> record -> check."""
        if self.observe_steps is not None and self.steps >= self.observe_steps:
            self.path.release_plain()  # past the observation window: the plain step
            self.steps += 1
            return
        step, kind = self.steps, self.kind
        try:
            if self.claims is not None:
                self.claims.before_step(step)  # this step's claim; a new one opens its segment
            segment = self.segment
            planted = kind.plant(step, all_in=self.paired)
            self.path.release(
                planted, step=step, paired=self.paired,
                read=lambda view: self.readings.add(step, kind.read(planted, view), segment),
                done=self._end_step,
            )
        except BaseException:
            kind.finish_step()  # nothing of a failed step is kept (input canaries' gradients)
            raise

    def _end_step(self) -> None:
        self.kind.finish_step()
        self.steps += 1
        if self.steps % self.check_every == 0:
            self.check()

    def record_pending(self) -> None:
        """Move the pending readings to the host and record them (no alarm: that waits for a check)."""
        self.record.add(self.readings.flush(), self.kind.name)

    def check(self) -> None:
        """Record what is pending; raise the alarm once if a test fired (on every rank at the same check)."""
        self.record_pending()
        fired = self.record.fired(self.steps)
        if not self.record.alerted:
            fired = self.path.agree(fired, lambda: self.record.fired(self.steps), self.note_problem_quietly)
        if fired and not self.record.alerted:
            self.record.alerted = True
            self.alarm()

    def note_problem(self, code: str, message: Optional[str], step: int, alarm: bool = True) -> None:
        """A set-up problem (a certainty): alarms at once on one process, at the next check under several
        (alarm=False: a fault that costs no privacy, reported among the findings)."""
        if self.record.note_problem(code, message, step, alarm) and alarm and self.path.local:
            self.check()

    def note_problem_quietly(self, code: str, message: str) -> None:
        self.record.note_problem(code, message, self.steps)
