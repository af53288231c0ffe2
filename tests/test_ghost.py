"""Ghost clipping on one process: canaries clipped by the module's own ghost-clipping code.

Statistical tests run with fixed seeds; the alarm's false-alarm rate is at most
1 - confidence = 5% per correct run by the monitor's construction, so a quiet correct run
fails with probability <= 5% for a fresh seed and never for these fixed ones.
"""

import pytest
import torch
from ghost_setups import flat_params, make_ghost, token_model, train_ghost
from torch import nn

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.engine.release.ghost import GhostClipping, ModuleRef, grad_sample_module_in
from lightning_dpaudit.integrations.bugs import GHOST_BUGS, inject_bug

pytestmark = pytest.mark.usefixtures("one_thread")


def _dense_norm(rows):
    return rows.reshape(rows.shape[0], -1).norm(dim=1)


def test_canary_norms_and_coefficients_come_from_the_module():
    """Every layer type's canary norm equals the norm of the dense row (ghost norms for Linear and
    Embedding, per-sample norms for LayerNorm), and K = sum min(1, C/norm) row."""
    module, opt, _, _ = make_ghost(max_grad_norm=0.7)
    params = list(opt.params)
    clipping = GhostClipping(params, lambda: module)
    g = torch.Generator().manual_seed(0)
    k = 6
    rows, columns = [], []
    for p in params:  # two coordinates per row, each row in its own coordinates (rows that fit the tensor)
        width = min(2 * k, p.numel() // 2 * 2)
        cols = torch.randperm(p.numel(), generator=g)[:width].sort().values
        block = torch.zeros(k, width)
        for r in range(width // 2):
            block[r, 2 * r : 2 * r + 2] = torch.randn(2, generator=g) * (0.05 + r * 0.3)
        rows.append(block)
        columns.append(cols)
    sums = clipping.sums(rows, columns)
    norms = torch.stack([_dense_norm(r) for r in rows]).norm(dim=0)
    coef = (0.7 / (norms + 1e-6)).clamp(max=1.0)
    for s, r in zip(sums, rows):
        assert torch.allclose(s, (coef[:, None] * r).sum(0), atol=1e-6)
    dense = []
    for r, cols, p in zip(rows, columns, params):
        full = torch.zeros(k, p.numel())
        full[:, cols] = r
        dense.append(full.reshape(k, *p.shape))
    for s, d, cols in zip(sums, clipping.sums(dense, [None] * len(dense)), columns):  # dense rows: the same K
        assert torch.allclose(d.reshape(-1)[cols], s, atol=1e-6)
    assert coef.min() < 0.5 and coef.max() == 1.0  # the test rows exercise both sides of the clamp


def test_each_layer_type_goes_through_its_own_norm_sampler():
    """A norm sampler replaced on the module instance changes the canaries' coefficients (and only there)."""
    module, opt, _, _ = make_ghost()
    params = list(opt.params)
    calls = []
    samplers = dict(type(module).NORM_SAMPLERS)
    for layer_type, sampler in list(samplers.items()):
        samplers[layer_type] = lambda layer, a, b, s=sampler, t=layer_type: calls.append(t) or s(layer, a, b)
    module.NORM_SAMPLERS = samplers
    rows = [torch.ones(1, 1) * 3.0 for _ in params]
    GhostClipping(params, lambda: module).sums(rows, [torch.tensor([0]) for _ in params])
    assert calls.count(nn.Embedding) == 1 and calls.count(nn.Linear) == 4  # two weights, two biases
    assert nn.Embedding not in type(module).NORM_SAMPLERS or type(module).NORM_SAMPLERS[nn.Embedding] is not samplers[nn.Embedding]


@pytest.mark.parametrize("canary", ["dirac", "random"])
def test_the_update_is_the_unaudited_one(canary):
    runs = {}
    for audited in (False, True):
        module, opt, criterion, loader = make_ghost(seed=0)
        auditor = PrivacyAuditor(opt, seed=1, canary=canary) if audited else None
        torch.manual_seed(7)
        train_ghost(module, opt, criterion, loader, 12)
        runs[audited] = flat_params(module)
    assert torch.max(torch.abs(runs[False] - runs[True])).item() <= 1e-6
    result = auditor.result()
    assert result.steps == 12 and result.n_in > 0


def test_a_correct_run_is_quiet_and_tight():
    module, opt, criterion, loader = make_ghost(seed=2)
    auditor = PrivacyAuditor(opt, seed=3)
    train_ghost(module, opt, criterion, loader, 200)
    result = auditor.result()
    assert not result.violation and result.findings == ()
    assert 0.9 * result.mu_claimed <= result.mu_lower_bound <= result.mu_claimed
    assert 0.85 * result.epsilon_accountant <= result.epsilon_lower_bound <= result.epsilon_accountant
    assert result.layers[0].name == "0.weight"  # names from the module found at the first forward pass


def test_the_module_is_found_when_given_and_its_absence_is_explained():
    module, opt, criterion, loader = make_ghost()
    assert grad_sample_module_in(module, opt.params) is module
    holder = nn.ModuleDict({"net": module})  # a LightningModule-like container
    assert grad_sample_module_in(holder, opt.params) is module
    with pytest.raises(RuntimeError, match="pass module="):
        GhostClipping(list(opt.params), ModuleRef()).sums([torch.ones(1, 1)], [torch.tensor([0])])


def test_input_canaries_are_refused_with_what_to_use():
    module, opt, _, _ = make_ghost()
    with pytest.raises(ValueError, match="gradient canaries"):
        PrivacyAuditor(opt, canary="mislabeled", module=module, canary_inputs=torch.zeros(4, 4, dtype=torch.long),
                       canary_labels=torch.zeros(4, dtype=torch.long))


# ------------------------------------------------------------------ the bug zoo under ghost clipping

CASES = [
    ("halved-linear-norms", "canary_clipping", True, None),  # certain, at the exact checks' first step
    ("unclamped-coefficients", "clipping_scales_up", False, None),
    ("wrong-noise", "noise_scale", True, None),
    ("no-noise", "noise_scale", True, None),
    ("reused-noise", "noise_repeats", True, None),
    ("unnoised-layer", "layer", True, {"5.bias"}),
]


@pytest.mark.parametrize("bug, finding, violation, layers", CASES, ids=[c[0] for c in CASES])
def test_ghost_bugs_are_flagged_with_their_finding(bug, finding, violation, layers):
    module, opt, criterion, loader = make_ghost(seed=4)
    inject_bug(opt, bug, module=module)
    auditor = PrivacyAuditor(opt, seed=5, on_violation=lambda result: None)
    train_ghost(module, opt, criterion, loader, 120)
    result = auditor.result()
    assert result.violation is violation
    found = {f.code: f for f in result.findings}
    assert finding in found, [f.code for f in result.findings]
    if layers is not None:
        assert layers <= set(found[finding].layers)
    if bug == "halved-linear-norms":  # linear tensors' canaries are not clipped to C; the others are
        assert found[finding].first_step == 1 and "`2.weight`" in found[finding].message
        assert "`0.weight`" not in found[finding].message and "`3.weight`" not in found[finding].message


def test_ghost_bugs_need_the_module_and_a_ghost_model():
    module, opt, _, _ = make_ghost()
    with pytest.raises(TypeError, match="module="):
        inject_bug(opt, "halved-linear-norms")
    assert set(GHOST_BUGS) == {"halved-linear-norms", "unclamped-coefficients"}
    with pytest.raises(TypeError, match="ghost"):
        inject_bug(opt, "unclamped-coefficients", module=token_model())


def test_halved_norms_are_a_real_leak_of_the_training_run():
    """The bug itself, without the audit: clipped by the halved norms, samples keep more than C of their true norm."""
    clipped = {}
    for bug in (None, "halved-linear-norms"):
        module, opt, criterion, loader = make_ghost(max_grad_norm=1e-3)
        if bug:
            inject_bug(opt, bug, module=module)
        x, y = next(iter(loader))
        criterion(module(x), y).backward()
        clipped[bug] = module.get_clipping_coef()
        if bug is None:
            true_norms = module.get_norm_sample()
    assert torch.allclose(clipped[None] * true_norms, torch.full_like(true_norms, 1e-3), rtol=1e-3)  # clipped to C
    assert torch.all(clipped["halved-linear-norms"] * true_norms > 1.5e-3)  # well above C under the bug
