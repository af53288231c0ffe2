"""FSDP (FSDPOptimizerFastGradientClipping): every tensor sharded by rows over the ranks.

Opacus's FSDP mode runs ghost clipping. Each rank clips its own samples; FSDP's
reduce-scatter leaves on rank r the rows it owns of f * sum_r S_r (f = 1/W for
loss_reduction "mean", 1 for "sum"); add_noise then adds, on every rank, noise of std
f * sigma * C to its own rows. So every coordinate is released once, by the rank that
owns it:

    R = f (S + N)        S = the data's clipped sum over all ranks, N ~ N(0, sigma^2 C^2)

Per audited step every rank takes the in-canaries' clipped sum K (through its module's own
ghost-clipping code, ghost.py, at the exact checks' steps, compared there with a correct
clipping; pre-clipped in between, per_sample.py) and adds f K at the coordinates it owns, so each
canary enters the release once, where it lives. After the optimizer's own add_noise each
rank reads (R - f S) / f at the pool coordinates it owns; one all-reduce of that vector
(zeros where a rank owns nothing) gives every rank the whole release at the pool, hence
the same observations and the same AuditResult. Then f K leaves the rows it entered: the
update is the un-audited one.
"""

from __future__ import annotations

import numpy as np
import torch

from ..canaries.base import Planted, ReleaseView
from ..canaries.gradient_probe import GradientProbe
from . import distributed as dist
from .base import DistributedChecks, PathSettings
from .per_sample import PerSampleRelease


class ShardedRelease(DistributedChecks, PerSampleRelease):
    local = False  # alarms wait for a check every rank reaches
    reads_on_device = False  # the per-step all-reduce reads on the host

    def __init__(self, optimizer, probe: GradientProbe, settings: PathSettings):
        super().__init__(optimizer, probe, settings)
        self.collectives = dist.Collectives()
        self.shards = [_row_shard(p) for p in probe.params]

    def _factor(self) -> float:
        return 1.0 / self.collectives.size if self.optimizer.loss_reduction == "mean" else 1.0

    def release(self, planted: Planted, *, step: int, paired: bool, read, done) -> None:
        opt, probe = self.optimizer, self.probe
        added = self.canary_sum(planted, planted.is_in, step)
        f = self._factor()
        owned = self._owned()
        summed = [opt.grad_state[p]["summed_grad"].to_local().view(-1) for p in probe.params]
        data = [s[idx] for s, (idx, _) in zip(summed, owned)]
        entered = [self._enter(s, cols, k, lohi, f) for s, cols, k, lohi in
                   zip(summed, added.columns, added.values, self.shards)]
        try:
            self.add_noise()
        finally:
            for s, (cols, _, saved) in zip(summed, entered):
                s[cols] = saved  # the data's own sum again
        released = [p.grad.to_local().view(-1) for p in probe.params]
        centered = np.zeros(len(probe.pool))
        for r, d, (idx, positions) in zip(released, data, owned):
            centered[positions] = ((r[idx] - d).double() / f).cpu().numpy()
        for r, (cols, values, _) in zip(released, entered):
            r.index_add_(0, cols, -values)  # the update is the un-audited one
        centered = self.collectives.sum(centered)
        read(ReleaseView(None, None, centered, probe.sum_at_pool(added), planted.is_in, own=True))
        done()

    def gather_pool(self, tensors) -> torch.Tensor:
        """Values at the pool coordinates this rank holds, zeros at the others (float64, pool order)."""
        out = torch.zeros(len(self.probe.pool), dtype=torch.float64, device=self.probe.pool_local[0].device)
        for t, (idx, positions) in zip(tensors, self._owned()):
            local = t.to_local() if hasattr(t, "to_local") else t
            out[torch.as_tensor(positions, device=out.device)] = local.detach().reshape(-1)[idx].double()
        return out

    def all_finite(self, finite: bool) -> bool:
        """Every rank holds other shards; the ranks agree, since they gather together at the exact checks' steps."""
        return not self.collectives.any(not finite)

    def summed_grads(self) -> list:
        """FSDP's optimizer keeps its accumulated sums in grad_state, not on the tensors."""
        return [self.optimizer.grad_state[p]["summed_grad"] for p in self.probe.params]

    def _owned(self) -> list:
        """Per tensor: (local flat indices, pool positions) of the pool coordinates this rank holds."""
        out, start = [], 0
        for idx, (lo, hi) in zip(self.probe.pool_local, self.shards):
            mine = (idx >= lo) & (idx < hi)
            out.append((idx[mine] - lo, start + torch.nonzero(mine).reshape(-1).cpu().numpy()))
            start += len(idx)
        return out

    @staticmethod
    def _enter(flat: torch.Tensor, columns, values, shard, f: float):
        """f K into this rank's rows of the summed gradient: (local columns, values added, values replaced)."""
        lo, hi = shard
        mine = (columns >= lo) & (columns < hi)
        cols, vals = columns[mine] - lo, values[mine].to(flat.dtype) * f
        saved = flat[cols].clone()
        flat.index_add_(0, cols, vals)
        return cols, vals, saved


def _row_shard(p) -> tuple:
    """[lo, hi): the flat coordinates of the full tensor held by this rank (FSDP2 shards dim 0)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return 0, p.numel()
    if tuple(p.placements) != (Shard(0),):
        raise TypeError(f"the FSDP audit reads tensors sharded by rows (Shard(0)); got placements {p.placements}")
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    row = int(np.prod(p.shape[1:])) if p.dim() > 1 else 1
    lo = int(offset[0]) * row
    return lo, lo + int(np.prod(shape))
