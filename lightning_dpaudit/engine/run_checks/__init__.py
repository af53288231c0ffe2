"""The run checks: what the accountant assumes about the run, beyond the optimizer (base.py).

    sampling.py       batches drawn as the accountant composes (Poisson at its q, fresh each step)
    multiplicity.py   one row of the clipped sum per record
    coupling.py       each example's gradient depends on that example alone (at the exact checks' steps)
    outside_dp.py     nothing of the module trained outside the DP optimizer

`RunChecks` builds them in one place and feeds them what the run shows: the loader (`loader`),
each batch it delivers (`batch`), each physical batch the optimizer accumulates (`accumulated`),
each noised step (`step`). The auditor and the callback only call these.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np

from .base import PIPELINE_CODES, RunView, batch_tensors, records_in
from .coupling import CouplingCheck
from .multiplicity import MultiplicityCheck
from .outside_dp import OutsideDPCheck
from .sampling import SamplingCheck
from .watched_loader import WatchedLoader

__all__ = ["PIPELINE_CODES", "RunChecks", "RunView", "check_run_options"]


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


class RunChecks:
    def __init__(self, view: RunView, *, seed: Optional[int], delta: float, training_loss: Optional[Callable],
                 due: Callable[[int], bool], busy: Callable[[], bool]):
        # the fingerprints' own torch generator: seeded from the audit's seed (any size numpy takes), within torch's range
        own_seed = int(np.random.default_rng(None if seed is None else [seed, 29]).integers(2**62))
        self.sampling = SamplingCheck(own_seed, delta)
        self.multiplicity = MultiplicityCheck()
        self.coupling = CouplingCheck(seed, training_loss)
        self.outside = OutsideDPCheck()
        self.checks = (self.sampling, self.multiplicity, self.coupling, self.outside)
        self.due = due  # whether the exact checks compare at a (0-based) step: the coupling replay runs with them
        self.busy = busy  # the audit itself is running the model (canaries, replays): nothing of it is the data's
        self.steps = 0  # noised steps so far
        self.watched: Optional[WatchedLoader] = None
        self.view = view

    @classmethod
    def of(cls, auditor, params, module, other_optimizers, training_loss, seed) -> "RunChecks":
        """The run checks of a PrivacyAuditor: its findings go through its pipeline, its replays with its exact checks."""
        view = RunView(auditor.optimizer, params, module, auditor.kind.module_ref, auditor.accountant,
                       note_problem=lambda *a: auditor.pipeline.note_problem(*a), other_optimizers=list(other_optimizers))
        return cls(view, seed=seed, delta=auditor.options.delta, training_loss=training_loss,
                   due=lambda step: auditor.per_sample_check.due(step), busy=lambda: auditor.per_sample_check.replaying)

    def attach(self, loader=None) -> None:
        """Once the auditor is complete (a finding at attach alarms through it); `loader` is then watched."""
        for check in self.checks:
            check.attach(self.view)
        if loader is not None:
            self.watch(loader)

    def notes(self) -> list:
        """(code, message) said beside the result, no alarm: rows equal to another row of their batch or of the data."""
        notes, in_data, in_batches = [], self.multiplicity.dataset_duplicates, self.sampling.duplicates
        if in_data:
            notes.append(("multiplicity", f"{in_data} row(s) of the training data equal to another of its rows: duplicate "
                          "records, or copies (the claim is one record per person)"))
        if in_batches and not in_data:
            notes.append(("multiplicity", f"{in_batches} row(s) equal to another row of their batch: duplicate records in "
                          "the data, or copies (the claim is one record per person)"))
        return notes

    def loader(self, loader) -> None:
        """The training loader, when it becomes known (the callback reads the Trainer's)."""
        for check in self.checks:
            check.loader(loader)

    def watch(self, loader) -> None:
        """The plain loop's loader: read it, and see each batch it delivers (until `close`)."""
        refuse_unwatchable("loader", loader)
        if self.watched is not None:
            self.watched.restore()
        self.loader(loader)
        self.watched = WatchedLoader(loader, self.batch)

    def batch(self, batch, step_fn: Optional[Callable] = None) -> None:
        """A batch the loader delivered for the coming step; `step_fn(batch)` replays its training step's loss."""
        self._watch_model()
        tensors = batch_tensors(batch)
        records = records_in(batch, tensors)
        self.sampling.batch(tensors, records)
        self.multiplicity.batch_records(records)
        self.coupling.batch(batch, step_fn, due=self.due(self.steps))

    def accumulated(self) -> None:
        """The optimizer is about to clip and accumulate a physical batch of the data."""
        self.multiplicity.accumulated()

    def _watch_model(self) -> None:
        if self.coupling.handles:  # hooked once, when the model is first known
            return
        model = self.view.gradient_module()
        self.coupling.watch(getattr(model, "_module", model), lambda: self.due(self.steps), self.busy)

    def step(self) -> None:
        """A noised step, before its canaries."""
        self._watch_model()
        self.steps += 1
        delivered = self.multiplicity.records if self.multiplicity.fed else None  # the loader's count, else the rows
        self.sampling.records(delivered or self.multiplicity.rows, self.steps)
        for check in self.checks:
            check.step(self.steps)

    def epsilon(self) -> float:
        """Epsilon under the sampling the run used where a valid bound exists (sampling.py); nan where it is the
        accountant's own, inf where no valid bound follows from the noise."""
        try:
            return self.sampling.epsilon()
        except Exception:  # an accountant that cannot compose a fresh history: no figure rather than a fault
            return math.nan

    def status(self) -> str:
        return "; ".join(check.status() for check in self.checks)

    def close(self) -> None:
        self.coupling.close()
        if self.watched is not None:
            self.watched.restore()
            self.watched = None
