"""What DPAuditCallback looks up on the Trainer and the LightningModule: the DP optimizer, the
accountant, the length of an epoch and the directory for reports."""

from __future__ import annotations

import math
from typing import Callable, Optional

def find_dp_optimizer(optimizers):
    from opacus.optimizers import DPOptimizer

    found = [opt for opt in optimizers if isinstance(opt, DPOptimizer)]
    if not found:
        names = ", ".join(type(o).__name__ for o in optimizers) or "none"
        raise RuntimeError(
            "DPAuditCallback looked for an Opacus DPOptimizer among trainer.optimizers and found "
            f"{names}. Call PrivacyEngine.make_private(...) in configure_optimizers (or before building the "
            "Trainer) and return its optimizer, or pass DPAuditCallback(optimizer=...)."
        )
    if len(found) > 1:
        raise RuntimeError(
            f"DPAuditCallback found {len(found)} DP optimizers; pass the one to audit as DPAuditCallback(optimizer=...)"
        )
    return found[0]


def module_accountant(pl_module):
    engine = getattr(pl_module, "privacy_engine", None)
    return getattr(engine, "accountant", None)


def check_accountant_matches(accountant, optimizer) -> None:
    if accountant is None or not accountant.history:
        return
    last_sigma = accountant.history[-1][0]
    if not math.isclose(last_sigma, optimizer.noise_multiplier, rel_tol=1e-9):
        raise ValueError(
            f"the accountant's history ends with noise multiplier {last_sigma}, but the optimizer uses "
            f"{optimizer.noise_multiplier}: pass the accountant of this optimizer's PrivacyEngine"
        )


def batches_per_epoch(trainer) -> int:
    """Steps in one epoch of this rank's training data loader (0 when it has no length)."""
    try:
        return len(trainer.train_dataloader)
    except TypeError:
        return 0


def log_dir(trainer) -> str:
    for logger in trainer.loggers:
        if getattr(logger, "log_dir", None):
            return logger.log_dir
    return trainer.default_root_dir


def other_optimizers(optimizers, audited) -> list:
    """The Trainer's optimizers other than the audited one (their tensors are trained outside DP-SGD)."""
    from ..engine.options import unwrapped_optimizer

    inner = unwrapped_optimizer(audited)
    return [unwrapped_optimizer(o) for o in optimizers if unwrapped_optimizer(o) is not inner]


def training_loader(trainer):
    """The Trainer's training DataLoader (the only one, when it holds a sequence or mapping of one)."""
    loader = trainer.train_dataloader
    if isinstance(loader, (list, tuple)) and len(loader) == 1:
        return loader[0]
    if isinstance(loader, dict) and len(loader) == 1:
        return next(iter(loader.values()))
    return loader


def step_replay(pl_module, batch_idx: int) -> Optional[Callable]:
    """batch -> the LightningModule's training_step loss on it, its own logging silenced (automatic optimization
    only: a manual step also steps its optimizers)."""
    if not getattr(pl_module, "automatic_optimization", True):
        return None

    def replay(batch):
        from ..engine.support.instance_patch import InstancePatch

        patches = [InstancePatch(pl_module, name, lambda *a, **k: None) for name in ("log", "log_dict")]
        try:
            return pl_module.training_step(batch, batch_idx)
        finally:
            for patch in reversed(patches):
                patch.restore()

    return replay
