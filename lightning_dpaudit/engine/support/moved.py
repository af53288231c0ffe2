"""Attributes that moved, still answered with a DeprecationWarning that names where they are now."""

from __future__ import annotations

import warnings


class MovedAttributes:
    """A class's table MOVED_ATTRIBUTES: old name -> (its new spelling, a function of the object giving it)."""

    MOVED_ATTRIBUTES: dict = {}

    def __getattr__(self, name: str):
        moved = type(self).MOVED_ATTRIBUTES.get(name)
        if moved is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(f"`{type(self).__name__}.{name}` moved to `.{moved[0]}`; the old name will be removed",
                      DeprecationWarning, stacklevel=2)
        return moved[1](self)
