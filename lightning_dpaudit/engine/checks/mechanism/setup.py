"""Facts of the run's set-up, read when the audit attaches (and, for the sample rate, when the epoch's length is
known): each a certainty about the claim, or a note on what the claim does not cover.

    unreconciled_noise   a plain DPOptimizer in a job of several processes: each rank noises its own share
    sample_rate          an accountant whose sample rate ignores the world size (release/distributed.py)
    normalisation        (a note) the update divided by a batch size derived from the dataset's size
"""

from __future__ import annotations

from ...claims.step_claim import normalisation_problem
from ...release import distributed as dist
from ..base import MECHANISM, Check, RunView


class SetupCheck(Check):
    name = "set-up"
    scope = MECHANISM
    codes = ("unreconciled_noise", "sample_rate")

    def attach(self, run: RunView) -> None:
        self.run = run
        self.normalisation = normalisation_problem(run.optimizer)
        self.run.report("unreconciled_noise", dist.unreconciled_noise_problem(run.optimizer), 0)

    def batches_per_epoch(self, batches: int) -> None:
        """The epoch's length on this rank is known: the accountant's sample rate compared with it."""
        rate = dist.sample_rate_of(self.run.optimizer)
        self.run.report("sample_rate", dist.sample_rate_problem(rate, batches, dist.world_size()), self.run.steps())

    def notes(self) -> list:
        return [("normalisation", self.normalisation)] if self.normalisation else []
