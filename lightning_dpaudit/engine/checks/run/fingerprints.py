"""Fingerprints of the batches the loader delivers, for repeats across steps and duplicates within a batch.

Each row r of a batch (of its widest tensor whose leading size is the batch's: the inputs) is
projected on two fixed random vectors drawn from the audit's own generator: h(r) = (<r, u>, <r, v>)
in float64 (at most 65,536 coordinates, fixed per width). Equal rows give equal
projections; a batch's fingerprint is a 128-bit digest of its rows' sorted projections, so it
does not depend on the rows' order. The projections stay on the device and move to the host
every `FLUSH` batches (no synchronisation on the other steps). Memory: one 16-byte digest per
step, at most MAX_BATCHES of them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch

from .base import widest_rows

WIDTH = 65_536  # coordinates of a tensor's row that are projected
FLUSH = 16  # batches whose projections wait on the device
MAX_BATCHES = 1_000_000  # digests kept (16 bytes each)


@dataclass(frozen=True)
class BatchPrint:
    step: int  # the step the batch was delivered for (1-based)
    records: int
    digest: bytes  # the sorted rows' projections, hashed
    distinct: int  # distinct rows


class BatchPrints:
    """Feeds on batches; `take()` gives the BatchPrint of every batch delivered since the last call."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.directions: Dict[tuple, tuple] = {}
        self.pending: List[tuple] = []  # (step, records, projections on the device)

    def add(self, tensors: list, step: int, records: Optional[int]) -> None:
        """A batch of `records` records (records_in), its tensors `tensors` (batch_tensors), delivered for `step`."""
        if not records:
            return
        self.pending.append((step, records, self._project(widest_rows(tensors, records).detach().reshape(records, -1))))

    def _project(self, flat: torch.Tensor) -> torch.Tensor:
        picked, u = self._direction(flat.shape[1], flat.device)
        return (flat if picked is None else flat[:, picked]).to(torch.float64) @ u

    def _direction(self, width: int, device) -> tuple:
        key = (width, device)
        if key not in self.directions:
            picked = None
            if width > WIDTH:
                picked = torch.randperm(width, generator=self.generator)[:WIDTH].sort().values.to(device)
            u = torch.randn(min(width, WIDTH), 2, generator=self.generator, dtype=torch.float64).to(device)
            self.directions[key] = (picked, u)
        return self.directions[key]

    def due(self) -> bool:
        return len(self.pending) >= FLUSH

    def take(self) -> List[BatchPrint]:
        if not self.pending:
            return []
        pending, self.pending = self.pending, []
        host = torch.cat([p for _, _, p in pending]).cpu().numpy()
        sizes = np.array([records for _, records, _ in pending])
        owner = np.repeat(np.arange(len(pending)), sizes)
        ordered = host[np.lexsort((host[:, 1], host[:, 0], owner))]  # each batch's rows in one order-free order
        new_row = np.ones(len(owner), dtype=bool)
        new_row[1:] = np.any(ordered[1:] != ordered[:-1], axis=1) | (owner[1:] != owner[:-1])
        distinct = np.add.reduceat(new_row, np.concatenate([[0], np.cumsum(sizes)[:-1]]))
        ends = np.cumsum(sizes)
        return [BatchPrint(step, records, hashlib.blake2b(ordered[end - records:end].tobytes(), digest_size=16).digest(),
                           int(d)) for (step, records, _), end, d in zip(pending, ends, distinct)]


class RepeatIndex:
    """The first step of each batch digest seen (bounded); `seen(print)` gives the earlier step of a repeat."""

    def __init__(self):
        self.first: Dict[bytes, int] = {}

    def seen(self, p: BatchPrint) -> Optional[int]:
        earlier = self.first.get(p.digest)
        if earlier is None and len(self.first) < MAX_BATCHES:
            self.first[p.digest] = p.step
        return earlier
