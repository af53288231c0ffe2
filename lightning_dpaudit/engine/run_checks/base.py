"""The interface of a run check, and what the run shows it.

The accountant composes one mechanism per step: each record is one row, drawn
independently with probability q (Poisson), whose clipped gradient depends on that
record alone, added to a sum noised with std sigma * C; nothing else learned from
the data leaves the run. A run check watches one clause of that, outside the
optimizer. Each is a small unit with one interface:

    attach(run)       once, with what the run shows at attach (RunView)
    loader(loader)    the training data loader, when it becomes known
    batch(batch)      each batch the loader delivers, before its step
    step(step)        each noised step (1-based), before the canaries are planted
    status()          one line: what it compared, or why nothing

A finding is a certainty (or a test with its own stated false-alarm budget) and
goes through `run.note_problem(code, message, step)`, which raises the alarm; notes
(RunChecks.notes) are said beside the result and alarm nothing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ...analysis.results import DOES_NOT_DESCRIBE, PIPELINE_CODES  # noqa: F401  (the codes the checks report)


@dataclass
class RunView:
    """What a run check may read of the run.

    optimizer    the audited DPOptimizer; params the tensors it noises
    module       the module trained (the LightningModule under Lightning, else the model passed as `module=`)
    gradient_module  () -> the GradSampleModule once the model ran (None before)
    accountant   the run's accountant (None when unknown)
    note_problem (code, message, step): a finding, with the alarm
    """

    optimizer: object
    params: list
    module: Optional[torch.nn.Module]
    gradient_module: Callable[[], Optional[torch.nn.Module]]
    accountant: object
    note_problem: Callable[[str, str, int], None]
    other_optimizers: list = field(default_factory=list)


class RunCheck:
    """One clause of what the accountant assumes about the run (see the module's doc)."""

    def attach(self, run: RunView) -> None:
        self.run = run

    def loader(self, loader) -> None:
        pass

    def batch(self, batch) -> None:
        pass

    def step(self, step: int) -> None:
        pass

    def status(self) -> str:
        return ""


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


def widest_rows(tensors: list, records: int) -> torch.Tensor:
    """The batch's widest tensor whose leading dimension is the records (each row one record's: the inputs)."""
    return max((t for t in tensors if t.dim() > 0 and t.shape[0] == records), key=lambda t: t.numel())
