"""Records made of several views (augmentation multiplicity): the exact check compared per record.

A recipe that feeds K augmented views of each record through the model and averages Opacus's
per-sample gradients over the views before the step (De et al. 2022) holds R = N / K rows for a
forward batch of N: one row per record, as the accountant counts. With the row's views V(r),

    expected_r = (1 / K) * sum_{v in V(r)} s * d<out_v, g_v>/dtheta      (s as for one row: N under "mean")

The grouping is the user's: consecutive views (V(r) = {rK, ..., rK + K - 1}, from a view(R, K, ...))
and view blocks (V(r) = {r, r + R, ..., r + (K - 1) R}, from stacking K augmented batches) are
tried in turn; a match under one is a comparison, a mismatch under both says that nothing could
be compared (another grouping may be the user's), never a finding.
"""

from __future__ import annotations

from typing import Optional

import torch


def groupings(example: int, records: int, views: int) -> list:
    """(name, record, its view rows) of the forward batch's row `example` under each grouping tried."""
    return [
        ("consecutive views", example // views, [example // views * views + k for k in range(views)]),
        ("view blocks", example % records, [example % records + k * records for k in range(views)]),
    ]


def expected_for(leaves: list, full_grads: dict, rows: list, wanted: list, scale: float, views: int) -> list:
    """The record's expected per-sample gradient per tensor of `wanted` (None where autograd gives none)."""
    inner = sum((leaves[j][rows] * g[rows]).sum() for j, g in full_grads.items() if j < len(leaves))
    grads = torch.autograd.grad(inner, wanted, retain_graph=True, allow_unused=True)
    return [None if g is None else scale * g / views for g in grads]


def why_not(call, records: int, ghost: bool) -> Optional[str]:
    """Why the records of several views cannot be compared at this call, or None when they can."""
    if ghost:
        return "records of several views under ghost clipping: the per-record norms are not compared"
    if not call.full_grads or set(call.full_grads) != set(call.grads):
        return "records of several views: the output's gradient was too large to keep whole"
    return None
