"""Opacus's historical privacy bugs, reinstated on Opacus 1.6.0: each patch changes Opacus's
behaviour the way the old release did, and leaving it restores Opacus exactly."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from opacus import PrivacyEngine
from opacus.accountants import GaussianAccountant
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.optimizers import DPOptimizerFastGradientClipping
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from opacus.validators import ModuleValidator
from torch.utils.data import DataLoader, TensorDataset

from lightning_dpaudit.integrations.opacus_history import (
    HISTORICAL_BUGS,
    HistoricalBug,
    historical_bug,
)

_MISSING = object()


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _snapshot(bug: HistoricalBug):
    return [
        owner.get(key, _MISSING) if isinstance(owner, dict) else vars(owner).get(key, _MISSING)
        for owner, key in bug.targets()
    ]


def _total_norm(params) -> float:
    return torch.sqrt(sum(p.grad.pow(2).sum() for p in params)).item()


# --- the registry -------------------------------------------------------------------------


def test_unknown_name_raises_with_the_list():
    with pytest.raises(ValueError) as info:
        historical_bug("opacus-0")
    for name in HISTORICAL_BUGS:
        assert name in str(info.value)
    assert historical_bug("opacus-751") is HISTORICAL_BUGS["opacus-751"]


@pytest.mark.parametrize("name", list(HISTORICAL_BUGS))
def test_leaving_the_patch_restores_opacus_exactly(name):
    bug = historical_bug(name)
    before = _snapshot(bug)
    with bug.patch():
        inside = _snapshot(bug)
    assert all(a is b for a, b in zip(_snapshot(bug), before))
    assert all(a is not b for a, b in zip(inside, before))  # every target really replaced
    with pytest.raises(RuntimeError):  # restored on an exception too
        with bug.patch():
            raise RuntimeError
    assert all(a is b for a, b in zip(_snapshot(bug), before))
    assert (len(before) == 0) == (name == "opacus-571")  # the only entry with nothing to reinstate


def test_entries_are_frozen_and_documented():
    for name, bug in HISTORICAL_BUGS.items():
        assert bug.name == name and bug.what and bug.modes and bug.shipped_in and bug.fix
        with pytest.raises(Exception):
            bug.name = "other"


# --- opacus-664 ---------------------------------------------------------------------------


def _ghost_private(c: float, noise: float = 0.0):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    data = DataLoader(TensorDataset(torch.randn(4, 4), torch.randn(4, 1)), batch_size=4)
    return PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=data,
        noise_multiplier=noise,
        max_grad_norm=c,
        grad_sample_mode="ghost",
        criterion=nn.MSELoss(),
        poisson_sampling=False,
    )


def _one_example_update_norm(module, criterion) -> float:
    x, y = torch.full((1, 4), 30.0), torch.zeros(1, 1)  # a gradient far above norm 1
    criterion(module(x), y).backward()
    return _total_norm(module.parameters())


def test_664_ghost_module_clips_at_one_not_at_the_given_c():
    module, optimizer, criterion, _ = _ghost_private(0.1)
    assert module.max_grad_norm == 0.1 and optimizer.max_grad_norm == 0.1
    assert _one_example_update_norm(module, criterion) == pytest.approx(0.1, rel=1e-3)

    with historical_bug("opacus-664").patch():
        module, optimizer, criterion, _ = _ghost_private(0.1)
    assert module.max_grad_norm == 1  # GradSampleModuleFastGradientClipping's default
    assert optimizer.max_grad_norm == 0.1  # the noise is still calibrated to C
    assert _one_example_update_norm(module, criterion) == pytest.approx(1.0, rel=1e-3)


# --- opacus-751 ---------------------------------------------------------------------------


def test_751_bias_norm_of_a_sequence_input():
    torch.manual_seed(1)
    layer = nn.Linear(3, 2)
    plain = copy.deepcopy(layer)
    x = torch.randn(4, 5, 3)  # batch of 4 sequences of 5 tokens: 3-D activations
    true = []
    for i in range(len(x)):  # plain autograd, one example at a time
        plain.zero_grad()
        plain(x[i : i + 1]).pow(2).sum().backward()
        true.append(plain.bias.grad.norm())
    true = torch.stack(true)

    gsm = GradSampleModuleFastGradientClipping(layer, max_grad_norm=1.0, loss_reduction="sum")

    def module_bias_norms():
        gsm(x).pow(2).sum(dim=(1, 2)).sum().backward()
        return layer.bias._norm_sample.detach().clone()

    assert torch.allclose(module_bias_norms(), true, rtol=1e-4)
    with historical_bug("opacus-751").patch():
        buggy = module_bias_norms()
    assert not torch.allclose(buggy, true, rtol=1e-2)
    assert (buggy - true).abs().max() > 0.1 * true.max()
    assert torch.allclose(module_bias_norms(), true, rtol=1e-4)  # restored


# --- opacus-accumulation-1.5.3 ------------------------------------------------------------


def _two_physical_batches():
    """One logical batch of 4 records in two physical batches of 2 (BatchMemoryManager)."""
    module, optimizer, criterion, data = _ghost_private(1.0)
    physical = []
    with BatchMemoryManager(data_loader=data, max_physical_batch_size=2, optimizer=optimizer) as loader:
        for x, y in loader:
            optimizer.zero_grad()
            criterion(module(x), y).backward()
            physical.append([p.grad.detach().clone() for p in module.parameters()])
            optimizer.step()
    final = [p.grad.detach().clone() for p in module.parameters()]
    return physical, final, optimizer.expected_batch_size


def test_accumulation_last_physical_batch_counted_twice_others_dropped():
    (first, second), final, n = _two_physical_batches()
    for f, a, b in zip(final, first, second):
        assert torch.allclose(f, (a + b) / n, atol=1e-6)

    with historical_bug("opacus-accumulation-1.5.3").patch():
        (first, second), buggy, n = _two_physical_batches()
    for f, a, b, ok in zip(buggy, first, second, final):
        assert torch.allclose(f, 2 * b / n, atol=1e-6)  # the first batch dropped, the last doubled
    assert not all(torch.allclose(f, ok, atol=1e-4) for f, ok in zip(buggy, final))


# --- opacus-571 ---------------------------------------------------------------------------


def _update_from_one_record(num_records: int):
    torch.manual_seed(2)
    model = nn.Linear(3, 1)
    x, y = torch.randn(4, 3)[:num_records], torch.randn(4, 1)[:num_records]  # neighbours: one record less
    data = DataLoader(TensorDataset(x, y), batch_size=2)
    module, optimizer, _ = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=data,
        noise_multiplier=0.0,
        max_grad_norm=100.0,
        poisson_sampling=False,
    )
    nn.functional.mse_loss(module(x[:1]), y[:1]).backward()  # the same record's step
    optimizer.step()
    return optimizer.expected_batch_size, 1 / len(data), [p.grad.clone() for p in module.parameters()]


def test_571_normaliser_depends_on_the_private_dataset_size():
    bug = historical_bug("opacus-571")
    assert bug.fixed_in is None and bug.targets() == []
    with bug.patch():  # documents 1.6.0: nothing to reinstate
        n4, q4, update4 = _update_from_one_record(4)
    n3, q3, update3 = _update_from_one_record(3)
    assert q4 == q3 == 0.5  # the same sampling rate for both neighbours ...
    assert (n4, n3) == (2, 1)  # ... but int(len(dataset) * q) as the normaliser
    for a, b in zip(update4, update3):
        assert torch.allclose(2 * a, b)  # the same record moves the model twice as far


# --- opacus-807 ---------------------------------------------------------------------------


def _adaclip_step(accountant="rdp"):
    torch.manual_seed(3)
    model = nn.Linear(3, 1)
    data = DataLoader(TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), batch_size=8)
    engine = PrivacyEngine(accountant=accountant)
    module, optimizer, data = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=data,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="adaptive",
        target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2,
        max_clipbound=10.0,
        min_clipbound=0.01,
        unclipped_num_std=1.0,
        poisson_sampling=False,
    )
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.mse_loss(module(x), y).backward()
        optimizer.step()
    return engine, optimizer


def test_807_accountant_composes_the_adjusted_noise_multiplier():
    sigma_eff = (1.0 - 0.25) ** -0.5  # (sigma^-2 - (2 sigma_u)^-2)^(-1/2), sigma = sigma_u = 1
    engine, optimizer = _adaclip_step()
    assert engine.accountant.history[0][0] == 1.0
    epsilon = engine.get_epsilon(1e-5)

    with historical_bug("opacus-807").patch():
        buggy_engine, buggy_optimizer = _adaclip_step()
    assert buggy_optimizer.noise_multiplier == pytest.approx(sigma_eff)
    assert buggy_engine.accountant.history[0][0] == pytest.approx(sigma_eff)
    assert buggy_engine.get_epsilon(1e-5) < 0.95 * epsilon  # reported too low


def test_807_adaptive_ghost_clipping_accountant():
    from opacus.utils.adaptive_clipping.adaptive_clipping_utils import PrivacyEngineAdaptiveClipping

    def one_step():
        torch.manual_seed(4)
        model = nn.Linear(3, 1)
        data = DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=16)
        engine = PrivacyEngineAdaptiveClipping(accountant="rdp")
        module, optimizer, criterion, data = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=data,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            grad_sample_mode="ghost",
            criterion=nn.MSELoss(),
            poisson_sampling=False,
        )
        for x, y in data:
            optimizer.zero_grad()
            criterion(module(x), y).backward()
            optimizer.step()
        return engine.accountant.history[0][0]

    sigma_eff = (1.0 - (2 * 16 / 20.0) ** -2) ** -0.5  # unclipped_num_std = batch / 20
    assert one_step() == 1.0
    with historical_bug("opacus-807").patch():
        assert one_step() == pytest.approx(sigma_eff)


# --- opacus-820 ---------------------------------------------------------------------------


class _Adapted(nn.Module):
    """A frozen base layer with a LoRA-style adapter beside it, PEFT's naming."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 2)
        self.base.requires_grad_(False)
        self.lora_A = nn.Linear(4, 2, bias=False)
        self.lora_B = nn.Linear(2, 2, bias=False)
        self.head = nn.Linear(2, 1)

    def forward(self, x):
        return self.head(self.base(x) + self.lora_B(self.lora_A(x)))


