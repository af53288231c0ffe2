"""The one interface of a check, and what the run shows it.

A check watches one thing the privacy claim rests on (the optimizer's mechanism, the data's
path into it, the run around it) and reports what it verified as findings. Every hook does
nothing unless a check overrides it; the runner (runner.py) calls a hook only on the checks
that override it:

    attach(run)             once, with the read-only view of the run (RunView) and its finding sink
    loader(loader)          the training data loader, when it becomes known
    batch(batch)            each batch the loader delivers, before its step (Batch)
    accumulate()            each physical batch, before the optimizer clips and accumulates it
    step(seen)              each noised step, before its canaries (StepSeen: what the step was made of)
    around_step(step, run_step)  wraps the noised step; must call run_step() exactly once
    status()                one line: what it compared, counted from what ran, or why nothing
    notes()                 (code, message) said beside the result, never an alarm
    close()                 release hooks and patches

A check the run gives nothing to do (the replicas' check on one process) sets `idle` in attach: the runner then
calls none of its hooks of the run (loader, batch, accumulate, step, around_step).

A finding is a certainty (or a test with its own stated false-alarm budget): `run.report(code,
message, step)`, which raises the alarm. A check that raises is stopped alone by the runner.
Each check declares the finding codes it may report (`codes`) and their scope (`scope`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

MECHANISM, DATA_PATH, PIPELINE = "mechanism", "data path", "pipeline"
SCOPES = (MECHANISM, DATA_PATH, PIPELINE)


@dataclass
class RunView:
    """What a check may read of the run.

    optimizer    the audited DPOptimizer; params the tensors it noises
    module       the module trained (the LightningModule under Lightning, else the model passed as `module=`)
    gradient_module  () -> the GradSampleModule once the model ran (None before)
    accountant   the run's accountant (None when unknown)
    report       (code, message, step): a finding, with the alarm
    steps        () -> the noised steps so far
    names        the tensors' names; seed the audit's seed (None: fresh); delta the claim's delta
    ghost        ghost clipping (per-sample norms, no per-sample gradients); sharded: FSDP
    ledger       () -> a new accumulation ledger of the optimizer's release path (checks/exact/accumulation.py)
    exact        the auditor's per_sample_check_every / _examples / _budget, as {"every", "examples", "budget"}
    training_loss  (batch) -> the plain loop's loss (None when not given)
    passes_on    (error) -> whether an error is the alarm's own (the user's on_violation), never a check's fault
    stop         (check, error): stop a check alone (the runner sets it)
    claims       the step's claim reader (claims/step_claim.py: the claim, and what the accountant composed)
    checksum_every  the auditor's steps between comparisons of the replicas' parameters
    ghost_clipping  ghost clipping of the canaries' rows by the module's own code (release/ghost.py), or None
    """

    optimizer: object
    params: list
    module: Optional[torch.nn.Module]
    gradient_module: Callable[[], Optional[torch.nn.Module]]
    accountant: object
    report: Callable[[str, str, int], None]
    steps: Callable[[], int] = lambda: 0
    other_optimizers: list = field(default_factory=list)
    names: list = field(default_factory=list)
    seed: Optional[int] = None
    delta: float = 1e-5
    ghost: bool = False
    sharded: bool = False
    ledger: Callable[[], object] = lambda: None
    exact: dict = field(default_factory=dict)
    training_loss: Optional[Callable] = None
    passes_on: Callable[[BaseException], bool] = lambda error: False
    stop: Callable = lambda check, error: None
    claims: object = None
    checksum_every: int = 0
    ghost_clipping: object = None
    busy: int = 0  # > 0 while the audit itself runs the model (canaries, replays): nothing of it is the data's

    @contextlib.contextmanager
    def own_work(self):
        """The audit runs the model or the optimizer's code itself: checks see none of it as the data's."""
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1


class Batch:
    """A batch the loader delivered: `value` as delivered, its `tensors` and `records` (computed once, when asked),
    `step_fn(batch)` the training step's loss for a replay (None when unknown)."""

    __slots__ = ("value", "step_fn", "_tensors", "_records")

    def __init__(self, value, step_fn: Optional[Callable] = None):
        self.value, self.step_fn = value, step_fn
        self._tensors = self._records = None

    @property
    def tensors(self) -> list:
        if self._tensors is None:
            self._tensors = batch_tensors(self.value)
        return self._tensors

    @property
    def records(self) -> Optional[int]:
        if self._records is None:
            self._records = (records_in(self.value, self.tensors),)
        return self._records[0]


@dataclass(frozen=True)
class StepSeen:
    """A noised step as the run made it: its number (from 1), the records the loader delivered for it (None when
    unknown, `fed` False when no loader feeds the audit) and the rows the optimizer clipped (its physical batches')."""

    step: int
    records: Optional[int]
    rows: int
    fed: bool


class Check:
    """One unit of the audit (see the module's doc). Subclasses set `name`, `scope` and `codes`."""

    name = "check"
    scope = PIPELINE
    codes: tuple = ()
    stopped: Optional[str] = None  # "stopped at step N: <error>" once stopped (by the runner, or by itself)
    idle = False  # set by attach when the run gives the check nothing to do: no hook of the run is called then

    def attach(self, run: RunView) -> None:
        self.run = run

    def loader(self, loader) -> None:
        pass

    def batch(self, batch: Batch) -> None:
        pass

    def accumulate(self) -> None:
        pass

    def step(self, seen: StepSeen) -> None:
        pass

    def around_step(self, step: int, run_step: Callable[[], None]) -> None:
        run_step()

    def status(self) -> str:
        return ""

    def notes(self) -> list:
        return []

    def close(self) -> None:
        pass


HOOKS = ("attach", "loader", "batch", "accumulate", "step", "around_step", "status", "notes", "close")
RUN_HOOKS = ("loader", "batch", "accumulate", "step", "around_step")  # what an idle check is left out of


def overrides(check: Check, hook: str) -> bool:
    """Whether `check` does something at `hook` (its class overrides the interface's method)."""
    return getattr(type(check), hook) is not getattr(Check, hook)


def batch_tensors(batch) -> list:
    """The tensors of a loader's batch (tensors, tuples, lists, dicts, objects with tensor attributes such as
    Hugging Face's BatchEncoding), in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, (tuple, list)):
        if all(isinstance(b, torch.Tensor) for b in batch):  # the common (inputs, labels)
            return list(batch)
        return [t for b in batch for t in batch_tensors(b)]
    if isinstance(batch, dict) or hasattr(batch, "items"):
        return [t for b in batch.values() for t in batch_tensors(b)]
    return []


def records_in(batch, tensors: Optional[list] = None) -> Optional[int]:
    """The number of records in a loader's batch: the leading size most of its tensors share (None when no size does).
    `tensors`: the batch's tensors (batch_tensors), when already listed."""
    sizes = [t.shape[0] for t in (batch_tensors(batch) if tensors is None else tensors) if t.dim() > 0]
    if sizes and sizes.count(sizes[0]) == len(sizes):
        return sizes[0]
    common = Counter(sizes).most_common(2)
    if not common or (len(common) > 1 and common[0][1] == common[1][1]):
        return None  # no tensor, or no size most tensors share (a sequence-first layout): unknown
    return common[0][0]
