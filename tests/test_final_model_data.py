"""Final-model canaries: the secret inclusion, the wrapped training data, saved state, scores, kinds."""

import json
import math
import pickle
import random
import weakref

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from opacus import PrivacyEngine
from opacus.data_loader import DPDataLoader
from scipy.stats import binom
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_dpaudit.analysis import final_model as final_model_analysis
from lightning_dpaudit.engine.final_model import CanaryDataset, FinalModelCanaries
from lightning_dpaudit.integrations.digits import DigitsCNN, digits_dataset, digits_holdout
from lightning_dpaudit.integrations.final_model_data import CanaryDataModule


def base_data(n=100, features=3, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(n, features, generator=g), torch.randint(classes, (n,), generator=g))


def ood(count=60, seed=None, **kw):
    return FinalModelCanaries(count, "ood", seed=seed, **kw)


def reachable(root, follow_weakrefs=True):
    """Every object reachable from root through attributes, containers, closures, bound methods (and weakrefs)."""
    seen, stack, found = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        found.append(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, weakref.ref):
            if follow_weakrefs and obj() is not None:
                stack.append(obj())
        elif not isinstance(obj, (torch.Tensor, np.ndarray, str, bytes, int, float, type)):
            stack.extend(getattr(obj, name) for name in ("__self__", "__func__", "__wrapped__") if hasattr(obj, name))
            stack.extend(cell.cell_contents for cell in getattr(obj, "__closure__", None) or ())
            if hasattr(obj, "__dict__"):
                stack.append(vars(obj))
    return found


def is_mask(obj, mask):
    """An integer or bool array equal to the mask (as 0/1) or to the included indices."""
    array = (obj.numpy() if torch.is_tensor(obj) else obj).reshape(-1)
    if array.dtype.kind not in "biu":
        return False
    return (len(array) == len(mask) and np.array_equal(array != 0, mask)) or np.array_equal(array, np.flatnonzero(mask))


def assert_holds_no_secret(objects, seed, mask):
    for obj in objects:
        assert not isinstance(obj, FinalModelCanaries)
        assert not (isinstance(obj, int) and not isinstance(obj, bool) and obj == seed)
        assert not ((torch.is_tensor(obj) or isinstance(obj, np.ndarray)) and is_mask(obj, mask))


# The secret inclusion


def test_inclusion_is_seeded():
    first, again, other = ood(200, seed=7), ood(200, seed=7), ood(200, seed=8)
    assert first.included.dtype == bool and first.included.shape == (200,)
    assert np.array_equal(first.included, again.included)
    assert not np.array_equal(first.included, other.included)  # equal with probability 2**-200


def test_seed_none_is_secret_from_global_random_state():
    masks = []
    for _ in range(2):
        torch.manual_seed(0), np.random.seed(0), random.seed(0)
        masks.append(ood(200).included)
    assert not np.array_equal(*masks)  # equal with probability 2**-200


def test_about_half_included():
    # For any seed, num_included ~ Binomial(1000, 1/2) falls outside [lo, hi] with probability <= 2e-5; with the
    # total's check below, the test would fail for a correct sampler with probability <= 4.2e-4 at random seeds
    # (the seeds here are fixed, so it passes or fails the same way every run).
    lo, hi = binom.ppf(1e-5, 1000, 0.5), binom.isf(1e-5, 1000, 0.5)
    counts = [ood(1000, seed=s).num_included for s in range(20)]
    assert all(lo <= c <= hi for c in counts), counts
    # The 20,000 draws together: outside this interval with probability <= 2e-5.
    assert binom.ppf(1e-5, 20000, 0.5) <= sum(counts) <= binom.isf(1e-5, 20000, 0.5)


def test_dataset_holds_neither_seed_nor_mask():
    audit = ood(60, seed=123456789)
    dataset = audit.wrap(base_data())
    before = reachable(dataset, follow_weakrefs=False)  # before first use only a weak reference leads to the audit
    assert [type(v) for v in vars(dataset).values()].count(weakref.ref) == 1
    len(dataset)
    mask = audit.included
    assert 0 < mask.sum() < 60
    assert_holds_no_secret(before, 123456789, mask)
    assert_holds_no_secret(reachable(dataset), 123456789, mask)
    assert_holds_no_secret(reachable(pickle.loads(pickle.dumps(dataset))), 123456789, mask)


