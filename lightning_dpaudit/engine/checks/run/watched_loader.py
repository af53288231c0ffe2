"""A DataLoader whose batches are seen as they are delivered, and put back exactly as it was.

The loader's class is swapped, on this instance only, for a subclass whose `__iter__` hands
each batch to `seen(batch)` before yielding it unchanged (a `for` loop looks `__iter__` up on
the class, so an instance attribute would not be called); `restore()` gives the instance its
class back. The loader's own iterator is made when `__iter__` is called, as without the
watch: making it draws the workers' base seed from torch's global generator, and a later draw
would move the training's random numbers. An error of `seen` never reaches the training
loop: it is warned once, and the loader is no longer watched.
"""

from __future__ import annotations

import warnings
from typing import Callable


class WatchedLoader:
    def __init__(self, loader, seen: Callable):
        self.loader, self.original, self.seen = loader, type(loader), seen
        self.failed = None  # the error that stopped the watching, if one did
        original, watcher = self.original, self

        def __iter__(self):
            return watcher.passed_on(original.__iter__(self))  # made at once: it draws from torch's generator

        watched = type(original.__name__, (original,), {"__iter__": __iter__, "__module__": original.__module__,
                                                        "__qualname__": original.__qualname__})
        loader.__class__ = watched

    def passed_on(self, batches):
        """The loader's batches, each seen first while the watching lasts."""
        for batch in batches:
            if self.failed is None:
                try:
                    self.seen(batch)
                except Exception as error:  # the audit's own failure never ends training
                    self.failed = f"{type(error).__name__}: {error}"
                    warnings.warn(f"the run checks stopped watching the loader: {self.failed}", RuntimeWarning)
            yield batch

    def restore(self) -> None:
        if type(self.loader).__mro__[1] is self.original:
            self.loader.__class__ = self.original
