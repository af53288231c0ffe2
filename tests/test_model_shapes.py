"""The exact per-sample check on model shapes people train: an embedding tied to the output layer, and outputs
holding several tensors, one computed from another (as encoder-decoder models return). Opacus's per-sample
gradients are right on both; the check must agree, in every grad_sample_mode, and still catch a wrong one.
Deterministic (fixed seeds); no false-failure rate."""

from __future__ import annotations

import warnings

import pytest
import torch
from opacus import GradSampleModule, PrivacyEngine
from torch import nn

from lightning_dpaudit import PrivacyAuditor

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")


class TiedLanguageModel(nn.Module):
    """Token embedding, a mixing layer, and an output layer sharing the embedding's weight."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.body[0].weight

    def forward(self, tokens):
        return self.head(self.body(tokens)).mean(dim=1)


class EncoderDecoder(nn.Module):
    """Returns a dict whose logits are decoded from the hidden state it also returns."""

    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        hidden = torch.tanh(self.encoder(x))
        return {"logits": self.decoder(hidden), "hidden": hidden}


def _run(model, inputs, loss, mode, steps=3):
    torch.manual_seed(0)
    labels = torch.randint(0, 3, (len(inputs),))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, labels), batch_size=32,
                                         generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        data_loader=loader, noise_multiplier=1.0,
        max_grad_norm=1.0, grad_sample_mode=mode, noise_generator=torch.Generator().manual_seed(1))
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=0, per_sample_check_every=1,
                             per_sample_check_budget=1.0)
    for done, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        loss(model(x), y).backward()
        optimizer.step()
        if done + 1 == steps:
            break
    return auditor


def _tokens():
    return torch.randint(0, 50, (256, 6), generator=torch.Generator().manual_seed(2))


def _features():
    return torch.randn(256, 8, generator=torch.Generator().manual_seed(2))


def _lm_loss(out, y):
    return nn.functional.cross_entropy(out, y)


def _both(out, y):
    return nn.functional.cross_entropy(out["logits"], y) + out["hidden"].pow(2).mean()


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_an_embedding_tied_to_the_output_layer_is_replayed_whole(mode):
    auditor = _run(TiedLanguageModel(), _tokens(), _lm_loss, mode)
    result = auditor.result()
    assert not result.violation, [f.message for f in result.findings]
    assert auditor.per_sample_check.checked == 2  # compared, not skipped


@pytest.mark.parametrize("loss", [lambda out, y: nn.functional.cross_entropy(out["logits"], y), _both])
def test_outputs_computed_from_one_another_count_each_gradient_once(loss):
    auditor = _run(EncoderDecoder(), _features(), loss, "hooks")
    result = auditor.result()
    assert not result.violation, [f.message for f in result.findings]
    assert auditor.per_sample_check.checked == 2


def test_a_wrong_per_sample_gradient_of_a_tied_weight_is_still_named(monkeypatch):
    samplers = dict(GradSampleModule.GRAD_SAMPLERS)
    original = samplers[nn.Linear]

    def halved(layer, activations, backprops):
        grads = original(layer, activations, backprops)
        return {p: g * 0.5 if p is layer.weight else g for p, g in grads.items()}

    samplers[nn.Linear] = halved
    monkeypatch.setattr(GradSampleModule, "GRAD_SAMPLERS", samplers)
    result = _run(TiedLanguageModel(), _tokens(), _lm_loss, "hooks").result()
    assert result.violation and result.findings[0].code == "per_sample_gradients"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen, self.adapter = nn.Linear(8, 8), nn.Linear(8, 8, bias=False)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return torch.tanh(self.frozen(x) + self.adapter(x))


class Adapted(nn.Module):
    """Trainable adapters in every block of a ModuleList (which never runs a forward pass of its own)."""

    def __init__(self):
        super().__init__()
        self.blocks, self.out = nn.ModuleList([Block(), Block()]), nn.Linear(8, 3)
        self.out.requires_grad_(False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def test_adapters_spread_over_a_module_list_are_compared():
    auditor = _run(Adapted(), _features(), _lm_loss, "hooks")
    assert not auditor.result().violation and auditor.per_sample_check.checked == 2


class SharedBlock(nn.Module):
    """One linear block applied twice in the forward pass (weights shared across depth, as in ALBERT)."""

    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.block(h))
        return self.out(torch.tanh(self.block(h)))


@pytest.mark.parametrize("mode", ["hooks", "functorch"])  # ghost clipping refuses a module called twice (Opacus)
def test_a_module_called_twice_is_compared_with_its_two_calls_summed(mode):
    auditor = _run(SharedBlock(), _features(), _lm_loss, mode)
    result = auditor.result(accounting=False)
    # steps 2 and 3 (step 1's forward pass runs before the check's hooks exist)
    assert auditor.per_sample_check.checked == 2 and auditor.per_sample_check.stopped is None
    assert not result.findings, [f.message for f in result.findings]
