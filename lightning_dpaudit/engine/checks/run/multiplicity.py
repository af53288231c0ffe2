"""Multiplicity: is each record one row of the clipped sum?

rows         each step, the rows the optimizer clipped (the per-sample gradients' or, under ghost
             clipping, the per-sample norms' leading size, summed over the step's physical batches)
             against the records the loader delivered for the step. More rows than records means
             some record became several rows, each clipped to C on its own: its sensitivity is k C
             while the noise is for C. Certain: finding `multiplicity`.
dataset      a ConcatDataset whose parts reach the same underlying dataset or tensor storage (a
             dataset concatenated with transformed copies of itself): each record is several rows
             of the data. Certain at attach: finding `multiplicity`.
indices      a Subset (nested Subsets, or a ConcatDataset part that is one) whose index map names
             the same record of the dataset under it more than once (oversampling a class with
             `Subset(ds, idx + idx_rare)`): that record is several rows. Certain at attach, from the
             indices alone (one numpy unique): finding `multiplicity`.
mirrored     rows of a tensor dataset that are other rows' mirror images (dataset_copies.py): a
             dataset stacked with augmented copies. Finding `multiplicity` at attach.
duplicates   rows equal to another row of the same batch (fingerprints.py), and rows of a tensor
             dataset equal to another of its rows (dataset_copies.py). Poisson sampling draws
             a record at most once a step, so these are duplicate records in the data or copies: a
             note naming the count, since the claim is one record per person.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..exact.sharded_replay import module_norms
from .base import DOES_NOT_DESCRIBE, RunCheck
from .dataset_copies import mirrored_finding, scan

CODE = "multiplicity"
ROWS_NOT_RECORDS = "rows_not_records"
DEPTH = 4  # attributes followed from a part of a ConcatDataset to what it wraps


def clipped_rows(params, gradient_module=lambda: None) -> Optional[int]:
    """The leading size of the per-sample gradients (or ghost clipping's per-sample norms) the optimizer holds now;
    FSDP's ghost clipping keeps its norms on the modules of `gradient_module()` (norm_sample, one per tensor)."""
    for p in params:
        held = getattr(p, "grad_sample", None)
        if held is None:
            held = getattr(p, "_norm_sample", None)
        if isinstance(held, list):
            return sum(h.shape[0] for h in held)
        if torch.is_tensor(held) and held.dim() > 0:
            return int(held.shape[0])
    gsm = gradient_module()
    on_modules = list(module_norms(gsm).values()) if hasattr(gsm, "iterate_submodules") else []
    return int(on_modules[0].shape[0]) if on_modules else None


def sources(obj, depth: int = DEPTH) -> set:
    """What a dataset reaches: ("dataset", id) of itself and of the datasets it wraps (attributes, within `depth`),
    ("tensor", storage, offset, shape) of a TensorDataset's tensors, and ("row", source, index) of a Subset's rows.
    Custom datasets holding bare tensors reach nothing here (which rows they use is theirs to say)."""
    from torch.utils.data import Dataset, Subset, TensorDataset

    if depth < 0 or not isinstance(obj, Dataset):
        return set()
    if isinstance(obj, Subset):
        return {("row", source, int(i)) for source in sources(obj.dataset, depth - 1) for i in obj.indices}
    found = {("dataset", id(obj))}
    if isinstance(obj, TensorDataset):
        found |= {("tensor", t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) for t in obj.tensors}
    for value in vars(obj).values():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            found |= sources(item, depth - 1)
    return found


def _overlap(a: set, b: set) -> bool:
    """Two parts share a record: a common source, or a Subset's row of a source the other reaches whole."""
    if a & b:
        return True
    whole_a = {s for s in a if s[0] != "row"}
    whole_b = {s for s in b if s[0] != "row"}
    return any(s[0] == "row" and s[1] in whole_b for s in a) or any(s[0] == "row" and s[1] in whole_a for s in b)


def concatenated_copies(dataset) -> Optional[str]:
    """A sentence when the dataset concatenates parts that reach the same records (ConcatDataset, at any depth)."""
    from torch.utils.data import ConcatDataset

    if not isinstance(dataset, ConcatDataset):
        inner = getattr(dataset, "dataset", None)
        return None if inner is None or inner is dataset else concatenated_copies(inner)
    reached = [sources(part) for part in dataset.datasets]
    for i in range(len(reached)):
        for j in range(i + 1, len(reached)):
            if _overlap(reached[i], reached[j]):
                a, b = type(dataset.datasets[i]).__name__, type(dataset.datasets[j]).__name__
                return (f"the training data is a ConcatDataset whose parts {i} ({a}) and {j} ({b}) hold the same records: "
                        "a record is several rows of the data (copies or transformed copies), each clipped on its own, "
                        "while the accountant counts one")
    return None


def base_indices(dataset, depth: int = DEPTH) -> Optional[tuple]:
    """(base, indices) when the dataset is a chain of Subsets: the dataset under the chain and, for each row, the
    index in it of the record the row is (int64, negative indices counted from the end). None when not a Subset."""
    from torch.utils.data import Subset

    indices = None
    while isinstance(dataset, Subset) and depth >= 0:
        inner = dataset.indices.cpu().numpy() if torch.is_tensor(dataset.indices) else dataset.indices
        inner = np.asarray(inner, dtype=np.int64).reshape(-1)
        indices = inner if indices is None else inner[indices]
        dataset, depth = dataset.dataset, depth - 1
    if indices is None:
        return None
    try:
        size = len(dataset)
    except TypeError:  # a dataset without a length: negative indices are left as they are
        return dataset, indices
    return dataset, np.where(indices < 0, indices + size, indices)


def repeated_rows(dataset) -> int:
    """The rows of a chain of Subsets beyond one per record of the dataset under it (0 when not a Subset)."""
    mapped = base_indices(dataset)
    return 0 if mapped is None else len(mapped[1]) - len(np.unique(mapped[1]))


def repeated_indices(dataset) -> Optional[str]:
    """A sentence when a Subset of the training data (the data itself, or a ConcatDataset's part, at any depth)
    names the same record of the dataset under it more than once."""
    from torch.utils.data import ConcatDataset

    if isinstance(dataset, ConcatDataset):
        return next(filter(None, map(repeated_indices, dataset.datasets)), None)
    mapped = base_indices(dataset)
    if mapped is None:
        return None
    base, indices = mapped
    values, counts = np.unique(indices, return_counts=True)
    repeated = np.flatnonzero(counts > 1)
    if not len(repeated):
        return None
    example = repeated[0]
    return (f"a Subset of the training data names {len(repeated)} record(s) of its {type(base).__name__} more "
            f"than once (index {int(values[example])} {int(counts[example])} times; "
            f"{len(indices) - len(values)} extra rows): a record is several rows of the data (oversampling?), each "
            "clipped on its own, while the accountant counts one")


class MultiplicityCheck(RunCheck):
    name = "rows per record"
    codes = (CODE, ROWS_NOT_RECORDS)

    def __init__(self):
        self.compared = 0
        self.shapes: list = []  # the tensor shapes of each batch with unknown records since the last noised step
        self.fed = False  # batches reach the check (a loader or the callback feeds it)
        self.found = False
        self.dataset_duplicates = 0  # rows of the dataset equal to an earlier row (when it was scanned)

    def loader(self, loader) -> None:
        dataset = getattr(loader, "dataset", None)
        copies = scan(dataset)
        if copies is not None:  # equal rows beyond those the index map repeats (the finding below names those)
            self.dataset_duplicates = copies.duplicates - repeated_rows(dataset)
        problem = concatenated_copies(dataset) or repeated_indices(dataset) or mirrored_finding(copies)
        if problem is not None:
            self._found(problem, 0)

    def batch(self, batch) -> None:
        if batch.records is None:  # a layout whose records are unknown: kept for _sequence_first
            self.shapes.append([tuple(t.shape) for t in batch.tensors])

    def step(self, seen) -> None:
        """The rows the optimizer clipped for the step against the records the loader delivered for it."""
        rows, records, step = seen.rows, seen.records, seen.step
        shapes, self.shapes = self.shapes, []
        self.fed = seen.fed
        if seen.fed and records is None and rows and not self.found and len(shapes) == 1:
            self._sequence_first(shapes[0], rows, step)
        if not seen.fed or records is None or not rows:
            return
        self.compared += 1
        if rows > records and not self.found:
            self._found(f"the optimizer clipped {rows} rows at step {step} for the {records} records the loader "
                        f"delivered: a record became several rows (copies made in the step?), each clipped to C, so "
                        f"one record moves the sum by up to {rows / max(records, 1):.3g} C while the noise is for C", step)

    def _sequence_first(self, shapes: list, rows: int, step: int) -> None:
        """Rows that are not records: the rows clipped are the leading size of the batch's inputs, whose second
        dimension is the records a one-dimensional tensor of the batch (the targets) counts. Certain."""
        targets = {s[0] for s in shapes if len(s) == 1 and s[0] != rows}
        inputs = [s for s in shapes if len(s) >= 2 and s[0] == rows and s[1] in targets]
        if inputs:
            self.found = True
            self.run.report(ROWS_NOT_RECORDS, (
                f"{DOES_NOT_DESCRIBE}: the optimizer clipped {rows} rows at step {step}, the leading size of the batch's "
                f"inputs of shape {list(inputs[0])}, whose second dimension holds the {inputs[0][1]} records its targets "
                "count: the rows are not records (sequence-first data read as batch-first; make_private(..., "
                "batch_first=False) reads it right), so one record reaches every row, each clipped to C"), step)

    def _found(self, message: str, step: int) -> None:
        self.found = True
        self.run.report(CODE, f"{DOES_NOT_DESCRIBE}: {message}", step)

    def notes(self) -> list:
        if not self.dataset_duplicates:
            return []
        return [(CODE, f"{self.dataset_duplicates} row(s) of the training data equal to another of its rows: duplicate "
                 "records, or copies (the claim is one record per person)")]

    def status(self) -> str:
        if not self.fed:
            return "rows per record (not compared: no loader seen)"
        return f"rows per record ({self.compared} steps compared)"
