"""The canaries pass through the optimizer's own clipping at the exact checks' steps only, compared there with a
correct clipping; in between they enter as a correct clipping leaves them (probe.preclipped), at O(k) cost.
Deterministic; no false-failure rate."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.testing import inject_bug
from lightning_dpaudit.integrations.digits import make_private_digits, train_steps

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")

EVERY_5 = dict(per_sample_check_every=5, per_sample_check_budget=1.0)  # checked steps 1, 6, 11: every due step


def _counting_clips(auditor) -> list:
    """The pipeline steps at which the canaries went through the optimizer's clipping."""
    seen, clip = [], auditor.kind.probe.clip

    def counted(*args, **kwargs):
        seen.append(auditor.pipeline.steps)
        return clip(*args, **kwargs)

    auditor.kind.probe.clip = counted
    return seen


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_the_canaries_are_clipped_by_the_optimizer_only_at_the_checks_steps(clipping):
    model, optimizer, loader, _ = make_private_digits(seed=0, clipping=clipping)
    auditor = PrivacyAuditor(optimizer, seed=1, **EVERY_5)
    clipped = _counting_clips(auditor)
    train_steps(model, optimizer, loader, 12)
    assert clipped == [1, 6, 11]
    result = auditor.result(accounting=False)
    assert not result.findings and result.n_in > 0


def test_with_the_exact_checks_off_every_step_clips_the_canaries():
    model, optimizer, loader, _ = make_private_digits(seed=0)
    auditor = PrivacyAuditor(optimizer, seed=1, per_sample_check_every=0)
    clipped = _counting_clips(auditor)
    train_steps(model, optimizer, loader, 6)
    assert clipped == list(range(6))


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_the_pre_clipped_sum_is_the_optimizer_s_own_clipping(clipping):
    model, optimizer, loader, _ = make_private_digits(seed=0, clipping=clipping)
    auditor = PrivacyAuditor(optimizer, seed=1)
    train_steps(model, optimizer, loader, 1)  # the optimizer holds its state as after a step
    probe, canaries = auditor.kind.probe, auditor.kind.sampler.next_step()
    which = canaries.is_in
    for p in probe.params:
        p.summed_grad = torch.zeros_like(p)
    clipped = probe.clip(optimizer, *probe.canary_rows(canaries, which))
    expected = probe.preclipped(canaries, which)
    got, want = probe.sum_at_pool(clipped), probe.sum_at_pool(expected)
    assert np.abs(want).max() > 0 and np.allclose(got, want, rtol=1e-6, atol=1e-7)
    assert probe.clipping_problem(clipped, expected, auditor.kind.layer_names) is None


def test_an_optimizer_that_does_not_clip_is_found_at_the_first_checked_step():
    model, optimizer, loader, _ = make_private_digits(seed=0)
    inject_bug(optimizer, "no-clipping")
    auditor = PrivacyAuditor(optimizer, seed=1, on_violation=lambda result: None, **EVERY_5)
    train_steps(model, optimizer, loader, 3)
    found = {f.code: f for f in auditor.result(accounting=False).findings}
    assert found["canary_clipping"].first_step == 1
    assert "2 C each" in found["canary_clipping"].message and "2 times a correct clipping" in found["canary_clipping"].message
