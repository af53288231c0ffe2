"""Which tensors of a training step were computed from the private batch, and which backward passes start there.

While `DataTaint` is active (a torch function mode, on the few steps the check of tensors outside DP-SGD
compares), every torch function's outputs are marked as the data's when any tensor among its inputs is: the
loader's batch first, then all that is computed from it, the audit's own work included. A backward pass whose
root is marked is one of the data's: a gradient it delivers was computed from the private batch. One whose root
is not (a generator's loss through a DP discriminator's output, a loss of generated samples alone) computes
nothing from this step's batch. The mode returns every function's own result: training is unchanged.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

BACKWARD = {"backward", "grad"}  # Tensor.backward, torch.autograd.backward, torch.autograd.grad


def _tensors(value, found: list) -> list:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, found)
    return found


class DataTaint(TorchFunctionMode):
    """Marks what is computed from the batch (`start`); `from_data` is True inside a backward pass of the data's."""

    def __init__(self):
        super().__init__()
        self.marked: dict = {}  # id -> a weak reference that forgets the id when its tensor goes
        self.from_data: Optional[bool] = None  # inside a backward pass: whether its root is the data's
        self.active = False

    def mark(self, value) -> None:
        for t in _tensors(value, []):
            if id(t) not in self.marked:
                self.marked[id(t)] = weakref.ref(t, lambda _, key=id(t), marked=self.marked: marked.pop(key, None))

    def is_marked(self, value) -> bool:
        return any((ref := self.marked.get(id(t))) is not None and ref() is t for t in _tensors(value, []))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in BACKWARD:
            roots = args[:1] or kwargs.get("tensors", kwargs.get("outputs"))
            outer, self.from_data = self.from_data, self.is_marked(roots)
            try:
                return func(*args, **kwargs)
            finally:
                self.from_data = outer
        result = func(*args, **kwargs)
        if self.is_marked(args) or self.is_marked(kwargs):
            self.mark(result)
        return result

    def start(self, batch_tensors) -> None:
        """Mark a new batch, forgetting the last one's marks, and watch from here (until `stop`)."""
        self.marked.clear()
        self.mark(batch_tensors)
        if not self.active:
            self.__enter__()
            self.active = True

    def stop(self) -> None:
        if self.active:
            self.active = False
            self.__exit__(None, None, None)
