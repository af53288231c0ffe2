"""Tensor plumbing between canaries and an Opacus optimizer's parameters.

Canaries enter as extra per-sample gradient rows that the optimizer's own
`clip_and_accumulate` clips and sums into a fresh `summed_grad`, so what they added is
known exactly; observations are read from the released gradient at the pool
coordinates only.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np
import torch

from .canaries import StepCanaries


class GradientProbe:
    def __init__(self, params: Sequence[torch.Tensor], pool: Sequence[np.ndarray], clip_bounds: np.ndarray, scale: float):
        self.params = list(params)
        self.sizes = [p.numel() for p in self.params]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        device = self.params[0].device
        self.pool = torch.as_tensor(np.concatenate([idx + off for idx, off in zip(pool, self.offsets)]), device=device)
        self.clip_bounds = np.asarray(clip_bounds, dtype=float)
        self.scale = float(scale)
        self._rows = None  # reusable (k, P) buffer of canary rows
        self._set = None  # (rows, cols) written last time, to zero them again

    def canary_rows(self, canaries: StepCanaries, which: np.ndarray) -> List[torch.Tensor]:
        """Per-sample gradient rows, one per selected canary: scale * C_l * w on its support."""
        chosen = np.flatnonzero(which)
        p0 = self.params[0]
        if self._rows is None or self._rows.shape[0] != len(chosen) or self._rows.dtype != p0.dtype:
            self._rows = torch.zeros((len(chosen), int(self.offsets[-1])), dtype=p0.dtype, device=p0.device)
        elif self._set is not None:
            self._rows[self._set] = 0
        if len(chosen):
            tensor = canaries.tensor[chosen]
            cols = torch.as_tensor((self.offsets[tensor][:, None] + canaries.coords[chosen]).ravel())
            rows = torch.as_tensor(np.repeat(np.arange(len(chosen)), canaries.coords.shape[1]))
            vals = canaries.weights[chosen] * (self.scale * self.clip_bounds[tensor])[:, None]
            self._rows[rows, cols] = torch.as_tensor(vals.ravel(), dtype=p0.dtype)
            self._set = (rows, cols)
        pieces = torch.split(self._rows, self.sizes, dim=1)
        return [piece.reshape(len(chosen), *p.shape) for piece, p in zip(pieces, self.params)]

    def clip_alone(self, optimizer, rows: List[torch.Tensor]) -> List[torch.Tensor]:
        """What the optimizer's own clip_and_accumulate adds for these rows alone.

        summed_grad and grad_sample are swapped out for the call and restored after.
        """
        saved = [(getattr(p, "grad_sample", None), p.summed_grad) for p in self.params]
        try:
            for p, r in zip(self.params, rows):
                p.grad_sample = r
                p.summed_grad = None
            optimizer.clip_and_accumulate()
            return [p.summed_grad for p in self.params]
        finally:
            for p, (sample, summed) in zip(self.params, saved):
                p.grad_sample = sample
                p.summed_grad = summed

    def at_pool(self, tensors: Sequence[torch.Tensor]) -> np.ndarray:
        """Values of per-parameter tensors at the pool coordinates, as float64."""
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        return flat[self.pool].double().cpu().numpy()

    def project(self, pool_values: np.ndarray, canaries: StepCanaries) -> np.ndarray:
        """Normalized observation of each canary: <w, values on its support> / C_l."""
        on_support = pool_values[canaries.pool_index]
        return np.sum(canaries.weights * on_support, axis=1) / self.clip_bounds[canaries.tensor]
