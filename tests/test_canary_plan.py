"""A block's plan (kinds/canary_plan.py) gives each step exactly what the per-step computation gives: the pre-clipped
sum per tensor, its columns and pool positions, K at the sentinels, and the read of an observation, bit for bit; and
the random half of canaries that enters a step is the half an argsort would choose. Deterministic; no false-failure
rate."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.engine.canaries.canary_plan import plan
from lightning_dpaudit.integrations.digits import make_private_digits

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")


def _block(canary="dirac", clipping="flat", **options):
    _, optimizer, _, _ = make_private_digits(seed=0, clipping=clipping)
    auditor = PrivacyAuditor(optimizer, seed=3, canary=canary, **options)
    kind, sampler = auditor.kind, auditor.kind.sampler
    return kind, [sampler.canaries_of(entry) for entry in sampler.upcoming()]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


@pytest.mark.parametrize("canary,clipping,options", [
    ("dirac", "flat", {}), ("random", "flat", {"support": 4}), ("constant", "per_layer", {"support": 3}),
    ("dirac", "flat", {"moving": False}),
])
def test_each_planned_step_equals_the_per_step_computation(canary, clipping, options):
    kind, steps = _block(canary, clipping, **options)
    probe = kind.probe
    planned = plan(probe, steps, kind.sentinels)
    assert len(planned) == len(steps) > 1
    sentinels = torch.as_tensor(kind.sentinels)
    centered = torch.randn(len(probe.pool), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for c, p in zip(steps, planned):
        got, want = p.preclipped_for(c.is_in), probe.preclipped(c, c.is_in)
        assert got is not None
        assert all(_equal(a, b) for a, b in zip(got.values, want.values))
        assert all(_equal(a, b) for a, b in zip(got.columns, want.columns))
        assert np.array_equal(got.pool_positions, want.pool_positions)
        assert all(_equal(m, -v) for m, v in zip(got.negated, got.values))
        assert _equal(got.at_sentinels, probe.gather_sum(want)[sentinels])
        assert _equal(probe.project_on_device(centered, c, p), probe.project_on_device(centered, c))


def test_a_plan_serves_only_the_selection_it_was_made_for():
    kind, steps = _block()
    step = plan(kind.probe, steps, kind.sentinels)[0]
    assert step.preclipped_for(~step.canaries.is_in) is None
    assert step.preclipped_for(step.canaries.is_in) is step.preclipped


def test_a_layout_not_in_tensor_order_is_left_to_the_per_step_way():
    kind, steps = _block()
    reordered = [type(c)(c.tensor[::-1].copy(), c.coords, c.pool_index, c.weights, c.is_in) for c in steps]
    assert all(p.preclipped is None and p.index is None for p in plan(kind.probe, reordered, kind.sentinels))


def test_a_new_clipping_bound_makes_a_new_plan():
    kind, _ = _block()
    first = kind.plant(0)
    bounds = kind.probe.clip_bounds * 2.0
    kind.set_claim(SimpleNamespace(clip_bounds=bounds, noise_multiplier=1.0, max_grad_norm=float(bounds[0])))
    second = kind.plant(1)
    assert np.array_equal(kind.probe.clip_bounds, bounds)
    canaries = second.canaries
    want = kind.probe.preclipped(canaries, canaries.is_in)
    got = second.preclipped(canaries.is_in)
    assert all(_equal(a, b) for a, b in zip(got.values, want.values))
    assert first.canaries.pool_index is not canaries.pool_index


def test_the_half_that_enters_is_the_smallest_half_of_the_draws():
    kind, _ = _block()
    sampler = kind.sampler
    state, order = sampler.rng.bit_generator.state, [o.copy() for o in sampler._order]
    block = sampler._draw_block(8, all_in=False)
    sampler.rng.bit_generator.state, sampler._order = state, order
    k = len(sampler._layout)
    if sampler.moving:  # the placements draw first, as _draw_block does
        np.concatenate([sampler._take(t, q, 8) for t, q in enumerate(sampler.quota) if q], axis=1)
    draws = sampler.rng.random((8, k))
    expected = np.zeros((8, k), dtype=bool)
    np.put_along_axis(expected, np.argsort(draws, axis=1)[:, : k // 2], True, axis=1)
    assert np.array_equal(np.stack([is_in for _, _, is_in in block]), expected)
    assert (expected.sum(axis=1) == k // 2).all()
