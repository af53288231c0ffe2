"""Audit an Opacus optimizer from a test suite: `audit_optimizer(...)` fails loudly on a leak.

Example (in a DP library's own tests):

    from lightning_dpaudit.testing import audit_optimizer
    def test_my_optimizer_is_private():
        audit_optimizer(MyDPOptimizer, steps=600)   # raises PrivacyAuditFailure on a leak

The bug zoo (`lightning_dpaudit.bugs`) holds deliberately broken optimizers to check
that an audit catches what it should.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional, Type

import torch

from ..engine.auditor import PrivacyAuditor
from ..engine.canaries.input_canaries import INPUT_KINDS, InputCanaries
from .bugs import BUGS, inject_bug, list_bugs
from .digits import digits_holdout, make_private_digits, train_steps

HOLDOUT = 256  # digits left out of training for input canaries
from ..analysis.results import AuditResult, violation_moment

__all__ = ["BUGS", "AuditIncomplete", "PrivacyAuditFailure", "audit_optimizer", "inject_bug", "list_bugs", "train_audited"]


class PrivacyAuditFailure(AssertionError):
    """The audited optimizer leaked more than its noise multiplier claims."""


class AuditIncomplete(PrivacyAuditFailure):
    """The audit itself failed during training (its result's `audit_failed`): what it saw stops there or is
    incomplete, so its verdict cannot pass a test. `result` is the AuditResult as far as it goes."""

    def __init__(self, message: str, result: AuditResult):
        super().__init__(message)
        self.result = result


def _incomplete(label: str, result: AuditResult) -> AuditIncomplete:
    return AuditIncomplete(
        f"{label}: the audit failed ({result.audit_failed}) after {result.steps} step(s): its record is incomplete, "
        "so it neither shows a leak nor vouches for the optimizer", result)


def train_audited(
    *,
    steps: int,
    noise_multiplier: float = 1.0,
    max_grad_norm: float = 1.0,
    batch_size: int = 64,
    clipping: str = "flat",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    loss_reduction: str = "mean",
    transform: Optional[Callable] = None,
    stop_on_violation: bool = False,
    return_observations: bool = False,
    holdout: int = 0,
    private_options: Optional[dict] = None,
    **auditor_options,
):
    """Train the digits CNN for `steps` noised steps under a PrivacyAuditor; return its result.

    transform(optimizer) may replace or modify the Opacus optimizer before the audit
    attaches (for example to inject a bug or build a user's optimizer class). With
    return_observations, returns (result, observations) instead (the latest
    `observation_window` observations, 65,536 unless given). Input canaries get the
    last HOLDOUT digits, left out of training, as their in-distribution sample. The audit
    checks after every step unless `check_every` is given: a test wants the step at which
    a bug shows itself (and training stops there with stop_on_violation). private_options go to
    Opacus's make_private (e.g. ``{"grad_sample_mode": "functorch"}``). Raises AuditIncomplete
    (a PrivacyAuditFailure, holding the result as `result`) when the audit itself failed.
    """
    canary = auditor_options.get("canary")
    if (isinstance(canary, InputCanaries) or canary in INPUT_KINDS) and "canary_inputs" not in auditor_options:
        holdout = holdout or HOLDOUT
        auditor_options["canary_inputs"], auditor_options["canary_labels"] = digits_holdout(holdout, dtype=dtype)
    model, optimizer, loader, _ = make_private_digits(
        holdout=holdout,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        batch_size=batch_size,
        clipping=clipping,
        seed=seed,
        dtype=dtype,
        loss_reduction=loss_reduction,
        **(private_options or {}),
    )
    if transform is not None:
        optimizer = transform(optimizer)
    violated = []
    auditor_options.setdefault("seed", seed)
    auditor_options.setdefault("check_every", 1)
    auditor_options.setdefault("data_loader", loader)  # the run checks see the loader the loop iterates
    auditor = PrivacyAuditor(optimizer, module=model, on_violation=violated.append, **auditor_options)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Full backward hook.*")
        train_steps(
            model, optimizer, loader, steps,
            loss_fn=torch.nn.CrossEntropyLoss(reduction=loss_reduction),
            stop=(lambda: bool(violated)) if stop_on_violation else None,
        )
    result = auditor.result()
    auditor.detach()
    if result.audit_failed is not None:
        raise _incomplete("train_audited", result)
    return (result, auditor.observations()) if return_observations else result


def _rebuild(optimizer_class: Type, optimizer_kwargs: dict) -> Callable:
    def transform(dp_optimizer):
        new = optimizer_class(
            dp_optimizer.original_optimizer,
            noise_multiplier=dp_optimizer.noise_multiplier,
            max_grad_norm=dp_optimizer.max_grad_norm,
            expected_batch_size=dp_optimizer.expected_batch_size,
            loss_reduction=dp_optimizer.loss_reduction,
            generator=dp_optimizer.generator,
            **optimizer_kwargs,
        )
        new.attach_step_hook(dp_optimizer.step_hook)  # keeps the accountant's hook
        return new

    return transform


def audit_optimizer(
    optimizer_class: Optional[Type] = None,
    *,
    bug: Optional[str] = None,
    steps: int = 1000,
    noise_multiplier: float = 1.0,
    optimizer_kwargs: Optional[dict] = None,
    expect_violation: bool = False,
    **options,
) -> AuditResult:
    """Audit `optimizer_class` (a DPOptimizer subclass) or a bug-zoo `bug` on the digits CNN.

    Raises PrivacyAuditFailure with the numbers when the audit finds a leak (or, with
    expect_violation=True, when it does not), and AuditIncomplete (a PrivacyAuditFailure) when the
    audit itself failed (a leak found before the failure is reported as a leak). Returns the
    AuditResult otherwise.
    """
    if optimizer_class is not None and bug is not None:
        raise ValueError("pass either `optimizer_class` or `bug`, not both")
    if bug is not None:
        transform = lambda opt: inject_bug(opt, bug)  # noqa: E731
        label = f"bug {bug!r}"
    elif optimizer_class is not None:
        transform = _rebuild(optimizer_class, optimizer_kwargs or {})
        label = optimizer_class.__name__
    else:
        transform, label = None, "opacus DPOptimizer"
    try:
        result = train_audited(
            steps=steps, noise_multiplier=noise_multiplier, transform=transform, stop_on_violation=True, **options
        )
    except AuditIncomplete as error:
        if error.result.violation and not expect_violation:  # a leak proven before the failure: the stronger claim
            raise PrivacyAuditFailure(_failure_message(label, error.result, expect_violation)) from None
        raise _incomplete(label, error.result) from None
    if result.violation != expect_violation:
        raise PrivacyAuditFailure(_failure_message(label, result, expect_violation))
    return result


def _failure_message(label: str, r: AuditResult, expected: bool) -> str:
    verdict = "found no leak, but one was expected" if expected else "leaks more than it claims"
    layers = ", ".join(r.violating_layers) or "none"
    return (
        f"{label} {verdict}: per-step mu lower bound {r.mu_lower_bound_anytime:.3f} (anytime, "
        f"{r.confidence:.0%}) vs claimed {r.mu_claimed:.3f}; end-to-end epsilon >= {r.epsilon_lower_bound:.3g} "
        f"vs accountant {r.epsilon_accountant:.3g}; violating: {layers}; steps {r.steps}; "
        f"{violation_moment(r.first_violation_step, r.detected_step) or 'no alarm'}"
        + "".join(f"\n  - {f.code}: {f.message}" for f in r.findings)
        + (f"\n  the audit failed afterwards ({r.audit_failed}): its record is incomplete" if r.audit_failed else "")
    )