def _adapter_step(c: float):
    torch.manual_seed(5)
    model = _Adapted()
    gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=c, loss_reduction="sum")
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=0.0,
        max_grad_norm=c,
        expected_batch_size=1,
        loss_reduction="sum",
    )
    criterion = DPLossFastGradientClipping(gsm, optimizer, nn.MSELoss(reduction="sum"), loss_reduction="sum")
    criterion(gsm(torch.full((1, 4), 10.0)), torch.zeros(1, 1)).backward()
    adapter = [model.lora_A.weight, model.lora_B.weight]
    trainable = [p for p in model.parameters() if p.requires_grad]
    return adapter, trainable


def test_820_adapter_gradient_without_per_sample_norm():
    adapter, trainable = _adapter_step(0.5)
    assert all(hasattr(p, "_norm_sample") for p in adapter)
    assert _total_norm(trainable) == pytest.approx(0.5, rel=1e-3)  # one example, clipped to C

    with historical_bug("opacus-820").patch():
        adapter, trainable = _adapter_step(0.5)
    assert all(p.requires_grad and p.grad is not None and p.grad.norm() > 0 for p in adapter)
    assert not any(hasattr(p, "_norm_sample") for p in adapter)  # never seen by the hooks
    assert _total_norm(trainable) > 1.5 * 0.5  # the adapter's share escapes the bound


