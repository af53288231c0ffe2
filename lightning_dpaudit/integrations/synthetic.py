"""A synthetic task on which a final-model audit has power: each canary owns an input coordinate.

n training points are Gaussian clusters (one per class) in the first d coordinates, zero
after; canary i is `scale` times the unit vector e_{d+i}, with a random label. A linear
model's weights on coordinate d+i move only when canary i is trained on, so its score
shows membership as clearly as the noise allows.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch.utils.data import TensorDataset


def coordinate_canary_task(seed: int, count: int, *, n: int = 200, d: int = 8, classes: int = 4,
                           scale: float = 4.0) -> Tuple[TensorDataset, torch.Tensor, torch.Tensor]:
    """(training data, canary inputs (count, d + count), canary labels), all drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    centers = 2.0 * torch.randn(classes, d, generator=g)
    y = torch.randint(classes, (n,), generator=g)
    x = torch.zeros(n, d + count)
    x[:, :d] = centers[y] + torch.randn(n, d, generator=g)
    canary_x = torch.zeros(count, d + count)
    canary_x[torch.arange(count), d + torch.arange(count)] = scale
    canary_y = torch.randint(classes, (count,), generator=g)
    return TensorDataset(x, y), canary_x, canary_y
