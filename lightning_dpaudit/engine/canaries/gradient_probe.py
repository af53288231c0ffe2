"""Tensor plumbing between canaries and an Opacus optimizer's parameters.

Canaries enter as extra per-sample gradient rows that the optimizer's own
`clip_and_accumulate` clips and sums (under ghost clipping, the module's own norms and
coefficients: ghost.py), so what they add (K) is known exactly.

Compressed rows. A gradient canary touches `support` coordinates of one tensor, so its
row is zero almost everywhere. The probe gives the optimizer, for each tensor l, rows
over only the coordinates that this step's canaries in l touch: a (k, m_l) matrix
instead of (k, *shape_l). Opacus's clipping computes per-row norms over whatever
`grad_sample` holds and sums the clipped rows, so the norms, clip factors and sums are
exactly those of the full rows restricted to those coordinates, and K_l comes back as a
vector over them. Memory per step is k x (k x support), whatever the model's size.
An optimizer whose clipping needs parameter-shaped rows (it raises, or returns sums of
another shape) gets dense rows from then on, with one warning naming the cost.

Observations are read from the released gradient at the pool coordinates only,
gathered tensor by tensor (no whole-model copy).
"""

from __future__ import annotations

import warnings
from typing import List, Optional, Sequence

import numpy as np
import torch

from .gradient_canaries import StepCanaries

CLIP_TOLERANCE = 1e-4  # relative gap between the optimizer's clipped canary sum and correct clipping (float32 sums)


class CompressedRowsFallbackWarning(UserWarning):
    """The optimizer's clipping needs parameter-shaped canary rows."""


def correctly_clipped(weights: np.ndarray, bounds: np.ndarray, scale: float) -> np.ndarray:
    """Canary rows as a correct clipping leaves them (float64; weights (..., support), bounds their tensors' C_l):

        row * min(1, C_l / (||row|| + 1e-6)),   row = scale * C_l * w   (Opacus's clip factor)"""
    rows = weights * (scale * bounds)[..., None]
    return rows * np.minimum(1.0, bounds / (np.linalg.norm(rows, axis=-1) + 1e-6))[..., None]


class CanarySum:
    """K: what the optimizer's clipping made of this step's in-canary rows, per tensor.

    columns[l] is None where K_l is parameter-shaped (dense rows), else the flat
    coordinates of tensor l that the vector K_l covers.
    """

    def __init__(self, values: List[torch.Tensor], columns: Sequence[Optional[torch.Tensor]], pool_positions=None):
        self.values = values
        self.columns = list(columns)
        self.pool_positions = pool_positions  # compressed: the pool position of every column, in order
        self.at_sentinels: Optional[torch.Tensor] = None  # K at the sentinels (float64), where computed in advance
        self.negated: Optional[List[torch.Tensor]] = None  # -K per tensor, where it was computed in advance
        self._saved: list = []

    @property
    def dense(self) -> bool:
        return self.columns[0] is None

    def enter(self, params) -> None:
        """summed_grad becomes data + K (in place at the columns, the data's values kept)."""
        self._saved = []
        for p, k, cols in zip(params, self.values, self.columns):
            s = p.summed_grad
            if cols is None:
                self._saved.append(s)
                p.summed_grad = s + k.view_as(s)
            else:
                self._saved.append(s.take(cols))  # a copy, the flat tensor's values at the columns
                s.put_(cols, k if k.dtype == s.dtype else k.to(s.dtype), accumulate=True)
                if hasattr(s, "_processed"):  # a second privatization of the same sum (paired mode)
                    del s._processed

    def leave(self, params) -> None:
        """summed_grad back to exactly the data's own sum."""
        for p, saved, cols in zip(params, self._saved, self.columns):
            if cols is None:
                p.summed_grad = saved
            else:
                p.summed_grad.put_(cols, saved)
        self._saved = []

    def remove_from(self, tensors) -> None:
        """tensor -= K for each released gradient: the update becomes the un-audited one."""
        negated = self.negated if self.negated is not None else [None if c is None else -k for k, c in
                                                                 zip(self.values, self.columns)]
        for t, k, minus_k, cols in zip(tensors, self.values, negated, self.columns):
            if cols is None:
                t.sub_(k.view_as(t))
            else:
                t.put_(cols, minus_k if minus_k.dtype == t.dtype else minus_k.to(t.dtype), accumulate=True)


