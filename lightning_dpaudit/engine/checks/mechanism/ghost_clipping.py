"""Ghost clipping's own code, as the canaries' rows go through it (release/ghost.py).

Under ghost clipping the module computes per-sample norms and clipping coefficients; the canaries' rows pass
through the module's own norm samplers and get_clipping_coef at every audited step, with one more sample of norm
C / 2. What that shows is reported here, dated at the step being released:

    per_sample_gradients   a tensor the optimizer noises has no per-sample norms (never clipped)
    clipping_scales_up     the coefficient for norm C / 2 exceeds 1: gradients normalized, not clipped (no alarm)
"""

from __future__ import annotations

from ..base import DATA_PATH, Check, RunView


class GhostClippingCheck(Check):
    name = "ghost clipping"
    scope = DATA_PATH
    codes = ("per_sample_gradients", "clipping_scales_up")

    def attach(self, run: RunView) -> None:
        self.run, self.ghost = run, run.ghost_clipping
        if self.ghost is not None:
            self.ghost.note_problem = self._found

    def _found(self, code: str, message: str, alarm: bool) -> None:
        self.run.report(code, message, self.run.steps() + 1, alarm)

    def close(self) -> None:
        if self.ghost is not None:
            self.ghost.note_problem = lambda code, message, alarm: None
