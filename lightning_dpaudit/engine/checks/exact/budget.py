"""The exact checks' share of a run's wall time (per_sample.py; the callback's slow logging has
its own, integrations/budget.py).

With T the wall time since the first step, S the time the checks took after the first checked
step's (never skipped, and the dearest: it warms up) and c what the last checked step's took, a
step on the checks' cadence is checked only when S + c <= share * T: over a run the checks take at
most `share` of its time, plus the first check, while a check costs what the last one did.
"""

from __future__ import annotations

import contextlib
import time
from typing import Optional


class CheckBudget:
    def __init__(self, share: float):
        self.share = share
        self.started: Optional[float] = None  # perf_counter at the first decision
        self.spent = 0.0  # seconds spent in timed() blocks
        self.last_cost = 0.0  # seconds the last checked step's checks took
        self.first_cost: Optional[float] = None  # seconds the first checked step's took (not counted against share)
        self.skipped = 0  # steps on the cadence refused for the budget
        self._spent_before = 0.0  # `spent` at the last decision

    def decide(self, on_cadence: bool, first: bool) -> bool:
        """Whether a step is checked: on the cadence, and (unless it is the first check) within the share."""
        now = time.perf_counter()
        if self.started is None:
            self.started = now
        self._spent_before = self.spent
        if not on_cadence or first or self.share >= 1.0:
            return on_cadence
        if self.spent - (self.first_cost or 0.0) + self.last_cost > self.share * (now - self.started):
            self.skipped += 1
            return False
        return True

    @contextlib.contextmanager
    def timed(self):
        """Count the block's time as the checks'."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spent += time.perf_counter() - start

    def step_checked(self) -> None:
        """The decided step's checks are done: what they took is the next step's estimate."""
        self.last_cost = self.spent - self._spent_before
        if self.first_cost is None:
            self.first_cost = self.last_cost

    def elapsed(self) -> float:
        """Seconds of wall time since the first decision (T)."""
        return 0.0 if self.started is None else time.perf_counter() - self.started
