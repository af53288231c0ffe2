"""Compressed canary rows: the same observations and update as parameter-shaped rows, at k x k size."""

import warnings

import numpy as np
import pytest
import torch

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.integrations.digits import make_private_digits, train_steps
from lightning_dpaudit.engine.canaries.gradient_probe import CompressedRowsFallbackWarning

warnings.filterwarnings("ignore", message=".*Full backward hook.*")


def _run(*, dense: bool, clipping="flat", steps=12, transform=None, **options):
    model, opt, loader, _ = make_private_digits(seed=4, clipping=clipping)
    if transform is not None:
        opt = transform(opt)
    auditor = PrivacyAuditor(opt, seed=2, **options)
    auditor.kind.probe.dense = dense
    train_steps(model, opt, loader, steps)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return auditor, params


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("canary", ["dirac", "random"])
def test_compressed_and_dense_rows_give_the_same_observations_and_update(clipping, canary):
    compressed, params_c = _run(dense=False, clipping=clipping, canary=canary)
    dense, params_d = _run(dense=True, clipping=clipping, canary=canary)
    a, b = compressed.observations(), dense.observations()
    assert np.array_equal(a["is_in"], b["is_in"]) and np.array_equal(a["layer"], b["layer"])
    np.testing.assert_allclose(a["value"], b["value"], rtol=0, atol=1e-5)
    assert torch.max(torch.abs(params_c - params_d)).item() <= 1e-6
    assert compressed.result().n_in == dense.result().n_in


def test_compressed_rows_are_sized_by_the_canaries_not_the_model():
    auditor, _ = _run(dense=False, steps=2)
    canaries = auditor.kind.sampler.next_step()
    rows, columns = auditor.kind.probe.canary_rows(canaries, canaries.is_in)
    k_in = auditor.options.canaries_per_step // 2
    assert [r.shape[0] for r in rows] == [k_in] * len(rows)
    assert sum(r.shape[1] for r in rows) == k_in  # dirac: one column per in-canary, whatever the model's size
    assert [len(c) for c in columns] == [r.shape[1] for r in rows]
    for r, cols, p in zip(rows, columns, auditor.kind.probe.params):  # each row is its canary's value at its column
        in_tensor = torch.nonzero(r)
        assert len(in_tensor) == r.shape[1] and (len(cols) == 0 or int(cols.max()) < p.numel())


class ShapeNeedingOptimizer:
    """A user's clipping that reshapes each grad_sample to its parameter's shape."""

    def clip_and_accumulate(self):
        for p in self.params:
            p.grad_sample = p.grad_sample.reshape(len(p.grad_sample), *p.shape)
        super().clip_and_accumulate()


def _needs_shapes(opt):
    opt.__class__ = type("ShapeNeeding" + type(opt).__name__, (ShapeNeedingOptimizer, type(opt)), {})
    return opt


def test_clipping_that_needs_parameter_shapes_falls_back_to_dense_rows_once():
    reference, params_ref = _run(dense=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback, params = _run(dense=False, transform=_needs_shapes)
    fallbacks = [w for w in caught if issubclass(w.category, CompressedRowsFallbackWarning)]
    assert len(fallbacks) == 1 and "parameter-shaped rows" in str(fallbacks[0].message)
    assert "MB" in str(fallbacks[0].message) and fallback.probe.dense
    np.testing.assert_allclose(fallback.observations()["value"], reference.observations()["value"], atol=1e-5)
    assert torch.max(torch.abs(params - params_ref)).item() <= 1e-6


def test_summed_grad_is_the_data_sum_again_after_the_step():
    model, opt, loader, _ = make_private_digits(seed=1)
    PrivacyAuditor(opt, seed=0)
    images, labels = next(iter(loader))
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    opt.pre_step()
    audited = [p.summed_grad.clone() for p in opt.params]
    opt.zero_grad()
    model2, opt2, _, _ = make_private_digits(seed=1)
    torch.nn.functional.cross_entropy(model2(images), labels).backward()
    opt2.pre_step()
    for a, b in zip(audited, opt2.params):
        assert torch.equal(a, b.summed_grad)