# --- opacus-598 ---------------------------------------------------------------------------


def test_598_fix_drops_batch_first_and_mixes_examples():
    torch.manual_seed(6)
    attention = nn.MultiheadAttention(embed_dim=4, num_heads=1, batch_first=True)
    x = torch.randn(3, 2, 4)  # (batch, sequence, embedding)
    other = x.clone()
    other[1] += 1.0  # change example 1 only
    expected = attention(x, x, x)[0]

    def outputs(dp):
        return dp(x, x, x)[0], dp(other, other, other)[0]

    fixed = ModuleValidator.fix(attention)
    out, out_other = outputs(fixed)
    assert fixed.batch_first
    assert torch.allclose(out, expected, atol=1e-5)
    assert torch.allclose(out[0], out_other[0], atol=1e-6)  # example 0 does not see example 1

    with historical_bug("opacus-598").patch():
        buggy = ModuleValidator.fix(attention)
    out, out_other = outputs(buggy)
    assert not buggy.batch_first
    assert not torch.allclose(out, expected, atol=1e-3)
    assert not torch.allclose(out[0], out_other[0], atol=1e-3)  # example 1 leaks into example 0's output


# --- opacus-541 ---------------------------------------------------------------------------


def _epsilons_queried_twice():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accountant = GaussianAccountant()
    for _ in range(100):
        accountant.step(noise_multiplier=1.0, sample_rate=0.01)
    first = accountant.get_epsilon(delta=1e-5)
    for _ in range(100):
        accountant.step(noise_multiplier=1.0, sample_rate=0.01)
    return first, accountant.get_epsilon(delta=1e-5), accountant.history


def test_541_gdp_epsilon_query_forgets_the_steps():
    first, second, history = _epsilons_queried_twice()
    assert second > first and history == [(1.0, 0.01, 200)]
    with historical_bug("opacus-541").patch():
        buggy_first, buggy_second, buggy_history = _epsilons_queried_twice()
    assert buggy_first == pytest.approx(first)
    assert buggy_second == pytest.approx(first)  # 200 steps taken, 100 reported
    assert buggy_history == []
