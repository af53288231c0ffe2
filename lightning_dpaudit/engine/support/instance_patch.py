"""A method replaced on one object (not its class), and put back exactly as it was."""

from __future__ import annotations

from typing import Any


class InstancePatch:
    """obj.name = replacement on the instance; restore() gives back the instance's own attribute if it had
    one, else removes ours so that the class's method (a user subclass's override included) shows again."""

    def __init__(self, obj: Any, name: str, replacement: Any):
        self.obj, self.name = obj, name
        self.had_own, self.previous = name in vars(obj), vars(obj).get(name)
        self.original = getattr(obj, name)  # what the replacement may call
        setattr(obj, name, replacement)

    def restore(self) -> None:
        if self.had_own:
            setattr(self.obj, self.name, self.previous)
        else:
            delattr(self.obj, self.name)
