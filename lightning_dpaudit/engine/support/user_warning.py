"""Warnings attributed to the user's own code: no path inside this package, torch, Opacus or Lightning precedes them."""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
import warnings
from typing import Optional


def _library_paths() -> tuple:
    """Where the frames a warning should skip live: this package, torch, Opacus, Lightning, the standard library."""
    paths = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]]
    for name in ("lightning_dpaudit", "torch", "opacus", "pytorch_lightning", "lightning_fabric", "lightning_utilities",
                 "lightning"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            paths.append(os.path.join(os.path.realpath(location), ""))
    return tuple(os.path.join(os.path.realpath(p), "") for p in paths)


_LIBRARY_PATHS: Optional[tuple] = None


def warn_at_user_code(message: str, category) -> None:
    """warnings.warn(message) attributed to the innermost frame outside the libraries (the user's call of
    trainer.fit, or of optimizer.step), so no internal path precedes the message."""
    global _LIBRARY_PATHS
    if _LIBRARY_PATHS is None:
        _LIBRARY_PATHS = _library_paths()
    frame, level = sys._getframe(1), 2  # stacklevel 2: this function's caller
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith("<frozen") or os.path.realpath(name).startswith(_LIBRARY_PATHS)):
            break
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)  # past the outermost frame: attributed to "sys"
