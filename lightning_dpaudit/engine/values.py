"""One option's value checked by its kind: each error names the option, the value and what is allowed."""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Callable, Optional


def integer(name: str, value, minimum: int, maximum: Optional[int] = None, why: str = "") -> int:
    """`value` as an int in [minimum, maximum] (maximum None: no upper bound; `why` says what sets it);
    bools and non-integral numbers are refused, not truncated."""
    allowed = f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]{why}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"Unexpected value for `{name}`: {value!r}; use {allowed}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"Unexpected value for `{name}`: {value}; use {allowed}")
    return int(value)


def real(name: str, value, *, low: float, high: float = math.inf, low_open: bool = True, high_open: bool = True) -> float:
    """`value` as a finite float in the interval (low, high) (ends open or closed as asked)."""
    interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Unexpected value for `{name}`: {value!r}; use a number in {interval}")
    v = float(value)
    inside = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if math.isnan(v) or not inside or (math.isinf(v) and math.isinf(high) and high_open):
        raise ValueError(f"Unexpected value for `{name}`: {value}; use a finite number in {interval}")
    return v


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"Unexpected value for `{name}`: {value!r}; use True or False")
    return value


def one_argument_callable(name: str, value) -> Optional[Callable]:
    """None, or a callable that accepts one positional argument (checked now, not at the first alarm)."""
    if value is None:
        return None
    if not callable(value):
        raise ValueError(f"Unexpected value for `{name}`: {value!r}; use a callable taking the AuditResult, or None")
    try:
        inspect.signature(value).bind(object())
    except TypeError as error:
        raise ValueError(f"`{name}` must accept one argument (the AuditResult): {error}") from None
    except ValueError:  # no signature to read (some builtins): accept
        pass
    return value
