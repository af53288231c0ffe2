"""Opacus's make_private(wrap_model=False): GradSampleHooks on the user's own model, no GradSampleModule.

The hooks' owner is an AbstractGradSampleHooks that is not a torch module (its model is its `_module`). The audit
finds it as it finds a GradSampleModule, through the hooks on the modules owning the parameters: ghost clipping's
canaries go through its norms and coefficients, the exact check replays the model, the tensors carry the model's
names.
"""

import pytest
import torch
from ghost_setups import token_data, token_model, train_ghost
from opacus import PrivacyEngine
from torch import nn

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.integrations.bugs import inject_bug

pytestmark = pytest.mark.usefixtures("one_thread")


def _private(grad_sample_mode: str, seed: int = 0):
    """(model, the GradSampleHooks, optimizer, criterion or None, loader) under wrap_model=False."""
    model = token_model(seed)
    loader = torch.utils.data.DataLoader(token_data(), batch_size=64,
                                         generator=torch.Generator().manual_seed(seed + 2))
    ghost = grad_sample_mode == "ghost"
    made = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=grad_sample_mode, wrap_model=False,
        noise_generator=torch.Generator().manual_seed(seed + 1), **({"criterion": nn.CrossEntropyLoss()} if ghost else {}),
    )
    hooks, optimizer, *rest = made
    assert not isinstance(hooks, nn.Module)  # what this file is about
    return model, hooks, optimizer, (rest[0] if ghost else None), rest[-1]


def _train(model, optimizer, criterion, loader, steps: int) -> None:
    if criterion is not None:
        return train_ghost(model, optimizer, criterion, loader, steps)
    done = 0
    while done < steps:
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done >= steps:
                return


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
@pytest.mark.parametrize("given", [True, False], ids=["module-given", "found-at-forward"])
def test_the_audit_runs_and_compares_under_gradsamplehooks(mode, given):
    model, _, optimizer, criterion, loader = _private(mode)
    auditor = PrivacyAuditor(optimizer, seed=0, module=model if given else None, per_sample_check_every=1,
                             per_sample_check_budget=1.0, on_violation=lambda result: None)
    _train(model, optimizer, criterion, loader, 6)
    result = auditor.result()
    assert result.audit_failed is None and result.checks_stopped == ()
    assert result.steps == 6 and not result.violation, [f.code for f in result.findings]
    assert result.data_path.startswith("5 step(s) compared"), result.data_path  # step 1's forward ran before
    assert [layer.name for layer in result.layers][:2] == ["0.weight", "2.weight"]


def test_a_ghost_bug_is_caught_under_gradsamplehooks():
    model, hooks, optimizer, criterion, loader = _private("ghost", seed=4)
    inject_bug(optimizer, "halved-linear-norms", module=hooks)
    auditor = PrivacyAuditor(optimizer, seed=5, module=model, on_violation=lambda result: None)
    _train(model, optimizer, criterion, loader, 20)
    result = auditor.result()
    assert result.audit_failed is None and result.violation
    found = {f.code: f for f in result.findings}
    assert "canary_clipping" in found and "`2.weight`" in found["canary_clipping"].message
