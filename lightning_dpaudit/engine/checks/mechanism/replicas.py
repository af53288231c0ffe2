"""Every replica of a data-parallel run holds the same parameters.

Under a DistributedDPOptimizer every rank applies the one reduced, noised gradient, so the replicas stay
identical; one that drifts trains a model the noise does not protect. Every `every` noised steps (from the
first) each rank sums its tensors' values and squares in float64 (release/distributed.py), one all-reduce
gathers every rank's sums, and a tensor whose sums differ between ranks is named: replica_drift, a certainty.
"""

from __future__ import annotations

from typing import Optional

from ...release import distributed as dist
from ..base import MECHANISM, Check, RunView, StepSeen

CODE = "replica_drift"


class ReplicaCheck(Check):
    name = "replicas"
    scope = MECHANISM
    codes = (CODE,)

    def __init__(self, every: Optional[int] = None):
        """every: the noised steps between comparisons (None: the audit's checksum_every; 0: never)."""
        self.every = every

    def attach(self, run: RunView) -> None:
        self.run, self.compared = run, 0
        if self.every is None:
            self.every = run.checksum_every
        self.idle = not (self.every > 0 and dist.is_reducing(run.optimizer) and dist.world_size() > 1)
        self.collectives = None if self.idle else dist.Collectives()

    def step(self, seen: StepSeen) -> None:
        if (seen.step - 1) % self.every:
            return
        c = self.collectives
        by_rank = c.sum(c.own_slot(dist.parameter_checksums(self.run.params))).reshape(c.size, -1)
        self.compared += 1
        drifted = dist.drifted_tensors(by_rank, self.run.names)
        if drifted:
            self.run.report(CODE, (
                f"the replicas' parameters differ at step {seen.step} ({', '.join(drifted[:4])}"
                f"{', ...' if len(drifted) > 4 else ''}): the ranks train different models, so the released model "
                "is not the one the noise protects. Every rank must apply the same reduced gradient: use the "
                "DistributedDPOptimizer's own step and do not change gradients or parameters on one rank only."
            ), seen.step)

    def status(self) -> str:
        return "" if self.idle else f"replicas ({self.compared} comparisons of every rank's parameters)"
