"""The cause the audit names is the true one: a run that diverged, a claim float32 cannot hold, an error of Opacus's
own step and a module that is not the optimizer's are each named as what they are, never as a leak.

Each test is deterministic (fixed seeds) and takes a few seconds on the digits CNN.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.integrations.bugs import inject_bug
from lightning_dpaudit.integrations.digits import make_private_digits, train_steps

warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")
warnings.filterwarnings("ignore", message=".*Full backward hook.*")
PER_STEP = 1024  # the auto canaries per step on the digits CNN's 9,802 parameters


def _codes(result) -> list:
    return [f.code for f in result.findings]


def _untouched(optimizer) -> bool:
    return not {"add_noise", "step"} & set(vars(optimizer)) and not hasattr(optimizer, "_dpaudit_auditor")


# ------------------------------------------------------------------ a run that diverged


def _nan_parameter(model, optimizer, loader):
    train_steps(model, optimizer, loader, 3)
    with torch.no_grad():
        next(model.parameters())[0].fill_(float("nan"))


@pytest.mark.parametrize("private,before,first", [
    ({"noise_multiplier": 1e30}, None, 2),  # the update of step 1 overflows the forward pass of step 2
    ({"max_grad_norm": 1e18, "lr": 1e30}, None, 2),
    ({"lr": 1e30}, None, 2),
    ({}, _nan_parameter, 4),  # a parameter set to NaN after step 3
], ids=["noise-1e30", "clipping-1e18-lr-1e30", "lr-1e30", "nan-parameter"])
@pytest.mark.parametrize("check_every", [1, 8])
def test_a_run_whose_values_turn_non_finite_is_named_training_diverged_not_a_leak(private, before, first, check_every):
    model, optimizer, loader, _ = make_private_digits(seed=0, **private)
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1, check_every=check_every,
                             per_sample_check_every=1, per_sample_check_budget=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if before is not None:
            before(model, optimizer, loader)
        done = auditor.steps
        train_steps(model, optimizer, loader, 12 - done)  # plain Opacus trains on, on non-finite values
        result = auditor.result()
    assert not any(math.isfinite(float(p.detach().float().sum())) for p in model.parameters())
    assert _codes(result) == ["training_diverged"], result.findings
    diverged = result.findings[0]
    assert diverged.first_step == first and f"step {first}" in diverged.message
    assert not result.violation and result.audit_failed is None
    assert result.steps == 12
    assert result.n_in + result.n_out == PER_STEP * (first - 1)  # nothing observed from the divergence on
    assert f"training diverged at step {first}" in result.data_path
    assert str(result).splitlines()[0].startswith("OK: no leak beyond the claim detected before step")
    assert not [w for w in caught if "stopped" in str(w.message) or "VIOLATION" in str(w.message)], \
        [str(w.message) for w in caught]


# ------------------------------------------------------------------ a claim float32 cannot hold


@pytest.mark.parametrize("attribute,value,message", [
    ("max_grad_norm", 1e-40, r"max_grad_norm: 1e-40; .*float32"),  # subnormal in float32
    ("max_grad_norm", 1e-45, r"max_grad_norm: 1e-45; .*float32"),
    ("max_grad_norm", 1e39, r"max_grad_norm: 1e\+39; .*float32"),  # inf in float32
    ("max_grad_norm", 1e30, r"max_grad_norm: 1e\+30; canaries of norm .* = 2e\+30 .*float32"),  # canary norms inf
    ("noise_multiplier", 1e-300, r"noise_multiplier: 1e-300; .*noise_multiplier \* max_grad_norm = 1e-300.*float32"),
    ("noise_multiplier", 1e39, r"noise_multiplier: 1e\+39; .*noise_multiplier \* max_grad_norm = 1e\+39.*float32"),
])
def test_a_claim_float32_cannot_hold_is_refused_at_attach(attribute, value, message):
    _, optimizer, _, _ = make_private_digits(seed=0)
    setattr(optimizer, attribute, value)
    with pytest.raises(ValueError, match=message):
        PrivacyAuditor(optimizer)
    assert _untouched(optimizer)


def test_a_float32_subnormal_clipping_bound_is_refused_not_a_false_alarm():
    """At C = 1e-45 the clip factors round to other values than C / norm: the exact check saw a wrong clipped sum."""
    _, optimizer, _, _ = make_private_digits(seed=0, max_grad_norm=1e-45)
    with pytest.raises(ValueError, match=r"Unexpected value for the optimizer's max_grad_norm: 1e-45"):
        PrivacyAuditor(optimizer)
    _, optimizer, _, _ = make_private_digits(seed=0, clipping="per_layer", max_grad_norm=[1.0] * 7 + [1e-40])
    with pytest.raises(ValueError, match=r"max_grad_norm: 1e-40"):
        PrivacyAuditor(optimizer)


# ------------------------------------------------------------------ an error of Opacus's own step


class _Once:
    """Raises `error` at the `at`-th call, else calls `fn`."""

    def __init__(self, fn, at: int, error: Exception):
        self.fn, self.at, self.error, self.calls = fn, at, error, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return self.fn(*args, **kwargs)


def _break(where, optimizer, engine, error):
    if where == "step hook":
        optimizer.step_hook = _Once(optimizer.step_hook, 2, error)
    elif where == "accountant":
        engine.accountant.step = _Once(engine.accountant.step, 2, error)
    else:
        inner = optimizer.original_optimizer
        inner.step = _Once(inner.step, 2, error)


@pytest.mark.parametrize("where", ["step hook", "accountant", "original step"])
def test_an_error_of_opacus_step_is_passed_on_unchanged_and_named_not_a_leak(where):
    model, optimizer, loader, engine = make_private_digits(seed=0)
    auditor = PrivacyAuditor(optimizer, module=model, seed=1, check_every=1)
    error = RuntimeError("the step broke")
    _break(where, optimizer, engine, error)
    raised = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            try:
                train_steps(model, optimizer, loader, 1)
            except RuntimeError as e:
                raised.append(e)
        result = auditor.result()
    assert len(raised) == 1 and raised[0] is error  # passed on, the same exception
    assert _codes(result) == ["opacus_error"], result.findings
    found = result.findings[0]
    assert found.first_step == 2 and "Opacus" in found.message and "RuntimeError: the step broke" in found.message
    assert not result.violation and result.audit_failed is None and result.steps == 6
    assert not [w for w in caught if "VIOLATION" in str(w.message)]


def test_what_the_closure_or_the_alarm_raises_is_not_opacus_error():
    model, optimizer, loader, _ = make_private_digits(seed=0)
    auditor = PrivacyAuditor(optimizer, module=model, seed=1, check_every=1)
    train_steps(model, optimizer, loader, 1)

    def closure():
        raise KeyError("the user's loss")

    with pytest.raises(KeyError, match="the user's loss"):
        optimizer.step(closure)
    train_steps(model, optimizer, loader, 2)
    assert _codes(auditor.result()) == []

    model, optimizer, loader, _ = make_private_digits(seed=0)
    inject_bug(optimizer, "no-noise")

    class Stop(Exception):
        pass

    def stop(result):
        raise Stop()

    auditor = PrivacyAuditor(optimizer, module=model, seed=1, check_every=1, on_violation=stop)
    with pytest.raises(Stop):
        train_steps(model, optimizer, loader, 3)
    assert "opacus_error" not in _codes(auditor.result()) and auditor.result().violation


# ------------------------------------------------------------------ a module that is not the optimizer's


def test_a_module_that_is_not_the_optimizers_is_refused_at_attach():
    model, optimizer, _, _ = make_private_digits(seed=0)
    other, _, _, _ = make_private_digits(seed=1)
    for module in (other, nn.Linear(4, 2)):
        with pytest.raises(ValueError, match=r"`module`: .* none of its parameters are the optimizer's"):
            PrivacyAuditor(optimizer, module=module)
        assert _untouched(optimizer)
    wrapper = nn.ModuleDict({"model": model, "head": nn.Linear(10, 2)})  # the optimizer's parameters and others
    PrivacyAuditor(optimizer, module=wrapper).detach()
    PrivacyAuditor(optimizer, module=model).detach()
