"""A claim float32 can hold. The optimizer clips, noises and updates in float32 (or wider), so

    each clipping bound C          in float32's normal range [1.18e-38, 3.40e38]  (a subnormal rounds coarsely,
                                                                                   above it is inf)
    the noise's std sigma * C      in the same range                               (else drawn as 0 or inf)
    a canary's norm canary_scale * C_l  at most sqrt(3.40e38) = 1.84e19           (its clipping sums squares:
                                                                                   above it the norm is inf and the
                                                                                   row is clipped to 0)

Each `*_problem` function gives what is wrong, or None; `check_claim` refuses an optimizer whose claim is not one
of these, naming the attribute. A noise multiplier of exactly 0 is not refused: it claims no privacy at all, which
the audit reports as the violation `no_noise` (step_claim.py) rather than a set-up error.
"""

from __future__ import annotations

import math
import numbers
from typing import Iterable, Optional

import numpy as np
import torch

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


def claim_number(value):
    """A clipping bound as a float: a real number, or a one-element floating tensor (Opacus clips and noises with
    either); anything else is returned as it is, for `_not_a_number` to refuse."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        return float(value)
    return value


def _not_a_number(name: str, value) -> float:
    """The optimizer attribute as a float; refused when it is not a plain number (a string; a tensor for the noise
    multiplier, which Opacus's accountants cannot compose; a tensor of several values for a bound), naming its value
    and type."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"Unexpected value for the optimizer's {name}: {value!r} of type {type(value).__name__}; it must be a "
            f"Python float (set optimizer.{name} = float(...))"
        )
    return float(value)


def check_claim(optimizer) -> None:
    """The optimizer's noise multiplier and clipping bound(s) must make a privacy claim to audit, one float32 can hold
    (above: each bound C and the noise's std sigma * C in float32's normal range), or have a noise multiplier of
    exactly 0: no noise, a void claim the audit reports as the finding `no_noise` (step_claim.py)."""
    sigma = _not_a_number("noise_multiplier", optimizer.noise_multiplier)
    if not math.isfinite(sigma) or sigma < 0:
        raise ValueError(
            f"Unexpected value for the optimizer's noise_multiplier: {sigma}; it must be a finite number > 0, or 0 "
            "(no noise: the audit reports the violation `no_noise`)"
        )
    per_layer = getattr(optimizer, "max_grad_norms", None)
    tensors = len(optimizer.params)
    if per_layer is not None and len(per_layer) not in (0, tensors):
        raise ValueError(
            f"Unexpected value for the optimizer's max_grad_norms: {len(per_layer)} bound(s) for {tensors} parameter "
            "tensors; per-layer clipping needs one bound per tensor (change the bounds in place, keeping their number)"
        )
    for bound in [optimizer.max_grad_norm] if per_layer is None or len(per_layer) == 0 else per_layer:
        bound = _not_a_number("max_grad_norm", claim_number(bound))
        if not math.isfinite(bound) or bound <= 0:
            raise ValueError(
                f"Unexpected value for the optimizer's max_grad_norm: {bound}; clipping needs a finite bound > 0"
            )
        problem = bound_problem(bound)
        if problem is not None:
            raise ValueError(f"Unexpected value for the optimizer's max_grad_norm: {bound}; {problem}")
    problem = None if sigma == 0 else noise_problem(sigma, float(claim_number(optimizer.max_grad_norm)))
    if problem is not None:
        raise ValueError(f"Unexpected value for the optimizer's noise_multiplier: {sigma}; {problem}")


def check_canary_norms(optimizer, canary_scale: float) -> None:
    """The canaries, planted at canary_scale times each bound, must have a norm float32's clipping computes."""
    per_layer = getattr(optimizer, "max_grad_norms", None)
    bounds = [float(b) for b in per_layer] if per_layer else [float(optimizer.max_grad_norm)]
    problem = canary_problem(bounds, canary_scale)
    if problem is not None:
        raise ValueError(f"Unexpected value for the optimizer's max_grad_norm: {max(bounds)}; {problem}")
