"""Where every finding of the audit goes, built right after the record so that what is built later can report.

`report(code, message, step, alarm=True)` hands the finding to the step pipeline once it is built (it records it
and raises the alarm: pipeline.py); before that, to the record alone (no step has run, so there is nothing to alarm
at yet).
"""

from __future__ import annotations

from typing import Callable, Optional


class FindingSink:
    def __init__(self, record):
        self.record = record
        self._deliver: Optional[Callable] = None

    def connect(self, deliver: Callable) -> None:
        """The step pipeline's own note_problem, from when it is built."""
        self._deliver = deliver

    def report(self, code: str, message: Optional[str], step: int, alarm: bool = True) -> None:
        if self._deliver is not None:
            self._deliver(code, message, step, alarm)
        else:
            self.record.note_problem(code, message, step, alarm)
