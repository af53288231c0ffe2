"""A Subset whose index map names the same record twice: one record is several rows, certain at attach."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from opacus import PrivacyEngine
from torch.utils.data import ConcatDataset, DataLoader, Subset

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.engine.checks.run.multiplicity import base_indices, repeated_indices
from lightning_dpaudit.integrations.digits import DigitsCNN, digits_dataset

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")


def _audit(data):
    """The auditor of a private digits run over `data` (Poisson sampling), at attach."""
    torch.manual_seed(0)
    model = DigitsCNN()
    loader = DataLoader(data, batch_size=64)
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=True,
        noise_generator=torch.Generator().manual_seed(1),
    )
    return PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1)


def _codes(result):
    return [(f.code, f.first_step) for f in result.findings]


def test_a_subset_oversampling_a_rare_class_is_a_finding_at_attach():
    data = digits_dataset()
    labels = data.tensors[1].numpy()
    idx = list(range(1000))
    rare = [i for i in idx if labels[i] == 0]  # oversample the zeros: each named twice
    result = _audit(Subset(data, idx + rare)).result()
    assert _codes(result) == [("multiplicity", 0)]
    assert (f"a Subset of the training data names {len(rare)} record(s) of its TensorDataset more than once "
            f"(index {rare[0]} 2 times; {len(rare)} extra rows)") in result.findings[0].message
    assert result.violation
    assert not [n for n in result.notes if n.startswith("multiplicity: ")]  # the repeats are the finding, not a note


def test_a_subset_without_repeats_is_quiet():
    data = digits_dataset()
    order = np.random.default_rng(0).permutation(len(data))[:1500].tolist()
    result = _audit(Subset(data, order)).result()
    assert not result.violation, _codes(result)
    assert "multiplicity" not in [c for c, _ in _codes(result)]


def test_a_nested_subset_repeating_a_row_of_its_inner_subset_is_a_finding():
    data = digits_dataset()
    inner = Subset(data, list(range(100, 1100)))
    result = _audit(Subset(inner, [0, 0, 1] + list(range(2, 1000)))).result()
    assert _codes(result) == [("multiplicity", 0)]
    assert "names 1 record(s) of its TensorDataset more than once (index 100 2 times; 1 extra rows)" in (
        result.findings[0].message)


def test_a_concat_of_two_subsets_sharing_an_index_of_the_same_base_is_a_finding():
    data = digits_dataset()
    parts = ConcatDataset([Subset(data, range(0, 900)), Subset(data, range(899, 1797))])  # index 899 in both
    result = _audit(parts).result()
    assert _codes(result) == [("multiplicity", 0)]
    assert "parts 0 (Subset) and 1 (Subset) hold the same records" in result.findings[0].message


def test_a_concat_part_repeating_its_own_index_is_a_finding():
    data = digits_dataset()
    parts = ConcatDataset([Subset(data, [5, 5, 6]), Subset(data, range(7, 1797))])  # disjoint parts
    result = _audit(parts).result()
    assert _codes(result) == [("multiplicity", 0)]
    assert "names 1 record(s) of its TensorDataset more than once (index 5 2 times; 1 extra rows)" in (
        result.findings[0].message)


def test_the_index_map_composes_nested_subsets_and_counts_negative_indices_from_the_end():
    data = digits_dataset()
    base, indices = base_indices(Subset(Subset(data, [10, 20, -1]), torch.tensor([2, 0, 0])))
    assert base is data and indices.tolist() == [1796, 10, 10]
    assert base_indices(data) is None
    assert repeated_indices(Subset(data, [3, -1796])) is None  # -1796 is record 1 of 1797
    assert "index 1 2 times" in repeated_indices(Subset(data, [1, -1796]))


def test_a_million_indices_are_checked_at_once():
    data = digits_dataset()
    indices = np.arange(1_000_000) % len(data)
    assert "1797 record(s)" in repeated_indices(Subset(data, indices))