def test_pickling_an_unused_dataset_resolves_it_first():
    audit = ood(60, seed=3)
    copy = pickle.loads(pickle.dumps(audit.wrap(base_data())))
    assert len(copy) == 100 + audit.num_included
    assert_holds_no_secret(reachable(copy), 3, audit.included)


def test_dataset_needs_its_audit_alive():
    dataset = ood(60, seed=3).wrap(base_data())
    with pytest.raises(RuntimeError, match="keep a reference"):
        len(dataset)


# The wrapped training data


@pytest.mark.parametrize("int_labels", [False, True])
def test_wrapped_dataset_is_base_then_included_canaries(int_labels):
    base = base_data()

    class IntLabels(Dataset):
        def __len__(self):
            return len(base)

        def __getitem__(self, i):
            return base[i][0], int(base[i][1])

    data = IntLabels() if int_labels else base
    audit = ood(60, seed=5)
    wrapped = audit.wrap(data)
    k = audit.num_included
    assert 0 < k < 60 and len(wrapped) == 100 + k
    for i in range(100):
        assert torch.equal(wrapped[i][0], base[i][0]) and int(wrapped[i][1]) == int(base[i][1])
    inputs, labels = audit.examples
    chosen = np.flatnonzero(audit.included)
    for j, c in enumerate(chosen):
        x, y = wrapped[100 + j]
        assert torch.equal(x, inputs[c]) and x.dtype == torch.float32
        assert (type(y) is int) if int_labels else (y.dtype == torch.int64 and y.dim() == 0)
        assert int(y) == int(labels[c])
    assert torch.equal(wrapped[-1][0], inputs[chosen[-1]])
    with pytest.raises(IndexError):
        wrapped[100 + k]
    batch = next(iter(DataLoader(wrapped, batch_size=len(wrapped))))
    assert batch[0].shape == (100 + k, 3) and batch[1].dtype == torch.int64


def test_other_item_structures_are_refused():
    with pytest.raises(ValueError, match=r"\(input tensor, integer class label\) pairs; item 0 is a tuple \(Tensor\)"):
        ood().wrap(TensorDataset(torch.rand(10, 3)))
    with pytest.raises(ValueError, match="item 0 is a tuple"):
        ood().wrap(TensorDataset(torch.rand(10, 3), torch.rand(10)))  # float targets
    with pytest.raises(ValueError, match="already a CanaryDataset"):
        audit = ood()
        audit.wrap(audit.wrap(base_data()))


def test_opacus_samples_from_the_data_trained_on():
    base, audit = base_data(), ood(60, seed=5)
    wrapped = audit.wrap(base)
    k = audit.num_included
    dp_loader = DPDataLoader.from_data_loader(DataLoader(wrapped, batch_size=10))
    # Opacus's rate is 1 / len(loader) = 1 / ceil(N / B) (B / N when B divides N); without the canaries it is 1/10.
    assert dp_loader.sample_rate == 1 / math.ceil((100 + k) / 10) != 1 / 10
    assert dp_loader.batch_sampler.num_samples == 100 + k
    model = nn.Linear(3, 4)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(wrapped, batch_size=10, shuffle=True), noise_multiplier=1.0, max_grad_norm=1.0,
    )
    assert loader.sample_rate == dp_loader.sample_rate
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    assert engine.accountant.history[0][1] == dp_loader.sample_rate


# Saved state


def test_state_round_trip_restores_the_mask():
    first = ood(60)
    len(first.wrap(base_data()))
    state = first.state_dict()
    assert set(state) == {"version", "seed", "count", "kind", "examples_fingerprint", "start_losses"}
    state = json.loads(json.dumps(state))
    for loaded_before_wrap in (True, False):
        fresh = ood(60)
        if loaded_before_wrap:  # 'ood' examples are made at wrap: the fingerprint is checked then
            fresh.load_state_dict(state)
            dataset = fresh.wrap(base_data())
        else:
            dataset = fresh.wrap(base_data())
            fresh.load_state_dict(state)  # lazy: the inclusion is fixed at first use
        assert len(dataset) == 100 + first.num_included
        assert np.array_equal(fresh.included, first.included)
        assert fresh.state_dict() == state


