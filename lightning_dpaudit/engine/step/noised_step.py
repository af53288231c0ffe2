"""What the optimizer's add_noise does while an auditor is attached, and what it makes of Opacus's own errors.

At each noised step: a clipping bound that cannot give noise is named first; at the exact checks' steps the
training is tested for divergence (under FSDP every rank together); a diverged run takes the plain step; else the
checks' step hook, then their around_step wrappers around the audited step (checks/runner.py, pipeline.py). An error of the audit's own code
before the audited step fails the audit as one inside it would (detached, the step released as without it); what
the audited step raises is its own to pass on.
"""

from __future__ import annotations

from .opacus_step import CODE as OPACUS_ERROR
from .pipeline import noise_cause


def canary_clipping(check, step: int) -> str:
    """How the canaries are clipped at `step`, given the exact check `check`: through the optimizer's own clipping,
    compared with a correct clipping, at its steps ("compared"); as a correct clipping leaves them in between
    ("correct"); where the exact checks are off, stopped or not run, through the optimizer's clipping at every step
    ("optimizer": nothing else then verifies clipping)."""
    if check is None or check.every == 0 or check.stopped is not None:
        return "optimizer"
    return "compared" if check.due(step) else "correct"


class NoisedStep:
    """Stands in for the optimizer's add_noise while attached (the release path calls it)."""

    def __init__(self, optimizer, pipeline, exact, checks, path):
        """`exact`: the exact check that schedules the replays (None when none runs); `checks`: the CheckRunner."""
        self.optimizer, self.pipeline, self.path = optimizer, pipeline, path
        self.exact, self.checks = exact, checks

    def __call__(self) -> None:
        pipeline, exact, entered = self.pipeline, self.exact, False

        def audited_step():
            nonlocal entered
            entered = True
            pipeline.audited_step()

        try:
            if not pipeline.failed and noise_cause(self.optimizer)[0] == "max_grad_norm":  # set to NaN, 0 or below
                bound = self.optimizer.max_grad_norm  # named now, not taken for a divergence of the values it gives
                raise ValueError(f"Unexpected value for the optimizer's max_grad_norm: {bound!r}; clipping needs a "
                                 "finite bound > 0")
            if pipeline.diverged is None and not pipeline.failed and exact is not None and (
                    exact.due(pipeline.steps) or exact.meets_the_others(pipeline.steps)):
                pipeline.diverged_by_now(agreed=True)  # under FSDP every rank at the cadence's steps
            if pipeline.diverged is not None:
                if exact is not None:
                    exact.close()
                audited_step()  # the plain step
                return
            self.checks.step(pipeline.steps + 1)
            self.checks.around_step(pipeline.steps + 1, audited_step)
        except Exception as error:
            if entered or pipeline.failed or not self.path.local or pipeline.passes_on(error):
                if not entered and not pipeline.passes_on(error):
                    pipeline.raised = error  # the audit's own
                raise
            pipeline.fail(error, pipeline.steps, noised=False)

    def opacus_error(self, error: BaseException, step: int, released: bool) -> None:
        """Opacus's own step raised `error` at `step` (opacus_step.py passes it on): recorded, no alarm. After the
        step's release the claim check follows the accountant's history as it is (the step may not be composed)."""
        if released and self.pipeline.claims is not None:
            self.pipeline.claims.resync(self.pipeline.steps)
        where = ("after the step's release, so the step may be neither applied nor composed by the accountant; the "
                 "later steps are checked against the accountant's history as it is" if released
                 else "before the step's release")
        self.pipeline.note_problem(OPACUS_ERROR, f"Opacus's own step raised {type(error).__name__}: {error} at step "
                                   f"{step}, {where} (the error was passed on)", step, False)
