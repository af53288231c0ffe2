"""An exact check of accumulation across physical batches, at the pool coordinates.

At a checked step, before the optimizer folds each physical batch b into summed_grad
(its own `clip_and_accumulate`, or `accumulate` under ghost clipping), the ledger adds
that batch's clipped sum at the pool coordinates P, computed on its own:

    hooks, functorch   L += sum_i c_i g_i[P],  c_i = min(1, C / (||g_i|| + 1e-6))   (per tensor
                       with its own bound under per-layer clipping), from p.grad_sample
    ghost clipping     L += p.grad[P]   (the batch's clipped sum the second backward pass left)

At the noised step summed_grad[P] must equal L. A physical batch dropped or counted twice
(Opacus 1.5.x's ghost accumulation kept p.grad itself as summed_grad) breaks the equality:
finding `per_sample_gradients`. Memory: one value per pool coordinate. Under FSDP each rank compares the pool coordinates it holds.
"""

from __future__ import annotations

from typing import Optional

import torch

RTOL = 1e-3


class AccumulationLedger:
    def __init__(self, optimizer, probe, *, ghost: bool, per_layer: bool, path):
        self.optimizer, self.probe, self.ghost, self.per_layer = optimizer, probe, ghost, per_layer
        self.gather = path.gather_pool  # values at the pool (under FSDP: at the coordinates this rank holds)
        self.summed = path.summed_grads  # the optimizer's accumulated sums, where the optimizer keeps them
        self.total: Optional[torch.Tensor] = None
        self.batches = 0
        self.eps = 0.0  # unit roundoff of the lowest precision the batches' per-sample values were held in

    def add(self) -> None:
        """One physical batch, before the optimizer accumulates it."""
        params = self.probe.params
        if self.ghost:
            held = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
            part = self.gather(held)
        else:
            held = [torch.cat(p.grad_sample) if isinstance(p.grad_sample, list) else p.grad_sample for p in params]
            part = self._clipped_sum_at_pool(held)
        self.eps = max([self.eps] + [float(torch.finfo(t.dtype).eps) for t in held if t.dtype.is_floating_point])
        self.total = part if self.total is None else self.total + part
        self.batches += 1

    def _clipped_sum_at_pool(self, samples) -> torch.Tensor:
        flat = [s.reshape(s.shape[0], -1) for s in samples]
        squares = torch.stack([f.norm(2, dim=1).double() ** 2 for f in flat])  # (tensors, batch); no copy of the rows
        if self.per_layer:  # DPPerLayerOptimizer: each tensor clipped to its own bound
            bounds = torch.as_tensor(self.optimizer.max_grad_norms, dtype=torch.float64, device=squares.device)
            factors = (bounds[:, None] / (squares.sqrt() + 1e-6)).clamp(max=1.0)
        else:
            C = float(self.optimizer.max_grad_norm)
            factors = (C / (squares.sum(dim=0).sqrt() + 1e-6)).clamp(max=1.0).expand_as(squares)
        return torch.cat([f[:, idx].double().T @ c for f, idx, c in zip(flat, self.probe.pool_local, factors)])

    def problem(self, eps: float = 0.0) -> Optional[str]:
        """At the noised step: summed_grad against the ledger; the ledger starts over.

        Tolerance: relative 1e-3, or 4 unit roundoffs of the lowest precision the batches were
        computed in (`eps` from the forward pass, or the per-sample gradients' own dtype)."""
        total, batches, low = self.total, self.batches, max(self.eps, eps)
        self.total, self.batches, self.eps = None, 0, 0.0
        if total is None:
            return None
        held = self.gather([torch.zeros_like(p) if s is None else s for p, s in zip(self.probe.params, self.summed())])
        gap = float((held - total).norm())
        scale = max(float(held.norm()), float(total.norm()))
        if gap <= max(RTOL, 4 * low) * scale + 1e-5 * float(self.optimizer.max_grad_norm):
            return None
        source = "each batch's clipped sum" if self.ghost else "each example's gradient clipped to C"
        return (f"the optimizer's clipped and accumulated sum over {batches} physical batch(es) differs from the sum "
                f"of {source} (norm {float(held.norm()):.6g} against {float(total.norm()):.6g} at {len(total)} "
                "coordinates): examples clipped wrongly or not at all, or a physical batch dropped or counted twice")
