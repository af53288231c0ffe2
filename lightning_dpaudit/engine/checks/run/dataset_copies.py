"""Rows of a tensor dataset that are copies of other rows: exact duplicates and mirror images.

The training data is scanned once, when the loader becomes known, when it is (or wraps) a
TensorDataset of at most `SCAN_ELEMENTS` elements in its widest tensor. Each row x is projected
on a fixed random direction u in float64: p(x) = <x, u>. A row y that is x mirrored along an
axis d satisfies p(y) = <x, flip_d(u)>, so candidates are found by matching these projections
(sorted, to a relative tolerance) and confirmed by exact comparison of the rows.

mirrored     rows equal to another row flipped left-right or top-bottom (and not symmetric
             themselves): a dataset stacked with its augmented copies. Two people's data are not
             each other's exact mirror images, so one record is two rows: finding `multiplicity`
             once they are at least `MIRROR_SHARE` of the rows.
duplicates   rows equal to an earlier row (counted exactly): a note (two people may share the same values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

SCAN_ELEMENTS = 1 << 27  # the widest tensor's elements scanned (1 GiB in float64 at most while projecting)
MIRROR_SHARE = 0.01  # the share of rows mirrored that is a finding (at least two rows)
TOLERANCE = 1e-9  # relative difference of two projections that makes them a candidate pair
CANDIDATES = 4  # candidates confirmed per row (equal rows share a projection: any one of them answers)


@dataclass(frozen=True)
class Copies:
    rows: int  # rows scanned
    duplicates: int  # rows equal to an earlier row
    mirrored: int  # rows equal to another row's mirror image (and not symmetric)
    axis: str  # the mirror axis that gave most of them


def tensor_rows(dataset) -> Optional[torch.Tensor]:
    """The widest tensor of the TensorDataset the dataset is or wraps (a Subset's rows only), or None."""
    from torch.utils.data import Subset, TensorDataset

    indices = None
    for _ in range(4):
        if isinstance(dataset, Subset):
            inner = torch.as_tensor(list(dataset.indices), dtype=torch.long)
            indices = inner if indices is None else inner[indices]
            dataset = dataset.dataset
        elif isinstance(dataset, TensorDataset):
            widest = max(dataset.tensors, key=lambda t: t.numel())
            if widest.dim() < 3 or widest.numel() > SCAN_ELEMENTS:
                return None  # rows that are not images, or too many elements to scan at attach
            return widest if indices is None else widest[indices]
        else:
            return None
    return None


def _pairs(keys: np.ndarray, values: np.ndarray) -> tuple:
    """(i, j) with keys[i] within the tolerance of values[j]: candidates, confirmed by the caller."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    scale = TOLERANCE * (np.abs(keys) + np.abs(values).max() * 1e-3 + 1e-300)
    lo = np.searchsorted(ordered, keys - scale, side="left")
    hi = np.searchsorted(ordered, keys + scale, side="right")
    hi = np.minimum(hi, lo + CANDIDATES)
    i = np.repeat(np.arange(len(keys)), hi - lo)
    j = order[np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)])] if len(i) else np.zeros(0, dtype=np.int64)
    return i, j


def find_copies(rows: torch.Tensor, seed: int = 0) -> Copies:
    """Exact duplicates and mirror images among `rows` (N, ..., H, W)."""
    rows = rows.detach().cpu()
    n = rows.shape[0]
    u = torch.randn(rows.shape[1:], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    flat = rows.reshape(n, -1).to(torch.float64)
    p = (flat @ u.reshape(-1)).numpy()
    duplicates = n - len(np.unique(rows.reshape(n, -1).numpy(), axis=0))
    best = (0, "")
    for dim, axis in ((-1, "left-right"), (-2, "top-bottom")):
        q = (flat @ u.flip(dim).reshape(-1)).numpy()
        i, j = _pairs(q, p)
        mirrored = {int(a) for a, b in zip(i, j)
                    if not torch.equal(rows[a], rows[b]) and torch.equal(rows[a].flip(dim), rows[b])}
        best = max(best, (len(mirrored), axis))
    return Copies(n, duplicates, best[0], best[1])


def scan(dataset) -> Optional[Copies]:
    """The copies among the rows of the TensorDataset the training data is or wraps (None: not scanned)."""
    rows = tensor_rows(dataset)
    return None if rows is None or rows.shape[0] < 2 else find_copies(rows)


def mirrored_finding(copies: Optional[Copies]) -> Optional[str]:
    """A sentence when enough rows are mirror images of other rows (the module docstring)."""
    if copies is None or copies.mirrored < max(2, MIRROR_SHARE * copies.rows):
        return None
    return (f"{copies.mirrored} of the {copies.rows} rows of the training data are other rows mirrored {copies.axis}: "
            "the data holds augmented copies of its records, so a record is two rows, each clipped on its own, while "
            "the accountant counts one")
