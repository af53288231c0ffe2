"""The readings of the steps since the last check, kept where they were computed.

A step's observations and sentinel noise stay on the parameters' device; at a check,
`flush` moves every pending value to the host in one transfer (one device
synchronisation per check instead of one per step) and hands back StepReadings.
"""

from __future__ import annotations

from typing import Iterator, List, Tuple

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
        parts = [part for _, _, r in pending for part in (r.value, r.noise) if isinstance(part, torch.Tensor)]
        host = on_host(parts)
        out = []
        for step, segment, r in pending:
            value = next(host) if isinstance(r.value, torch.Tensor) else np.asarray(r.value, dtype=np.float64)
            noise = r.noise
            if isinstance(noise, torch.Tensor):
                noise = next(host)
            elif noise is not None:
                noise = np.asarray(noise, dtype=np.float64)
            out.append(StepReading(step, np.asarray(r.layer), np.asarray(r.is_in, dtype=bool), value, noise, segment))
        return out


def on_host(parts: List[torch.Tensor]) -> Iterator[np.ndarray]:
    """The tensors' values flattened, float64, as numpy arrays on the host, in order: one transfer for all of them
    (float32 parts are widened exactly, as each part's own .double() would)."""
    if not parts:
        return iter(())
    host = torch.cat([p.reshape(-1) for p in parts]).double().cpu().numpy()
    ends = np.cumsum([p.numel() for p in parts]).tolist()
    return iter([host[start:end] for start, end in zip([0, *ends[:-1]], ends)])