def test_state_survives_torch_save(tmp_path):
    audit = FinalModelCanaries(6, inputs=torch.rand(6, 3), labels=torch.arange(6) % 4, seed=11)
    audit.record_start(nn.Linear(3, 4))
    torch.save({"audit": audit.state_dict()}, tmp_path / "ckpt.pt")
    fresh = FinalModelCanaries(6, inputs=audit.examples[0], labels=audit.examples[1])
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True)["audit"])
    assert np.array_equal(fresh.included, audit.included) and np.array_equal(fresh.start_losses, audit.start_losses)


def test_mismatched_state_is_refused_and_changes_nothing():
    held_out = digits_holdout(100)
    saved = FinalModelCanaries(50, "mislabeled", held_out=held_out, seed=1).state_dict()
    with pytest.raises(ValueError, match="saved audit has 50 'mislabeled' canaries, this one 40 'mislabeled'"):
        FinalModelCanaries(40, "mislabeled", held_out=held_out).load_state_dict(saved)
    with pytest.raises(ValueError, match="saved audit has 50 'mislabeled' canaries, this one 50 'blank'"):
        FinalModelCanaries(50, "blank", held_out=held_out).load_state_dict(saved)
    other = FinalModelCanaries(50, "mislabeled", held_out=held_out, seed=2, example_seed=1)
    with pytest.raises(ValueError, match="'mislabeled' canary examples .* differ from this one's"):
        other.load_state_dict(saved)
    assert other.state_dict()["seed"] == 2
    with pytest.raises(ValueError, match="version"):
        other.load_state_dict({**saved, "version": 2})
    # 'ood' examples come from the training data: checked at wrap
    audit = ood(60)
    audit.wrap(base_data())
    state = audit.state_dict()
    later = ood(60, example_seed=1)
    later.load_state_dict(state)
    with pytest.raises(ValueError, match="differ from this one's"):
        later.wrap(base_data())


def test_a_different_seed_after_first_use_is_refused():
    audit = ood(60, seed=1)
    dataset = audit.wrap(base_data())
    other = ood(60, seed=2)
    other.wrap(base_data())
    state = other.state_dict()
    audit.load_state_dict(audit.state_dict())  # the same seed: fine
    len(dataset)
    with pytest.raises(ValueError, match="already holds this audit's canaries"):
        audit.load_state_dict(state)
    assert audit.state_dict()["seed"] == 1
    reading = ood(60, seed=1)
    reading.included  # reading the mask fixes it too
    with pytest.raises(ValueError, match="already holds"):
        reading.load_state_dict({**state, "examples_fingerprint": None})


# Scores


def linear_model():
    model = nn.Linear(3, 4).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 0, 0], [0, 2, 0], [0, 0, -1], [1, 1, 1]]))
        model.bias.copy_(torch.tensor([0.5, 0, 0.25, -1]))
    return model


def by_hand(model, x, y):
    z = x.double() @ model.weight.detach().T + model.bias.detach()
    loss = torch.logsumexp(z, 1) - z[torch.arange(len(y)), y]
    others = z.clone()
    others[torch.arange(len(y)), y] = -math.inf
    return loss.numpy(), (z[torch.arange(len(y)), y] - others.max(1).values).numpy()


