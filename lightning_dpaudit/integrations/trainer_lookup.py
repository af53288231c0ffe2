"""What DPAuditCallback looks up on the Trainer and the LightningModule: the DP optimizer, the
accountant, the length of an epoch and the directory for reports."""

from __future__ import annotations

import math

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
