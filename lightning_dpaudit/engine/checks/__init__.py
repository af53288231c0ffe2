"""Checks: every check of the audit is one unit behind one interface (base.Check), run by one runner (runner.py).

    base.py       the interface, the run's read-only view, a delivered batch, what a step was made of
    runner.py     dispatch of each hook to the checks that implement it; one check's fault stays its own
    defaults.py   the checks an audit runs unless given its own
"""

from .base import DATA_PATH, MECHANISM, PIPELINE, Batch, Check, RunView, StepSeen
from .runner import CheckRunner, CheckStoppedWarning

__all__ = ["Batch", "Check", "CheckRunner", "CheckStoppedWarning", "DATA_PATH", "MECHANISM", "PIPELINE", "RunView",
           "StepSeen"]
