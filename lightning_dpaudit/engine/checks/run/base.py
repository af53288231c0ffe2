"""What the run checks share: the clause each watches, and the batch helpers.

The accountant composes one mechanism per step: each record is one row, drawn
independently with probability q (Poisson), whose clipped gradient depends on that
record alone, added to a sum noised with std sigma * C; nothing else learned from
the data leaves the run. A run check watches one clause of that, outside the
optimizer; each is a Check (checks/base.py) of scope "pipeline", whose findings
say the accountant's epsilon does not describe the run.
"""

from __future__ import annotations

import torch

from ....analysis.results import DOES_NOT_DESCRIBE, PIPELINE_CODES  # noqa: F401  (the codes the checks report)
from ..base import PIPELINE, Batch, Check, RunView, StepSeen, batch_tensors, records_in  # noqa: F401


class RunCheck(Check):
    """A check of the run around the optimizer: its findings are `pipeline` findings."""

    scope = PIPELINE


def widest_rows(tensors: list, records: int) -> torch.Tensor:
    """The batch's widest tensor whose leading dimension is the records (each row one record's: the inputs)."""
    return max((t for t in tensors if t.dim() > 0 and t.shape[0] == records), key=lambda t: t.numel())
