"""Import paths that moved, still answered: the same module object under the old name and the new.

Version 0.1.0's modules all sat at the package root (`lightning_dpaudit.digits`, `.bugs`, `.report`, ...).
Version 0.2.0 gave the engine folders by concern (canaries, release, step, claims, checks, support):
`lightning_dpaudit.engine.pipeline`, for one, is now `lightning_dpaudit.engine.step.pipeline`. The finder below
answers an old path with the module at its new place; an engine path of before the folders warns
(DeprecationWarning).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

ROOT_0_1 = {  # 0.1.0: the package root -> the layers (engine modules by their 0.2.0 path, below)
    "analysis": ("findings", "monitor", "noise_fingerprints", "observations", "report", "results"),
    "engine": ("auditor", "distributed", "probe", "kinds.canaries", "kinds.input_canaries", "kinds.input_probe"),
    "integrations": ("budget", "bugs", "callback", "digits"),
    "app": ("cli", "demo"),
}
ENGINE_FLAT = {  # the engine's flat modules -> its folders
    "kinds": "canaries",
    "kinds.canaries": "canaries.gradient_canaries",
    "probe": "canaries.gradient_probe",
    "paths": "release",
    "ghost": "release.ghost",
    "distributed": "release.distributed",
    "noised_step": "step.noised_step",
    "opacus_step": "step.opacus_step",
    "pipeline": "step.pipeline",
    "readings": "step.readings",
    "divergence": "step.divergence",
    "adaptive": "claims.adaptive",
    "claim_range": "claims.claim_range",
    "names": "support.tensor_names",
    "instance_patch": "support.instance_patch",
    "user_warning": "support.user_warning",
    "per_sample_check": "checks.exact.per_sample",
    "accumulation_check": "checks.exact.accumulation",
    "forward_replay": "checks.exact.forward_replay",
    "gradient_comparison": "checks.exact.gradient_comparison",
    "sharded_replay": "checks.exact.sharded_replay",
    "views": "checks.exact.views",
    "check_budget": "checks.exact.budget",
    "run_checks": "checks.run",
}


def engine_path(name: str) -> str:
    """An engine module's path (relative to the engine) in the folders: its longest moved prefix replaced."""
    for old in sorted(ENGINE_FLAT, key=len, reverse=True):
        if name == old or name.startswith(old + "."):
            return ENGINE_FLAT[old] + name[len(old):]
    return name


def _new_path(layer: str, name: str) -> str:
    return f"lightning_dpaudit.engine.{engine_path(name)}" if layer == "engine" else f"lightning_dpaudit.{layer}.{name}"


OLD_TO_NEW = {f"lightning_dpaudit.{name.split('.')[-1]}": _new_path(layer, name)
              for layer, names in ROOT_0_1.items() for name in names}
FLAT_TO_FOLDERS = {f"lightning_dpaudit.engine.{old}": f"lightning_dpaudit.engine.{new}" for old, new in ENGINE_FLAT.items()}


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
    """Resolves an old path to the module at its new place (`lightning_dpaudit.<old module>`, or an engine module's
    path before the folders)."""

    def find_spec(self, fullname, path=None, target=None):
        new = OLD_TO_NEW.get(fullname)
        if new is None:
            new = _folders_path(fullname)
            if new is None:
                return None
            warnings.warn(f"`{fullname}` moved to `{new}`; the old path will be removed", DeprecationWarning,
                          stacklevel=2)
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def _folders_path(fullname: str):
    """The new path of an engine module (or a module inside a moved engine package) of before the folders, or None."""
    for old in sorted(FLAT_TO_FOLDERS, key=len, reverse=True):
        if fullname == old or fullname.startswith(old + "."):
            return FLAT_TO_FOLDERS[old] + fullname[len(old):]
    return None


def install() -> None:
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
