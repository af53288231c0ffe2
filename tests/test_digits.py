"""Tests for the bundled digits data, DigitsCNN and make_private_digits (all deterministic)."""

import pytest
import torch
from opacus.optimizers import DPOptimizer, DPPerLayerOptimizer
from torch import nn

from lightning_dpaudit.integrations.digits import DigitsCNN, digits_dataset, make_private_digits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dataset_shape_dtype_range_labels(dtype):
    ds = digits_dataset(dtype=dtype)
    images, labels = ds.tensors
    assert len(ds) == 1797
    assert images.shape == (1797, 1, 8, 8) and images.dtype == dtype
    assert labels.shape == (1797,) and labels.dtype == torch.int64
    assert images.min().item() == 0.0 and images.max().item() == 1.0
    assert set(labels.tolist()) == set(range(10))
    # pixel / 16: raw pixels are integers 0..16
    assert torch.equal(images * 16, (images * 16).round())


def test_model_forward_shape_and_size():
    torch.manual_seed(0)
    model = DigitsCNN()
    out = model(torch.rand(5, 1, 8, 8))
    assert out.shape == (5, 10)
    params = list(model.parameters())
    assert len(params) == 8  # conv/linear weights and biases
    assert sum(p.numel() for p in params) == 9802
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _train_step(model, optimizer, data_loader):
    x, y = next(iter(data_loader))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    nn.CrossEntropyLoss()(model(x), y).backward()
    optimizer.step()
    return before


@pytest.mark.parametrize("clipping, cls", [("flat", DPOptimizer), ("per_layer", DPPerLayerOptimizer)])
def test_make_private_returns_dp_objects_and_trains(clipping, cls):
    model, optimizer, loader, engine = make_private_digits(clipping=clipping, noise_multiplier=1.3)
    assert type(optimizer) is cls
    assert optimizer.noise_multiplier == 1.3
    assert optimizer.max_grad_norm == pytest.approx(1.0, rel=1e-6)
    assert optimizer.expected_batch_size == 61  # int(1797 / ceil(1797 / 64))
    if clipping == "per_layer":
        assert len(optimizer.max_grad_norms) == 8
    before = _train_step(model, optimizer, loader)
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert len(engine.accountant.history) == 1
    assert engine.get_epsilon(1e-5) > 0


def test_make_private_is_deterministic_per_seed():
    runs = []
    for seed in (3, 3, 4):
        model, optimizer, loader, _ = make_private_digits(seed=seed)
        _train_step(model, optimizer, loader)
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_make_private_options_float64_sum_no_poisson():
    model, optimizer, loader, engine = make_private_digits(
        dtype=torch.float64, loss_reduction="sum", poisson_sampling=False, batch_size=32, accountant="prv"
    )
    assert optimizer.loss_reduction == "sum"
    assert engine.accountant.mechanism() == "prv"
    assert all(p.dtype == torch.float64 for p in model.parameters())
    x, _ = next(iter(loader))
    assert x.shape == (32, 1, 8, 8) and x.dtype == torch.float64
    _train_step(model, optimizer, loader)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_per_layer_accepts_explicit_list():
    norms = [0.5] * 8
    _, optimizer, _, _ = make_private_digits(clipping="per_layer", max_grad_norm=norms)
    assert optimizer.max_grad_norms == norms
