"""The accountant composes what the run released: every step, with the noise multiplier the step used.

Before each noised step the claim reader (claims/step_claim.py, claims/adaptive.py) compares the accountant's
history with the steps released so far: fewer composed steps than released, or a last entry whose noise
multiplier is not the one the previous step used (under adaptive clipping: larger than the joint multiplier of
the gradient's and the count's releases), is a certainty that the accountant's epsilon is too low.
"""

from __future__ import annotations

from ...claims.adaptive import CODE as ADAPTIVE_ACCOUNTING
from ...claims.step_claim import UNACCOUNTED
from ..base import MECHANISM, Check, RunView, StepSeen


class AccountantCheck(Check):
    name = "accountant"
    scope = MECHANISM
    codes = (UNACCOUNTED, ADAPTIVE_ACCOUNTING)

    def attach(self, run: RunView) -> None:
        self.run, self.claims, self.compared = run, run.claims, 0
        self.idle = self.claims is None or run.accountant is None  # no history to compare

    def step(self, seen: StepSeen) -> None:
        released = seen.step - 1  # the steps released before this one
        for code, message in self.claims.accounting_problems(released):
            self.run.report(code, message, released)
        self.compared += released > 0

    def status(self) -> str:
        return f"accountant ({self.compared} steps' composition compared)" if self.compared else ""
