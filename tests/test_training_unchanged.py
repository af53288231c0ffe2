"""The audit never changes the training it watches: in every mode and canary kind the trained model
equals plain Opacus's (same seeds), dropout and all.

The canaries are added to the released sum and taken out again (R - K), which leaves float
rounding: parameters agree to 1e-6, not bit for bit. Deterministic; no false-failure rate."""

from __future__ import annotations

import warnings

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

from lightning_dpaudit import PrivacyAuditor

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")


LOADER = object()  # stands for the loop's own loader in an audit's options


def _setup(grad_sample_mode: str, noise_generator: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(128, 10, generator=g), torch.randint(0, 3, (128,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    kwargs = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
                  noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode=grad_sample_mode,
                  noise_generator=torch.Generator().manual_seed(1) if noise_generator else None)
    if grad_sample_mode == "ghost":
        module, optimizer, criterion, loader = PrivacyEngine().make_private(criterion=nn.CrossEntropyLoss(), **kwargs)
    else:
        (module, optimizer, loader), criterion = PrivacyEngine().make_private(**kwargs), nn.CrossEntropyLoss()
    return module, optimizer, criterion, loader


def _trained(grad_sample_mode: str, noise_generator: bool, audit=None) -> list:
    module, optimizer, criterion, loader = _setup(grad_sample_mode, noise_generator)
    options = {} if audit is None else audit(module)
    if options.get("data_loader") is LOADER:  # the run checks watching the loop's loader, replaying its loss
        options.update(data_loader=loader, training_loss=lambda batch: criterion(module(batch[0]), batch[1]))
    auditor = None if audit is None else PrivacyAuditor(optimizer, seed=3, **options)
    torch.manual_seed(11)  # dropout, and the noise when the optimizer has no generator of its own
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            criterion(module(x), y).backward()
            optimizer.step()
    if auditor is not None:  # the audit ran to the end: nothing here is the model of a detached audit
        result = auditor.result(accounting=False)
        assert result.audit_failed is None and result.steps == 8 and result.n_in > 0
    return [p.detach().clone() for p in module.parameters()]


def _inputs(kind):
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(64, 10, generator=g), torch.randint(0, 3, (64,), generator=g)
    return lambda module: dict(canary=kind, module=module, canary_inputs=x, canary_labels=y, canaries_per_step=8)


AUDITS = {
    "dirac one-run": lambda module: dict(canaries_per_step=64, per_sample_check_every=1, per_sample_check_budget=1.0),
    "dirac paired": lambda module: dict(canaries_per_step=64, mode="paired", per_sample_check_every=1, per_sample_check_budget=1.0),
    "constant": lambda module: dict(canary="constant", canaries_per_step=16),
    "run checks replaying the step": lambda module: dict(module=module, data_loader=LOADER, canaries_per_step=64,
                                                         per_sample_check_every=1, per_sample_check_budget=1.0),
    "mislabeled": _inputs("mislabeled"),
    "blank": _inputs("blank"),
    "adversarial": _inputs("adversarial"),
    "crafted": _inputs("crafted"),
}


@pytest.mark.parametrize("noise_generator", [True, False], ids=["own noise generator", "global generator"])
@pytest.mark.parametrize("audit", list(AUDITS))
def test_the_model_equals_plain_opacus_with_hooks(audit, noise_generator):
    plain = _trained("hooks", noise_generator)
    audited = _trained("hooks", noise_generator, AUDITS[audit])
    for p, q in zip(plain, audited):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


@pytest.mark.parametrize("audit", ["dirac one-run", "dirac paired"])
@pytest.mark.parametrize("grad_sample_mode", ["ghost", "functorch"])
def test_the_model_equals_plain_opacus_under_ghost_and_functorch(grad_sample_mode, audit):
    plain = _trained(grad_sample_mode, True)
    audited = _trained(grad_sample_mode, True, AUDITS[audit])
    for p, q in zip(plain, audited):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


def test_a_canary_scale_that_cannot_stay_finite_is_refused():
    _, optimizer, _, _ = _setup("hooks", True)
    with pytest.raises(ValueError, match=r"Unexpected value for `canary_scale`: 1e\+39; use a finite number in \(0.0, 10000.0\]"):
        PrivacyAuditor(optimizer, canary_scale=1e39)



def _beside_another(grad_sample_mode: str, audited: bool):
    """Two private models trained step for step in one process, the first audited or not: their tensors after
    each step."""
    first, other = _setup(grad_sample_mode, True), _setup(grad_sample_mode, True)
    if audited:
        PrivacyAuditor(first[1], seed=3, data_loader=first[3])  # its model found from the forward passes it sees
    torch.manual_seed(11)  # the dropout of both
    seen, batches = [], [iter(other[3]), iter(first[3])]
    for _ in range(4):
        for (module, optimizer, criterion, _), batch in zip((other, first), batches):  # the other one first
            x, y = next(batch)
            optimizer.zero_grad()
            criterion(module(x), y).backward()
            optimizer.step()
        seen.append([[p.detach().clone() for p in m[0].parameters()] for m in (first, other)])
    return seen


@pytest.mark.parametrize("grad_sample_mode", ["hooks", "functorch"])
def test_another_model_trained_in_the_same_process_is_left_alone(grad_sample_mode):
    """A second private model, not audited, trained step for step beside an audited one from before the audited
    one's first forward pass, equals the same model beside the same run with no audit; the audited one equals
    its unaudited self (to the canaries' rounding)."""
    plain, audited = _beside_another(grad_sample_mode, False), _beside_another(grad_sample_mode, True)
    assert len(plain) == len(audited) == 4
    for (first, other), (first_audited, other_audited) in zip(plain, audited):
        for p, q in zip(other, other_audited):
            torch.testing.assert_close(q, p, rtol=0, atol=0)
        for p, q in zip(first, first_audited):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-6)