def test_scores_equal_hand_computed_values():
    x, y = torch.rand(7, 3, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 3, 0, 1, 2])
    audit = FinalModelCanaries(inputs=x, labels=y, batch_size=3)
    assert audit.kind == "custom" and audit.count == 7
    model = linear_model()
    scores = audit.score(model)
    loss, margin = by_hand(model, x, y)
    assert set(scores) == {"loss", "logit_margin"}
    np.testing.assert_allclose(scores["loss"], -loss, rtol=1e-12)
    np.testing.assert_allclose(scores["logit_margin"], margin, rtol=1e-12)
    audit.record_start(model)
    with pytest.raises(ValueError, match="already recorded"):
        audit.record_start(model)
    with torch.no_grad():
        model.weight.mul_(-0.5)
    later, _ = by_hand(model, x, y)
    assert audit.start_losses.dtype == np.float64
    np.testing.assert_allclose(audit.score(model)["loss_change"], loss - later, rtol=1e-12)
    hinge = FinalModelCanaries(inputs=x, labels=y, loss_fn=lambda z, t: (1 - z[torch.arange(len(t)), t]).clamp_min(0))
    own = (x.double() @ model.weight.detach().T + model.bias.detach())[torch.arange(7), y].numpy()
    np.testing.assert_allclose(hinge.score(model)["loss"], -np.maximum(1 - own, 0))
    with pytest.raises(ValueError, match="one loss per example"):
        FinalModelCanaries(inputs=x, labels=y, loss_fn=nn.CrossEntropyLoss()).score(model)


def test_scoring_restores_each_module_mode_and_needs_no_grad():
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 4))
    model.train()
    model[1].eval()
    x = torch.rand(20, 3)
    audit = FinalModelCanaries(inputs=x, labels=torch.arange(20) % 4)
    first = audit.score(model)
    assert model.training and model[0].training and not model[1].training
    np.testing.assert_array_equal(first["loss"], audit.score(model)["loss"])  # eval mode: dropout off
    assert all(p.grad is None for p in model.parameters())


def test_scoring_a_private_model_leaves_no_per_sample_gradients():
    torch.manual_seed(0)
    base = base_data()
    audit = ood(40, seed=2)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 4))
    plain = model
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(audit.wrap(base), batch_size=20), noise_multiplier=1.0, max_grad_norm=1.0,
    )
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scores = audit.score(model)
    assert all(getattr(p, "grad_sample", None) is None and p.grad is None for p in model.parameters())
    assert model.training
    np.testing.assert_allclose(scores["loss"], audit.score(plain)["loss"], rtol=1e-6)
    nn.functional.cross_entropy(model(x), y).backward()  # the hooks are back, with no activations left by scoring
    assert all(p.grad_sample.shape[0] == len(x) for p in model.parameters())


def test_scoring_a_lightning_module():
    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = linear_model()

        def forward(self, x):
            return self.net(x)

    x, y = torch.rand(5, 3), torch.tensor([0, 1, 2, 3, 0])
    module = Module()
    scores = FinalModelCanaries(inputs=x, labels=y).score(module)
    np.testing.assert_allclose(scores["logit_margin"], by_hand(module.net, x, y)[1], rtol=1e-12)


def test_audit_passes_scores_and_inclusion(monkeypatch):
    seen = {}
    monkeypatch.setattr(final_model_analysis, "audit_final_model", lambda scores, included, **kw: seen.update(
        scores=scores, included=included, **kw) or "result")
    audit = FinalModelCanaries(inputs=torch.rand(6, 3), labels=torch.arange(6) % 4, seed=4)
    assert audit.audit(linear_model().float(), delta=1e-5, epoch=2) == "result"
    assert np.array_equal(seen["included"], audit.included) and set(seen["scores"]) == {"loss", "logit_margin"}
    assert seen["kind"] == "custom" and seen["delta"] == 1e-5 and seen["epoch"] == 2 and seen["selection"] == "union"


# Kinds, on digits


