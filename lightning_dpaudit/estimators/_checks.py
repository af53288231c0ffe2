"""Argument checks shared by the estimators: each error names the argument and its value."""

from __future__ import annotations

import math

import numpy as np


def check_scores(values, name: str) -> np.ndarray:
    """A 1-D float array of finite scores (possibly empty)."""
    try:
        array = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a 1-D sequence of numbers; got {type(values).__name__}") from None
    if array.ndim > 1:
        raise ValueError(f"`{name}` must be 1-D (one score per canary); got shape {array.shape}")
    array = array.reshape(-1)
    if not np.all(np.isfinite(array)):
        bad = array[~np.isfinite(array)][0]
        raise ValueError(f"`{name}` must contain only finite numbers; found {bad}")
    return array


def _real(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"Unexpected value for `{name}`: {value!r}; use a number")
    return float(value)


def check_confidence(confidence: float) -> float:
    confidence = _real(confidence, "confidence")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"Unexpected value for `confidence`: {confidence}; it must lie in (0, 1)")
    return confidence


def check_delta(delta: float, *, allow_zero: bool = True, why: str = "") -> float:
    delta = _real(delta, "delta")
    if not 0.0 <= delta < 1.0 or math.isnan(delta):
        raise ValueError(f"Unexpected value for `delta`: {delta}; it must lie in [0, 1)")
    if delta == 0.0 and not allow_zero:
        raise ValueError(f"`delta` must be > 0 here: {why}")
    return delta


def check_nonnegative(value: float, name: str) -> float:
    value = _real(value, name)
    if math.isnan(value) or value < 0.0:
        raise ValueError(f"Unexpected value for `{name}`: {value}; it must be >= 0")
    return value


def check_count(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not np.isfinite(value):
        raise ValueError(f"Unexpected value for `{name}`: {value!r}; it must be a whole number >= 0")
    if int(value) != value or value < 0:
        raise ValueError(f"Unexpected value for `{name}`: {value}; it must be a whole number >= 0")
    return int(value)


def check_counts(tp, fn, fp, tn):
    """Four count arrays (or scalars) of one shape, whole numbers >= 0."""
    arrays = [np.asarray(c) for c in (tp, fn, fp, tn)]
    if len({a.shape for a in arrays}) != 1:
        raise ValueError(f"`tp`, `fn`, `fp` and `tn` must have one shape; got {', '.join(str(a.shape) for a in arrays)}")
    for name, a in zip(("tp", "fn", "fp", "tn"), arrays):
        if not np.issubdtype(a.dtype, np.number) or a.dtype == bool:
            raise ValueError(f"Unexpected value for `{name}`: counts must be whole numbers >= 0")
        bad = ~np.isfinite(a) | (a < 0) | (a != np.round(a)) if a.size else np.zeros(0, bool)
        if np.any(bad):
            raise ValueError(f"Unexpected value for `{name}`: {np.asarray(a)[bad].ravel()[0]}; counts must be whole numbers >= 0")
    return arrays


def check_included(values, name: str = "included") -> np.ndarray:
    """A 1-D boolean array from booleans or 0/1 integers; anything else (probabilities, nan,
    strings, None) is refused, naming the first bad value, instead of being read as True."""
    try:
        array = np.asarray(values)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be booleans or 0/1 integers, one per canary; got {type(values).__name__}") from None
    array = array.reshape(-1)
    if array.dtype == bool:
        return array
    if np.issubdtype(array.dtype, np.integer):
        bad = (array != 0) & (array != 1)
        if np.any(bad):
            raise ValueError(f"Unexpected value for `{name}`: {array[bad][0].item()!r}; use booleans or 0/1 integers")
        return array.astype(bool)
    for value in array:  # floats, strings, objects: name the first value that is not a bool or a 0/1 integer
        if not (isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and value in (0, 1))):
            shown = value.item() if isinstance(value, np.generic) else value
            raise ValueError(
                f"Unexpected value for `{name}`: {shown!r} (a {type(shown).__name__}); use booleans or 0/1 integers"
            )
    return array.astype(bool)
