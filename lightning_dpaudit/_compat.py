"""Import paths of version 0.1.0, whose modules all sat at the package root.

`import lightning_dpaudit.digits` (or `.bugs`, `.report`, ...) keeps working (`.testing` is a module again):
the finder below answers an old path with the module at its new place in the layers, the
same module object under both names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "analysis": ("findings", "monitor", "noise_fingerprints", "observations", "report", "results"),
    "engine": ("auditor", "distributed", "probe"),
    "engine.kinds": ("canaries", "input_canaries", "input_probe"),
    "integrations": ("budget", "bugs", "callback", "digits"),
    "app": ("cli", "demo"),
}
OLD_TO_NEW = {f"lightning_dpaudit.{name}": f"lightning_dpaudit.{layer}.{name}" for layer, names in MOVED.items() for name in names}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec  # importlib gave it the old name's spec: give its own back


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Resolves `lightning_dpaudit.<old module>` to `lightning_dpaudit.<layer>.<module>`."""

    def find_spec(self, fullname, path=None, target=None):
        new = OLD_TO_NEW.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
