"""The readings of the steps since the last check, kept where they were computed.

A step's observations and sentinel noise stay on the parameters' device; at a check,
`flush` moves every pending value to the host in one transfer (one device
synchronisation per check instead of one per step) and hands back StepReadings.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import torch

from ...analysis.record import StepReading
from ..canaries.base import Reading


class PendingReadings:
    def __init__(self):
        self._pending: List[Tuple[int, int, Reading]] = []

    def add(self, step: int, reading: Reading, segment: int = 0) -> None:
        self._pending.append((step, segment, reading))

    def __len__(self) -> int:
        return len(self._pending)

    def flush(self) -> List[StepReading]:
        """Every pending reading on the host, in step order; the buffer is empty after."""
        pending, self._pending = self._pending, []
        parts = [part for _, _, r in pending for part in (r.value, r.noise) if torch.is_tensor(part)]
        if parts:
            host = iter(torch.split(torch.cat([p.reshape(-1).double() for p in parts]).cpu(), [p.numel() for p in parts]))
        out = []
        for step, segment, r in pending:
            value = next(host).numpy() if torch.is_tensor(r.value) else np.asarray(r.value, dtype=np.float64)
            noise = r.noise
            if torch.is_tensor(noise):
                noise = next(host).numpy()
            elif noise is not None:
                noise = np.asarray(noise, dtype=np.float64)
            out.append(StepReading(step, np.asarray(r.layer), np.asarray(r.is_in, dtype=bool), value, noise, segment))
        return out
