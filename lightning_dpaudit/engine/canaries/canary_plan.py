"""A block of steps' gradient canaries, made ready for the device in one pass.

The sampler draws BLOCK steps at a time (gradient_canaries.py). For every step of a block at once this computes
what the step needs on the parameters' device, so that a step takes its part (views) instead of building it:

    K_i      the step's in-canaries as a correct clipping leaves them, per tensor with its columns
             (probe.preclipped: K_r = row_r * min(1, C_l / (||row_r|| + 1e-6)), row_r = scale * C_l * w_r)
    K_i@S    K_i at the sentinels' pool positions (float64), what their noise is read net of; and -K_i
    index_i  the canaries' pool positions, and w_r / C_l, with which an observation <w_r, R - S> / C_l is read

The arithmetic is the per-step computation's, elementwise over the block in float64, so every value equals it
bit for bit. A plan holds for the clipping bounds it was made with: a new claim (set_claim) makes a new one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from .gradient_canaries import StepCanaries
from .gradient_probe import CanarySum, GradientProbe, correctly_clipped


@dataclass
class PlannedStep:
    """One step of a plan: its canaries, K of its in-canaries (None: the layout needs the per-step way), and the
    device tensors its observations are read with."""

    canaries: StepCanaries
    preclipped: Optional[CanarySum]
    index: Optional[torch.Tensor] = None  # (k, support) pool positions
    scaled: Optional[torch.Tensor] = None  # (k, support) w / C_l, float64

    def preclipped_for(self, which: np.ndarray) -> Optional[CanarySum]:
        """The planned K when `which` selects the in-canaries it was planned for, else None."""
        if self.preclipped is None or (which is not self.canaries.is_in and not np.array_equal(which, self.canaries.is_in)):
            return None
        return self.preclipped


def plan(probe: GradientProbe, steps: List[StepCanaries], sentinels: Optional[np.ndarray]) -> List[PlannedStep]:
    """PlannedSteps of `steps` (consecutive steps of one block, sharing one layout sorted by tensor); `sentinels`:
    the pool positions whose noise is read (None: none)."""
    layout = steps[0].tensor
    if any(c.tensor is not layout and not np.array_equal(c.tensor, layout) for c in steps) or np.any(np.diff(layout) < 0):
        return [PlannedStep(c, None) for c in steps]
    n, support = len(steps), steps[0].coords.shape[1]
    p0 = probe.params[0]
    device, dtype = p0.device, p0.dtype
    weights = np.stack([c.weights for c in steps])  # (n, k, support)
    is_in = np.stack([c.is_in for c in steps])  # (n, k)
    positions = np.stack([c.pool_index for c in steps])
    bounds = probe.clip_bounds[layout]
    chosen_rows = np.flatnonzero(is_in)  # the in-canaries, step by step, as rows of (n * k, support) arrays

    def of_chosen(array):
        return array.reshape(-1, support)[chosen_rows].ravel()

    clipped = correctly_clipped(weights, np.broadcast_to(bounds, is_in.shape), probe.scale)
    values = torch.as_tensor(of_chosen(clipped), dtype=dtype, device=device)
    columns = torch.as_tensor(of_chosen(np.stack([c.coords for c in steps])), device=device)
    negated = -values
    tensors = len(probe.params)
    counts = np.zeros((n, tensors), dtype=np.int64)  # values per step and tensor (layout: tensors in order)
    present, starts = np.unique(layout, return_index=True)
    counts[:, present] = np.add.reduceat(is_in.astype(np.int64), starts, axis=1) * support
    chosen = counts.sum(axis=1)  # values per step
    step_of = torch.as_tensor(np.repeat(np.arange(n), chosen), device=device)
    in_positions = of_chosen(positions)
    at_sentinels = None
    if sentinels is not None:  # K at the sentinels: each in-canary value whose position is a sentinel's
        slot = np.full(len(probe.pool), -1)
        slot[sentinels] = np.arange(len(sentinels))
        hits = np.flatnonzero(slot[in_positions] >= 0)
        at_sentinels = torch.zeros((n, len(sentinels)), dtype=torch.float64, device=device)
        hit = torch.as_tensor(hits, device=device)
        at_sentinels[step_of[hit], torch.as_tensor(slot[in_positions[hits]], device=device)] = values[hit].double()
        at_sentinels = at_sentinels.unbind()
    flat_counts = counts.ravel().tolist()  # every step's tensors in turn: one split serves the block
    parts = [torch.split(t, flat_counts) for t in (values, columns, negated)]
    if np.all(chosen == chosen[0]):
        step_positions = list(in_positions.reshape(n, -1))
    else:
        step_positions = np.split(in_positions, np.cumsum(chosen)[:-1])
    index = torch.as_tensor(positions, device=device).unbind()
    scaled = torch.as_tensor(weights / bounds[None, :, None], device=device).unbind()
    planned = []
    for i, c in enumerate(steps):
        own = slice(i * tensors, (i + 1) * tensors)
        added = CanarySum(list(parts[0][own]), parts[1][own], step_positions[i])
        added.negated = list(parts[2][own])
        added.at_sentinels = None if at_sentinels is None else at_sentinels[i]
        planned.append(PlannedStep(c, added, index[i], scaled[i]))
    return planned
