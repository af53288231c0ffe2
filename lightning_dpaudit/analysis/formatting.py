"""Numbers as a report's JSON holds them, and as its summary prints them."""

from __future__ import annotations

import math


def as_number(x) -> float:
    """A JSON-loaded number back to float: None -> nan, "inf"/"-inf"/"nan" strings -> floats."""
    if x is None:
        return math.nan
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return math.nan
    return float(x)


def fixed(x, digits: int = 3) -> str:
    """`digits` decimals; "n/a" for a missing number, "inf" for an infinite one."""
    x = as_number(x)
    return "n/a" if math.isnan(x) else f"{x:.{digits}g}" if math.isinf(x) else f"{x:.{digits}f}"
