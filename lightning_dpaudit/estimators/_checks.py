"""Argument checks shared by the estimators: each error names the argument and its value."""

from __future__ import annotations

import math

import numpy as np


def check_scores(values, name: str) -> np.ndarray:
    """A 1-D float array of finite scores (possibly empty)."""
    array = np.asarray(values, dtype=float)
    if array.ndim != 1:
        array = array.reshape(-1)
    if not np.all(np.isfinite(array)):
        bad = array[~np.isfinite(array)][0]
        raise ValueError(f"`{name}` must contain only finite numbers; found {bad}")
    return array


def check_confidence(confidence: float) -> float:
    confidence = float(confidence)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"Unexpected value for `confidence`: {confidence}; it must lie in (0, 1)")
    return confidence


def check_delta(delta: float, *, allow_zero: bool = True, why: str = "") -> float:
    delta = float(delta)
    if not 0.0 <= delta < 1.0 or math.isnan(delta):
        raise ValueError(f"Unexpected value for `delta`: {delta}; it must lie in [0, 1)")
    if delta == 0.0 and not allow_zero:
        raise ValueError(f"`delta` must be > 0 here: {why}")
    return delta


def check_nonnegative(value: float, name: str) -> float:
    value = float(value)
    if math.isnan(value) or value < 0.0:
        raise ValueError(f"Unexpected value for `{name}`: {value}; it must be >= 0")
    return value


def check_count(value: int, name: str) -> int:
    if int(value) != value or value < 0:
        raise ValueError(f"Unexpected value for `{name}`: {value}; it must be a whole number >= 0")
    return int(value)
