"""A share of wall time for optional work (slow logging), so the audit stays cheap.

`spend(name)` is a context manager that says whether the work may run now: it may when
the time it took last time is within `share` of the wall time elapsed since it last
ran, and always when `share` is 1 (all of the time). Run or not, the block is timed only when allowed.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class TimeBudget:
    def __init__(self, share: float):
        self.share = share
        self._cost: dict = {}
        self._last: dict = {}

    @contextmanager
    def spend(self, name: str):
        now = time.perf_counter()
        cost, last = self._cost.get(name, 0.0), self._last.get(name)
        allowed = self.share >= 1.0 or last is None or cost <= self.share * (now - last)
        yield allowed
        if allowed:
            end = time.perf_counter()
            self._cost[name] = end - now
            self._last[name] = end
