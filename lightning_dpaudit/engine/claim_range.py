"""A claim float32 can hold. The optimizer clips, noises and updates in float32 (or wider), so

    each clipping bound C          in float32's normal range [1.18e-38, 3.40e38]  (a subnormal rounds coarsely,
                                                                                   above it is inf)
    the noise's std sigma * C      in the same range                               (else drawn as 0 or inf)
    a canary's norm canary_scale * C_l  at most sqrt(3.40e38) = 1.84e19           (its clipping sums squares:
                                                                                   above it the norm is inf and the
                                                                                   row is clipped to 0)

Each function gives what is wrong, or None.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import numpy as np

TINY, MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
LARGEST_NORM = math.sqrt(MAX)


def outside(value: float) -> Optional[str]:
    """Where `value` falls outside float32's normal range, or None."""
    if value > MAX:
        return f"above float32's largest number {MAX:.3g} (inf in float32)"
    if value < TINY:
        return f"below float32's smallest normal number {TINY:.3g} (subnormal or 0 in float32)"
    return None


def bound_problem(bound: float) -> Optional[str]:
    where = outside(bound)
    return None if where is None else f"it is {where}: clip factors C / norm are not what the claim says"


def noise_problem(sigma: float, max_grad_norm: float) -> Optional[str]:
    std = sigma * max_grad_norm
    where = outside(std)
    return None if where is None else (f"the noise's std noise_multiplier * max_grad_norm = {std:g} is {where}: the "
                                       "noise drawn is not the noise claimed")


def canary_problem(bounds: Iterable[float], canary_scale: float) -> Optional[str]:
    largest = max(bounds)
    if canary_scale * largest <= LARGEST_NORM:
        return None
    return (f"canaries of norm canary_scale * max_grad_norm = {canary_scale * largest:g} have a squared norm above "
            f"float32's largest number (their clipping computes an infinite norm and gives 0): use max_grad_norm <= "
            f"{LARGEST_NORM / canary_scale:.3g}, or a smaller canary_scale")
