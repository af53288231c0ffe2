"""The run checks: what the accountant assumes about the run, beyond the optimizer (base.py).

    sampling.py       batches drawn as the accountant composes (Poisson at its q, fresh each step)
    multiplicity.py   one row of the clipped sum per record
    coupling.py       each example's gradient depends on that example alone (at the exact checks' steps)
    outside_dp.py     nothing of the module trained outside the DP optimizer

Each is a Check (checks/base.py) of scope "pipeline", run by the audit's CheckRunner with the others;
checks/defaults.py lists them. Here: the options that feed them, refused by name.
"""

from __future__ import annotations

from .base import PIPELINE_CODES, RunCheck, RunView
from .coupling import CouplingCheck
from .multiplicity import MultiplicityCheck
from .outside_dp import OutsideDPCheck
from .sampling import SamplingCheck

__all__ = ["PIPELINE_CODES", "CouplingCheck", "MultiplicityCheck", "OutsideDPCheck", "RunCheck", "RunView",
           "SamplingCheck", "check_run_options", "refuse_unwatchable"]


def watchable(loader) -> bool:
    """Whether the loader can be watched as the loop iterates it: an object of a class of its own (not a built-in
    container, a tensor or an array) whose iteration starts afresh each time (not an iterator or a generator)."""
    import numpy as np
    import torch

    kind = type(loader)
    if not callable(getattr(kind, "__iter__", None)) or kind.__module__ == "builtins" or not hasattr(loader, "__dict__"):
        return False
    if isinstance(loader, (torch.Tensor, np.ndarray)) or callable(getattr(kind, "__next__", None)):
        return False
    return True


def refuse_unwatchable(name: str, loader) -> None:
    """A ValueError naming the option `name` unless `loader` can be watched."""
    if not watchable(loader):
        raise ValueError(f"Unexpected value for `{name}`: {type(loader).__name__}; pass the DataLoader the training "
                         "loop iterates (an iterable object of its own class, not an iterator, a container or a "
                         "tensor)" + (", or None" if name == "data_loader" else ""))


def check_run_options(*, data_loader, training_loss, other_optimizers) -> None:
    """PrivacyAuditor's options for the run checks, each refused by name."""
    if data_loader is not None:
        refuse_unwatchable("data_loader", data_loader)
    if training_loss is not None and not callable(training_loss):
        raise ValueError(f"Unexpected value for `training_loss`: {training_loss!r}; pass a callable taking a loader "
                         "batch and returning the step's loss, or None")
    import torch

    if isinstance(other_optimizers, torch.optim.Optimizer) or not isinstance(other_optimizers, (list, tuple)) or not all(
            isinstance(o, torch.optim.Optimizer) for o in other_optimizers):
        raise ValueError(f"Unexpected value for `other_optimizers`: {other_optimizers!r}; pass a list of the run's "
                         "other torch optimizers (empty when there are none)")