class GradientProbe:
    def __init__(self, params: Sequence[torch.Tensor], pool: Sequence[np.ndarray], clip_bounds: np.ndarray, scale: float):
        self.params = list(params)
        self.sizes = [p.numel() for p in self.params]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        self.set_pool(pool)
        self.clip_bounds = np.asarray(clip_bounds, dtype=float)
        self.scale = float(scale)
        self.dense = False  # set once when the optimizer's clipping refuses compressed rows
        self.ghost = None  # a GhostClipping where the optimizer's clipping is ghost clipping (ghost.py)

    def set_pool(self, pool: Sequence[np.ndarray]) -> None:
        """The fixed coordinates observations are read at: one sorted index array per tensor."""
        device = self.params[0].device
        self.pool_local = [torch.as_tensor(np.asarray(idx, dtype=np.int64), device=device) for idx in pool]
        self.pool = torch.as_tensor(np.concatenate([np.asarray(idx) + off for idx, off in zip(pool, self.offsets)]), device=device)

    # ------------------------------------------------------------------ canary rows

    def canary_rows(self, canaries: StepCanaries, which: np.ndarray):
        """(rows, columns): compressed per-sample rows of the selected canaries, per tensor.

        Row r holds scale * C_l * w_r on its own coordinates; the columns of tensor l are
        the coordinates of the selected canaries in l, in order. Canaries of one step
        never share a coordinate, so each column belongs to one row.
        """
        chosen = np.flatnonzero(which)
        tensor = canaries.tensor[chosen]
        order = np.argsort(tensor, kind="stable")  # columns grouped by tensor (already so for the sampler's layout)
        chosen, tensor = chosen[order], tensor[order]
        k, support = len(chosen), canaries.coords.shape[1]
        p0 = self.params[0]
        vals = canaries.weights[chosen] * (self.scale * self.clip_bounds[tensor])[:, None]
        block = torch.zeros((k, k, support), dtype=p0.dtype, device=p0.device)
        diagonal = torch.arange(k, device=p0.device)
        block[diagonal, diagonal] = torch.as_tensor(vals, dtype=p0.dtype, device=p0.device)
        counts = (np.bincount(tensor, minlength=len(self.params)) * support).tolist()
        pieces = list(torch.split(block.view(k, k * support), counts, dim=1))
        coords = torch.as_tensor(canaries.coords[chosen].ravel(), device=p0.device)
        columns = list(torch.split(coords, counts))
        self._pool_positions = canaries.pool_index[chosen].ravel()
        if self.dense:
            return self._dense_rows(pieces, columns), [None] * len(self.params)
        return pieces, columns

    def preclipped(self, canaries: StepCanaries, which: np.ndarray) -> CanarySum:
        """K as a correct clipping leaves the selected canaries' rows (the columns of `canary_rows`, in order):

            K_r = row_r * min(1, C_l / (||row_r|| + 1e-6)),   row_r = scale * C_l * w_r,

        Opacus's clip factor for a row that lies in one tensor (flat or per-layer: the row's norm is its norm in
        l), computed in float64 on the host and planted as is: no pass through the optimizer."""
        chosen = np.flatnonzero(which)
        tensor = canaries.tensor[chosen]
        order = np.argsort(tensor, kind="stable")
        chosen, tensor = chosen[order], tensor[order]
        p0 = self.params[0]
        clipped = correctly_clipped(canaries.weights[chosen], self.clip_bounds[tensor], self.scale)
        values = torch.as_tensor(clipped.ravel(), dtype=p0.dtype, device=p0.device)
        counts = (np.bincount(tensor, minlength=len(self.params)) * canaries.coords.shape[1]).tolist()
        columns = torch.split(torch.as_tensor(canaries.coords[chosen].ravel(), device=p0.device), counts)
        return CanarySum(list(torch.split(values, counts)), columns, canaries.pool_index[chosen].ravel())

    def clipping_problem(self, clipped: CanarySum, expected: CanarySum, names: Sequence[str]) -> Optional[str]:
        """A sentence naming the tensors where the optimizer's clipping of the canary rows is not `expected` (float32
        rounding aside), or None."""
        got, want = self.sum_at_pool(clipped), self.sum_at_pool(expected)
        tolerance = CLIP_TOLERANCE * max(float(np.max(np.abs(want), initial=0.0)), 1e-30)
        ends = np.cumsum([len(idx) for idx in self.pool_local])
        wrong = [i for i, (a, b) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends))
                 if np.max(np.abs(got[a:b] - want[a:b]), initial=0.0) > tolerance]
        if not wrong:
            return None
        size = float(np.linalg.norm(got)) / max(float(np.linalg.norm(want)), 1e-300)
        shown = ", ".join(f"`{names[i]}`" for i in wrong[:5]) + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else "")
        return (f"the optimizer's clipping of the canary rows (norm {self.scale:g} C each, one tensor each) is not "
                f"clipping to C in {shown}: the canaries' clipped sum is {size:.4g} times a correct clipping's "
                "(per-example clipping missing or wrong there)")

    def _dense_rows(self, pieces, columns) -> List[torch.Tensor]:
        """Parameter-shaped rows with the compressed values at their columns."""
        dense = []
        for piece, cols, p in zip(pieces, columns, self.params):
            full = torch.zeros((piece.shape[0], p.numel()), dtype=piece.dtype, device=piece.device)
            full[:, cols] = piece
            dense.append(full.reshape(piece.shape[0], *p.shape))
        return dense

    # ------------------------------------------------------------------ the optimizer's own clipping

    def clip(self, optimizer, rows: List[torch.Tensor], columns) -> CanarySum:
        """K for these rows through the optimizer's own clip_and_accumulate.

        Compressed rows whose clipping fails, or comes back in another shape, are retried
        as dense rows; the probe then stays dense for the rest of the run.
        """
        if columns[0] is None:
            return CanarySum(self._clip_alone(optimizer, rows), columns)
        if self.ghost is not None:  # ghost clipping reads compressed rows as they are
            return CanarySum([s.reshape(-1) for s in self.ghost.sums(rows, columns)], columns, self._pool_positions)
        try:
            sums = self._clip_alone(optimizer, rows)
            if all(s.numel() == r.shape[1] for s, r in zip(sums, rows)):
                return CanarySum([s.reshape(-1) for s in sums], columns, self._pool_positions)
            problem = "returned sums of another shape"
        except (RuntimeError, ValueError, IndexError, TypeError) as error:
            problem = f"raised {type(error).__name__}: {error}"
        self.dense = True
        total = int(self.offsets[-1])
        warnings.warn(
            f"{type(optimizer).__name__}.clip_and_accumulate {problem} on compressed canary rows; using "
            f"parameter-shaped rows from now on: {rows[0].shape[0]} rows x {total:,} parameters "
            f"(about {rows[0].shape[0] * total * rows[0].element_size() / 2**20:,.0f} MB) per step",
            CompressedRowsFallbackWarning,
            stacklevel=4,
        )
        return CanarySum(self._clip_alone(optimizer, self._dense_rows(rows, columns)), [None] * len(self.params))

    def _clip_alone(self, optimizer, rows: List[torch.Tensor]) -> List[torch.Tensor]:
        """What clip_and_accumulate sums for these rows alone (grad_sample and summed_grad swapped out)."""
        if self.ghost is not None:
            return self.ghost.sums(rows, [None] * len(rows))
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

    # ------------------------------------------------------------------ reading

    def gather(self, *tensor_lists: Sequence[torch.Tensor]) -> torch.Tensor:
        """Values of per-parameter tensors at the pool coordinates, float64 on their device (gathered per tensor;
        several lists of them: one after the other)."""
        with torch.no_grad():
            return torch.cat([t.take(idx) for tensors in tensor_lists for t, idx in zip(tensors, self.pool_local)]).double()

    def difference(self, tensors: Sequence[torch.Tensor], others: Sequence[torch.Tensor]) -> torch.Tensor:
        """gather(tensors) - gather(others), in one gather of both."""
        both, n = self.gather(tensors, others), len(self.pool)
        return both[:n] - both[n:]

    def at_pool(self, tensors: Sequence[torch.Tensor]) -> np.ndarray:
        """`gather` on the host, as a numpy float64 array."""
        return self.gather(tensors).cpu().numpy()

    def gather_sum(self, added: CanarySum) -> torch.Tensor:
        """K at the pool coordinates, float64 on the parameters' device."""
        if added.dense:
            return self.gather(added.values)
        out = torch.zeros(len(self.pool), dtype=torch.float64, device=self.pool.device)
        positions = torch.as_tensor(added.pool_positions, device=out.device)
        out[positions] = torch.cat(added.values).double()
        return out

    def sum_at_pool(self, added: CanarySum) -> np.ndarray:
        """`gather_sum` on the host, as a numpy float64 array of its own."""
        return self.gather_sum(added).cpu().numpy().copy()

    def subtract_at_pool(self, tensors: Sequence[torch.Tensor], values: np.ndarray) -> None:
        """tensor -= values at the pool coordinates, in place (values: one per pool position)."""
        start = 0
        for t, idx in zip(tensors, self.pool_local):
            part = values[start : start + len(idx)]
            start += len(idx)
            nonzero = np.flatnonzero(part)
            if nonzero.size:
                where = idx[torch.as_tensor(nonzero, device=idx.device)]
                t.view(-1).index_add_(0, where, torch.as_tensor(-part[nonzero], dtype=t.dtype, device=t.device))

    def project_on_device(self, pool_values, canaries: StepCanaries, planned=None):
        """`project` where the values live: a float64 tensor on their device for a tensor, numpy otherwise
        (`planned`: a PlannedStep of these canaries, whose index and w / C_l are on the device already)."""
        if not torch.is_tensor(pool_values):
            return self.project(pool_values, canaries)
        if planned is not None and planned.index is not None:
            index, scaled = planned.index, planned.scaled
        else:
            index = torch.as_tensor(canaries.pool_index, device=pool_values.device)
            scaled = torch.as_tensor(canaries.weights / self.clip_bounds[canaries.tensor][:, None], device=pool_values.device)
        return (scaled * pool_values[index]).sum(dim=1)

    def project(self, pool_values: np.ndarray, canaries: StepCanaries) -> np.ndarray:
        """Normalized observation of each canary: <w, values on its support> / C_l."""
        on_support = pool_values[canaries.pool_index]
        return np.sum(canaries.weights * on_support, axis=1) / self.clip_bounds[canaries.tensor]