def test_each_kind_builds_on_digits(one_thread):
    data, (held_x, held_y) = digits_dataset(), digits_holdout(100)
    audit = FinalModelCanaries(50, "ood", example_seed=3)
    with pytest.raises(ValueError, match="call wrap"):
        audit.examples
    audit.wrap(data)
    x, y = audit.examples
    assert x.shape == (50, 1, 8, 8) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1 and x.std() > 0.2
    assert y.shape == (50,) and 0 <= y.min() and y.max() <= 9 and len(set(y.tolist())) > 5
    torch.manual_seed(123)  # the examples depend on example_seed only
    again = FinalModelCanaries(50, "ood", example_seed=3)
    again.wrap(data)
    assert again.state_dict()["examples_fingerprint"] == audit.state_dict()["examples_fingerprint"]

    mislabeled = FinalModelCanaries(40, "mislabeled", held_out=(held_x, held_y))
    x, y = mislabeled.examples
    source = [int(torch.nonzero((held_x == xi).flatten(1).all(1))[0]) for xi in x]
    assert len(set(source)) == 40 and all(int(yi) != int(held_y[s]) for yi, s in zip(y, source))

    blank = FinalModelCanaries(20, "blank", num_classes=10)
    blank.wrap(data)
    x, y = blank.examples
    assert x.shape == (20, 1, 8, 8) and not x.any() and torch.equal(y, (y[0] + torch.arange(20)) % 10)

    crafted = FinalModelCanaries(6, "crafted", held_out=(held_x, held_y), model=DigitsCNN())
    x, y = crafted.examples
    assert x.shape == (6, 1, 8, 8) and y.shape == (6,) and not any((held_x == xi).flatten(1).all(1).any() for xi in x)
    assert len(crafted.wrap(data)) == len(data) + crafted.num_included


def test_bad_arguments_name_themselves():
    held = digits_holdout(30)
    cases = [
        (lambda: FinalModelCanaries(1), "`count`: 1"),
        (lambda: FinalModelCanaries(10, "adversarial"), "`kind`: 'adversarial'"),
        (lambda: FinalModelCanaries(10, "mislabeled"), "need `held_out="),
        (lambda: FinalModelCanaries(10, "crafted", held_out=held), "need `model=`"),
        (lambda: FinalModelCanaries(40, "mislabeled", held_out=held), "`count`: 40.* `held_out` has 30"),
        (lambda: FinalModelCanaries(10, seed=-1), "`seed`: -1"),
        (lambda: FinalModelCanaries(10, batch_size=0), "`batch_size`: 0"),
        (lambda: FinalModelCanaries(inputs=torch.rand(3, 2)), "both `inputs` and `labels`"),
        (lambda: FinalModelCanaries(inputs=torch.rand(3, 2), labels=torch.rand(3)), "class indices"),
        (lambda: ood().wrap(TensorDataset(torch.rand(5, 2), torch.zeros(5, dtype=torch.long))), "`num_classes`"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()


# Lightning data module


class Data(pl.LightningDataModule):
    def setup(self, stage):
        self.train, self.val = base_data(), base_data(20, seed=1)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=16, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=8)

    def state_dict(self):
        return {"epoch_seen": 3}


def test_canary_data_module_trains_on_the_canaries():
    audit = ood(60, seed=9)
    data = CanaryDataModule(Data(), audit)
    data.setup("fit")
    loader = data.train_dataloader()
    assert loader.batch_size == 16 and loader.drop_last and isinstance(loader.sampler, torch.utils.data.RandomSampler)
    assert isinstance(loader.dataset, CanaryDataset) and len(loader.dataset) == 100 + audit.num_included
    rows = {tuple(x.tolist()) for batch, _ in DataLoader(loader.dataset, batch_size=200) for x in batch}
    inputs = audit.examples[0]
    assert all((tuple(inputs[i].tolist()) in rows) == bool(audit.included[i]) for i in range(60))
    assert len(data.val_dataloader().dataset) == 20
    assert pl.utilities.model_helpers.is_overridden("val_dataloader", data)
    assert not pl.utilities.model_helpers.is_overridden("test_dataloader", data)
    assert data.state_dict() == {"epoch_seen": 3}


def test_canary_data_module_under_a_trainer():
    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.sizes = nn.Linear(3, 4), []

        def training_step(self, batch, _):
            self.sizes.append(len(batch[0]))
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def validation_step(self, batch, _):
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    audit, module = ood(60, seed=9), Module()
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu")
    trainer.fit(module, datamodule=CanaryDataModule(Data(), audit))
    assert len(module.sizes) == (100 + audit.num_included) // 16
