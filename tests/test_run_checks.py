"""The run checks: what the accountant assumes about the run beyond the optimizer (engine/checks/run/).

Each kind of pipeline mistake is flagged with the finding that names it at the first step where it
is certain, and correct runs (Poisson loaders, BatchMemoryManager, dropout, disjoint ConcatDatasets)
stay quiet. The checks are certainties except the batch-size test (its own budget, 1e-6 over a run)
and the batch-repeat test (alarms only where Poisson sampling repeats a batch with probability
below 1e-9): every test here is deterministic under its seeds, with false-failure rate below 1e-6.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from opacus import PrivacyEngine
from opacus.accountants import RDPAccountant
from opacus.data_loader import DPDataLoader
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader, Subset, TensorDataset, WeightedRandomSampler

from lightning_dpaudit import DPAuditCallback, PrivacyAuditor
from lightning_dpaudit.analysis.report import summary_table, verdict_title
from lightning_dpaudit.engine.checks.run import CouplingCheck, MultiplicityCheck, SamplingCheck
from lightning_dpaudit.estimators.batch_sizes import BatchSizeTest
from lightning_dpaudit.integrations.digits import DigitsCNN, digits_dataset, make_private_digits

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")
CE = nn.CrossEntropyLoss()
PIPELINE = {"sampling", "multiplicity", "coupled_examples", "outside_dp"}


def _train(model, optimizer, loader, steps, step_loss=None, after=None):
    done = 0
    while done < steps:
        for batch in loader:
            optimizer.zero_grad()
            loss = step_loss(batch) if step_loss is not None else CE(model(batch[0]), batch[1])
            loss.backward()
            optimizer.step()
            if after is not None:
                after()
            done += 1
            if done >= steps:
                return


def _codes(result):
    return [(f.code, f.first_step) for f in result.findings]


def _private(model, data, *, batch_size=64, poisson=True, sampler=None, seed=0, **options):
    torch.manual_seed(seed)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, shuffle=sampler is None,
                        generator=torch.Generator().manual_seed(seed))
    return PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=poisson,
        noise_generator=torch.Generator().manual_seed(seed + 1), **options,
    )


# ------------------------------------------------------------------ correct runs stay quiet


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_a_correct_poisson_run_is_quiet_and_the_checks_compare(mode):
    model, optimizer, loader, _ = make_private_digits(seed=0, grad_sample_mode=mode)
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1,
                             training_loss=lambda b: CE(model(b[0]), b[1]))
    _train(model, optimizer, loader, 60)
    result = auditor.result()
    assert not result.violation and not PIPELINE & {c for c, _ in _codes(result)}
    assert "loader: poisson" in result.pipeline and "60 steps compared" in result.pipeline
    assert "1 replays with the others replaced, through the training step" in result.pipeline
    assert math.isnan(result.epsilon_sampling)


def test_batch_memory_manager_counts_every_physical_batch_of_a_step():
    model, optimizer, loader, _ = make_private_digits(seed=0)
    auditor = PrivacyAuditor(optimizer, module=model, seed=1)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=16, optimizer=optimizer) as safe:
        auditor.watch_loader(safe)
        for x, y in safe:
            optimizer.zero_grad()
            CE(model(x), y).backward()
            optimizer.step()
            if auditor.steps >= 30:
                break
    result = auditor.result()
    assert not result.violation, _codes(result)
    assert auditor.steps >= 25  # one epoch of Poisson batches (its length varies)
    assert "loader: poisson" in result.pipeline and f"{auditor.steps} steps compared" in result.pipeline


def test_a_dropout_model_replays_exactly_and_stays_quiet():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))
    model, optimizer, loader = _private(model, digits_dataset())
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=2,
                             training_loss=lambda b: CE(model(b[0]), b[1]), per_sample_check_every=5,
                             per_sample_check_budget=1.0)
    _train(model, optimizer, loader, 30)
    result = auditor.result()
    assert not result.violation, _codes(result)
    assert auditor.checks.find(CouplingCheck).compared == 6


def test_disjoint_parts_of_one_dataset_are_not_copies():
    data = digits_dataset()
    parts = ConcatDataset([Subset(data, range(0, 900)), Subset(data, range(900, 1797))])
    model, optimizer, loader = _private(DigitsCNN(), parts)
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1)
    _train(model, optimizer, loader, 5)
    assert not auditor.result().violation


# ------------------------------------------------------------------ sampling


def test_a_loader_never_made_private_is_flagged_at_attach_with_the_epsilon_of_its_sampling():
    model, optimizer, loader, engine = make_private_digits(seed=0, poisson_sampling=False)
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1)
    assert _codes(auditor.result()) == [("sampling", 0)]
    _train(model, optimizer, loader, 60)  # 29 batches an epoch: 3 epochs begun
    result = auditor.result()
    assert "shuffled fixed-size batches of 64" in result.findings[0].message
    expected = RDPAccountant()
    expected.history = [(1.0, 1.0, 3)]
    assert result.epsilon_sampling == pytest.approx(expected.get_epsilon(delta=1e-5), rel=1e-9)
    assert result.epsilon_sampling > result.epsilon_accountant
    assert summary_table({"result": result.to_dict()}).startswith(
        "VIOLATION: the accountant's epsilon does not describe this run (sampling); found at step 0 (first violating step 0)")
    assert "epsilon, sampling used" in str(result)
    assert verdict_title(result).startswith("VIOLATION found at step 0 (first violating step 0): the accountant's epsilon does "
                                            "not describe this run")


def test_a_weighted_sampler_has_no_valid_epsilon():
    data = digits_dataset()
    sampler = WeightedRandomSampler(torch.ones(len(data)), num_samples=len(data), generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = _private(DigitsCNN(), data, poisson=False, sampler=sampler)
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1)
    _train(model, optimizer, loader, 3)
    result = auditor.result()
    assert _codes(result)[0] == ("sampling", 0) and "drawn by weight" in result.findings[0].message
    assert result.epsilon_sampling == math.inf and "no valid bound" in str(result)


def test_a_poisson_loader_at_another_rate_than_the_accountant_is_flagged():
    model, optimizer, loader, _ = make_private_digits(seed=0)
    faster = DPDataLoader.from_data_loader(DataLoader(digits_dataset(), batch_size=128))
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=faster, seed=1)
    result = auditor.result()
    assert _codes(result) == [("sampling", 0)] and "accountant composes 0.0344828" in result.findings[0].message


class FixedBatches:
    """A batch sampler of its own kind (not one the loader check knows): shuffled batches of 64."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(0))
        return iter(order[: self.n - self.n % 64].view(-1, 64).tolist())

    def __len__(self):
        return self.n // 64


def test_fixed_batch_sizes_are_refuted_within_a_few_dozen_steps():
    model, optimizer, _, _ = make_private_digits(seed=0)
    loader = DataLoader(digits_dataset(), batch_sampler=FixedBatches(1797))
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1)
    assert not auditor.result().violation  # the sampler is not one the loader check recognises
    _train(model, optimizer, loader, 30)
    result = auditor.result()
    assert _codes(result)[0][0] == "sampling" and _codes(result)[0][1] <= 16
    assert "pairs of consecutive batches have equal sizes" in result.findings[0].message


def test_a_re_seeded_generator_repeats_batches_and_is_flagged():
    model, optimizer, loader, _ = make_private_digits(seed=0)
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1)
    for epoch in range(3):
        loader.batch_sampler.generator.manual_seed(5)  # the same draws every epoch
        _train(model, optimizer, loader, len(loader))
    result = auditor.result()
    assert _codes(result)[0] == ("sampling", len(loader) + 1)
    assert "holds exactly the records of step 1's" in result.findings[0].message


def test_the_batch_size_test_keeps_its_false_alarm_budget():
    """2,000 simulated Poisson runs of 300 steps at alpha 0.05: the rate is far below alpha (0.0045 here)."""
    rng = np.random.default_rng(0)
    alarms = 0
    for _ in range(2000):
        test = BatchSizeTest(64, 64 / 1500, 0.05)
        alarms += any(test.add(int(x)) for x in rng.binomial(1500, 64 / 1500, size=300))
    assert alarms / 2000 <= 0.05
    fixed = BatchSizeTest(64, 64 / 1500, 1e-6)
    assert [i for i in range(40) if fixed.add(64)][0] <= 12


# ------------------------------------------------------------------ multiplicity


def test_copies_made_in_the_step_are_flagged_at_step_1():
    model, optimizer, loader, _ = make_private_digits(seed=0)
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1)

    def augmented(batch):
        x, y = batch
        return CE(model(torch.cat([x, x.flip(-1)])), torch.cat([y, y]))

    _train(model, optimizer, loader, 3, step_loss=augmented)
    result = auditor.result()
    assert _codes(result)[0] == ("multiplicity", 1)
    assert "up to 2 C while the noise is for C" in result.findings[0].message


def test_a_dataset_concatenated_with_transformed_copies_of_itself_is_flagged_at_attach():
    class Flipped(torch.utils.data.Dataset):
        def __init__(self, base):
            self.base = base

        def __len__(self):
            return len(self.base)

        def __getitem__(self, i):
            x, y = self.base[i]
            return x.flip(-1), y

    data = digits_dataset()
    model, optimizer, loader = _private(DigitsCNN(), ConcatDataset([data, Flipped(data)]))
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1)
    result = auditor.result()
    assert _codes(result) == [("multiplicity", 0)] and "parts 0 (TensorDataset) and 1 (Flipped)" in result.findings[0].message


def test_a_tensor_dataset_stacked_with_its_mirror_images_is_flagged_at_attach():
    images, labels = digits_dataset().tensors
    stacked = TensorDataset(torch.cat([images, images.flip(-1)]), torch.cat([labels, labels]))  # one tensor: no parts
    model, optimizer, loader = _private(DigitsCNN(), stacked)
    result = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1).result()
    assert _codes(result) == [("multiplicity", 0)]
    assert "3594 of the 3594 rows of the training data are other rows mirrored left-right" in result.findings[0].message


def test_mirror_images_are_found_exactly_and_a_few_are_not_a_finding():
    from lightning_dpaudit.engine.checks.run.dataset_copies import find_copies, mirrored_finding

    images = digits_dataset().tensors[0]
    assert (find_copies(images).mirrored, find_copies(images).duplicates) == (0, 0)  # the digits hold no copies
    upside_down = find_copies(torch.cat([images, images[:300].flip(-2)]))
    assert (upside_down.mirrored, upside_down.axis, upside_down.duplicates) == (600, "top-bottom", 0)
    assert mirrored_finding(find_copies(torch.cat([images, images[:5].flip(-1)]))) is None  # 10 of 1802: under 1%
    symmetric = torch.zeros(20, 1, 8, 8)  # equal to their own mirror images: duplicates, not mirrored copies
    assert (find_copies(symmetric).mirrored, find_copies(symmetric).duplicates) == (0, 19)


# ------------------------------------------------------------------ independence


class BatchCentred(nn.Module):
    """Subtracts the batch's mean: every example's output depends on the others."""

    def forward(self, x):
        return x - x.mean(dim=0, keepdim=True)


def test_statistics_over_the_batch_are_flagged_in_the_module_where_they_arise():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), BatchCentred(), nn.ReLU(), nn.Linear(32, 10))
    model, optimizer, loader = _private(model, digits_dataset())
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1)
    _train(model, optimizer, loader, 3)
    result = auditor.result()
    assert _codes(result)[0][0] == "coupled_examples" and _codes(result)[0][1] <= 1
    assert "in `2` of the forward pass" in result.findings[0].message


def test_mixing_inputs_in_the_training_step_is_flagged_before_the_model():
    model, optimizer, loader, _ = make_private_digits(seed=0)

    def mixup(batch):
        x, y = batch
        return CE(model(0.7 * x + 0.3 * x.roll(1, dims=0)), y)

    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1, training_loss=mixup)
    _train(model, optimizer, loader, 3, step_loss=mixup)
    result = auditor.result()
    assert _codes(result)[0] == ("coupled_examples", 1)
    assert "it arises in what the training step does to the batch before the model" in result.findings[0].message


def test_a_loss_over_pairs_is_flagged_in_the_loss():
    model, optimizer, loader, _ = make_private_digits(seed=0)

    def contrastive(batch):
        out = model(batch[0])
        return CE(out, batch[1]) + (out @ out.T).logsumexp(dim=1).mean()

    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1, training_loss=contrastive)
    _train(model, optimizer, loader, 3, step_loss=contrastive)
    result = auditor.result()
    assert _codes(result)[0] == ("coupled_examples", 1) and "it arises in the loss" in result.findings[0].message


def test_without_the_training_loss_the_check_covers_the_forward_pass_and_says_so():
    model, optimizer, loader, _ = make_private_digits(seed=0)

    def contrastive(batch):
        out = model(batch[0])
        return CE(out, batch[1]) + (out @ out.T).logsumexp(dim=1).mean()

    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1)
    _train(model, optimizer, loader, 3, step_loss=contrastive)
    result = auditor.result()
    assert not result.violation and "through the forward pass" in result.pipeline


# ------------------------------------------------------------------ outside DP-SGD


def test_a_head_trained_by_another_optimizer_is_flagged_by_step_2():
    model, optimizer, loader, _ = make_private_digits(seed=0)
    head = nn.Linear(10, 10)
    other = torch.optim.Adam(head.parameters())
    auditor = PrivacyAuditor(optimizer, module=nn.ModuleDict({"body": model, "head": head}), data_loader=loader, seed=1)
    _train(model, optimizer, loader, 3, step_loss=lambda b: CE(head(model(b[0])), b[1]), after=other.step)
    result = auditor.result()
    assert _codes(result)[0] == ("outside_dp", 2) and "`head.weight`, `head.bias` changed" in result.findings[0].message


def test_another_optimizer_inside_the_model_the_data_runs_through_is_flagged_at_attach():
    base = DigitsCNN()
    model, optimizer, loader = PrivacyEngine().make_private(  # the whole CNN sees the batch, only its features are DP
        module=base, optimizer=torch.optim.SGD(base.features.parameters(), lr=0.1), data_loader=DataLoader(
            digits_dataset(), batch_size=64), noise_multiplier=1.0, max_grad_norm=1.0)
    auditor = PrivacyAuditor(optimizer, module=model, seed=1,
                             other_optimizers=[torch.optim.SGD(base.classifier.parameters(), lr=0.1)])
    result = auditor.result()
    assert _codes(result) == [("outside_dp", 0)] and "`classifier.1.weight`" in result.findings[0].message


def test_another_optimizers_tensor_outside_the_module_given_is_flagged_at_attach():
    """A loss's own temperature, say: nothing tells what trains it, so it counts as trained on the data."""
    model, optimizer, _, _ = make_private_digits(seed=0)
    temperature = nn.Parameter(torch.ones(()))
    auditor = PrivacyAuditor(optimizer, module=model, seed=1, other_optimizers=[torch.optim.Adam([temperature])])
    result = auditor.result()
    assert _codes(result) == [("outside_dp", 0)] and "`a tensor of shape ()` by Adam" in result.findings[0].message


def _beside_run(head_loss, *, audited: bool = True, steps: int = 3):
    """The digits CNN under DP-SGD and a 64 -> 64 head beside it, trained by its own SGD on `head_loss(model, head,
    batch)` after each DP step. (model, head, the audit's result or None)."""
    model, optimizer, loader, _ = make_private_digits(seed=0)
    torch.manual_seed(7)
    head = nn.Linear(64, 64)
    second = torch.optim.SGD(head.parameters(), lr=0.1)
    auditor = None
    if audited:
        auditor = PrivacyAuditor(optimizer, module=nn.ModuleDict({"body": model, "head": head}), data_loader=loader,
                                 seed=1, other_optimizers=[second], on_violation=lambda result: None)
        assert auditor.result().findings == ()  # beside the model the batch runs through: judged by what trains it

    def train_head(batch):
        second.zero_grad()
        optimizer.zero_grad(set_to_none=True)
        head_loss(model, head, batch).backward()
        second.step()
        optimizer.zero_grad(set_to_none=True)  # the DP model's per-sample gradients of this pass dropped

    batches = []
    _train(model, optimizer, loader, steps, step_loss=lambda b: batches.append(b) or CE(model(b[0]), b[1]),
           after=lambda: train_head(batches[-1]))
    return model, head, None if auditor is None else auditor.result()


def test_another_optimizer_beside_the_model_trained_on_the_batch_is_flagged():
    """The head reads the private batch: a backward pass of the data's reaches it, outside_dp at step 2 (the first
    comparison after its first update)."""
    _, _, result = _beside_run(lambda model, head, batch: CE(head(batch[0].reshape(-1, 64))[:, :10], batch[1]))
    assert _codes(result) == [("outside_dp", 2)] and "`head.weight`, `head.bias`" in result.findings[0].message


def _generator_loss(model, head, batch):
    """A generator's loss: generated inputs through the DP model alone (no tensor of the batch)."""
    z = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    return -model(head(z).reshape(-1, 1, 8, 8)).logsumexp(dim=1).mean()


def test_a_generator_trained_through_the_dp_model_alone_is_a_note_and_training_is_unchanged():
    """Trained only through the DP model's outputs (a DP-GAN's generator): no finding, a note; every parameter as in
    the same run without the audit (the traced steps change nothing)."""
    model, head, result = _beside_run(_generator_loss)
    plain_model, plain_head, _ = _beside_run(_generator_loss, audited=False)
    assert result.findings == () and not result.violation
    assert any("never started from the private batch" in n and "`head.weight`" in n for n in result.notes)
    assert not torch._C._is_torch_function_mode_enabled()  # traced steps 1 and 2 only: nothing traces step 3 on
    for a, b in zip([*model.parameters(), *head.parameters()], [*plain_model.parameters(), *plain_head.parameters()]):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_tensor_left_out_but_never_changed_releases_nothing():
    model, optimizer, loader, _ = make_private_digits(seed=0)
    frozen = nn.Linear(10, 10)  # requires grad, in no optimizer, never updated
    auditor = PrivacyAuditor(optimizer, module=nn.ModuleDict({"body": model, "frozen": frozen}), data_loader=loader, seed=1)
    _train(model, optimizer, loader, 5, step_loss=lambda b: CE(frozen(model(b[0])), b[1]))
    result = auditor.result()
    assert not result.violation and "2 watched" in result.pipeline


class RunningMean(nn.Module):
    """Keeps a running mean of its inputs (a statistic of the data, released with the model)."""

    def __init__(self, width):
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(dim=0))
        return x


def test_a_buffer_learned_from_the_data_is_outside_dp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), RunningMean(64), nn.Linear(64, 10))
    model, optimizer, loader = _private(model, digits_dataset())
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1)
    _train(model, optimizer, loader, 3)
    result = auditor.result()
    assert ("outside_dp", 1) in _codes(result) and "`1.mean`" in result.findings[0].message


# ------------------------------------------------------------------ Lightning


class Digits(pl.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(Subset(digits_dataset(), range(512)), batch_size=64, shuffle=True,
                          generator=torch.Generator().manual_seed(0))


class Private(pl.LightningModule):
    def __init__(self, mixup=False, poisson=True):
        super().__init__()
        self.model, self.mixup, self.poisson = DigitsCNN(), mixup, poisson
        self.privacy_engine = PrivacyEngine()

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.mixup:
            x = 0.5 * x + 0.5 * x.flip(0)
        loss = CE(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        loader = self.trainer.datamodule.train_dataloader()
        _, optimizer, _ = self.privacy_engine.make_private(
            module=self, optimizer=torch.optim.SGD(self.parameters(), lr=0.2), data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=isinstance(loader, DPDataLoader),
            noise_generator=torch.Generator().manual_seed(7),
        )
        return optimizer


def _fit(tmp_path, module, datamodule, steps=12):
    from opacus.lightning import DPLightningDataModule

    pl.seed_everything(0, verbose=False)
    seen = []
    callback = DPAuditCallback(alert=seen.append, seed=0, report=False)
    trainer = pl.Trainer(max_steps=steps, callbacks=[callback], logger=False, default_root_dir=tmp_path,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         accelerator="cpu")
    trainer.fit(module, datamodule=DPLightningDataModule(datamodule) if module.poisson else datamodule)
    return callback.auditor.result(), seen


def test_lightning_with_opacus_data_module_is_quiet_and_replays_the_training_step(tmp_path):
    result, seen = _fit(tmp_path, Private(), Digits())
    assert not result.violation and not seen
    assert "loader: poisson" in result.pipeline and "through the training step" in result.pipeline


def test_lightning_with_a_data_module_never_made_private_alerts_at_fit_start(tmp_path):
    result, seen = _fit(tmp_path, Private(poisson=False), Digits(), steps=3)
    assert len(seen) == 1 and seen[0].steps == 0 and _codes(seen[0]) == [("sampling", 0)]
    assert "the accountant's epsilon does not describe this run" in str(result).splitlines()[0]


def test_lightning_mixup_in_training_step_is_flagged(tmp_path):
    result, seen = _fit(tmp_path, Private(mixup=True), Digits(), steps=3)
    assert seen and _codes(result)[0] == ("coupled_examples", 1)
    assert "before the model" in result.findings[0].message


def test_a_loop_over_another_loader_than_the_one_given_is_refuted_by_the_rows_it_clips():
    model, optimizer, private_loader, _ = make_private_digits(seed=0)
    shuffled = DataLoader(digits_dataset(), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=private_loader, seed=1)
    _train(model, optimizer, shuffled, 30)
    result = auditor.result()
    assert _codes(result)[0][0] == "sampling" and "pairs of consecutive batches have equal sizes" in result.findings[0].message
    assert "rows per record (not compared: no loader seen)" in result.pipeline


def test_a_running_mean_is_outside_dp_and_opacus_is_not_blamed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), RunningMean(64), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    model, optimizer, loader = _private(model, digits_dataset())
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1)
    _train(model, optimizer, loader, 3)
    codes = [c for c, _ in _codes(auditor.result())]
    assert codes[0] == "outside_dp" and "per_sample_gradients" not in codes  # replayed from the buffers as they were


class LabelPrior(Private):
    """Keeps a running prior of the labels in training_step: a statistic of the data, released with the model."""

    def __init__(self):
        super().__init__()
        self.register_buffer("prior", torch.full((10,), 0.1))

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.prior.mul_(0.9).add_(0.1 * torch.bincount(batch[1], minlength=10) / len(batch[1]))
        return super().training_step(batch, batch_idx)


def test_lightning_a_buffer_updated_in_training_step_is_outside_dp(tmp_path):
    result, seen = _fit(tmp_path, LabelPrior(), Digits(), steps=3)
    assert seen and _codes(result)[0] == ("outside_dp", 1) and "`prior`" in result.findings[0].message


def test_duplicate_records_in_a_tensor_dataset_are_a_note_naming_their_count():
    images, labels = digits_dataset().tensors
    doubled = TensorDataset(torch.cat([images, images]), torch.cat([labels, labels]))  # every record twice
    model, optimizer, loader = _private(DigitsCNN(), doubled)
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1)
    _train(model, optimizer, loader, 5)
    result = auditor.result()
    notes = [n for n in result.notes if n.startswith("multiplicity: ")]
    assert notes[-1] == ("multiplicity: 1797 row(s) of the training data equal to another of its rows: duplicate "
                         "records, or copies (the claim is one record per person)")
    # the sampling check's own count of the same fact in the batches, where it saw any, comes first
    assert all("equal to another row of their batch" in n for n in notes[:-1]) and len(notes) <= 2
    assert not result.violation


class Rows(torch.utils.data.Dataset):
    """The same rows, behind a dataset the scan does not open."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        return self.base[i]


def test_duplicate_records_seen_in_batches_are_a_note_naming_their_count():
    images, labels = digits_dataset().tensors
    doubled = Rows(TensorDataset(torch.cat([images, images]), torch.cat([labels, labels])))
    model, optimizer, loader = _private(DigitsCNN(), doubled)
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1)
    _train(model, optimizer, loader, 40)
    result = auditor.result()
    note = next(n for n in result.notes if n.startswith("multiplicity: "))
    assert int(note.split()[1]) == auditor.checks.find(SamplingCheck).duplicates > 0
    assert "equal to another row of their batch" in note and not result.violation


def test_an_error_of_the_run_checks_never_ends_the_training_loop(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("run checks broke")

    monkeypatch.setattr(MultiplicityCheck, "step", broken)
    monkeypatch.setattr(SamplingCheck, "batch", broken)
    model, optimizer, loader, _ = make_private_digits(seed=0)
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=1)
    with pytest.warns(RuntimeWarning, match="run checks broke"):
        _train(model, optimizer, loader, 3)
    assert auditor.steps == 3
    assert [name for name, _ in auditor.result().checks_stopped] == ["sampling", "rows per record"]


class SequenceFirst(nn.Module):
    """Inputs (sequence, batch, features), as a text model without batch_first reads them; out: (batch, classes)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x).mean(dim=0)


def test_sequence_first_data_read_as_batch_first_is_rows_that_are_not_records_not_a_sampling_fault():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(640, 12, 8), torch.randint(0, 4, (640,)))
    loader = DataLoader(data, batch_size=64, collate_fn=lambda items: (
        torch.stack([x for x, _ in items], dim=1), torch.stack([y for _, y in items])))
    model = SequenceFirst()
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0)  # batch_first=True (the default) on sequence-first data
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=0, on_violation=lambda r: None)
    _train(model, optimizer, loader, 3)
    result = auditor.result()
    codes = [f.code for f in result.findings]
    assert codes[0] == "rows_not_records" and "sampling" not in codes, codes
    assert "clipped 12 rows at step 1" in result.findings[0].message and "batch_first=False" in result.findings[0].message
    assert result.findings[0].scope == "pipeline" and "(rows_not_records)" in str(result).splitlines()[0]


def test_a_watcher_that_raises_stops_watching_and_the_batches_pass_unchanged():
    """The watched loader's `seen` raising: one RuntimeWarning, no later call, every batch delivered as it was."""
    from lightning_dpaudit.engine.checks.run.watched_loader import WatchedLoader

    loader = torch.utils.data.DataLoader(torch.arange(12.0), batch_size=4)
    calls = []

    def seen(batch):
        calls.append(batch)
        raise ValueError("broken")

    watcher = WatchedLoader(loader, seen)
    with pytest.warns(RuntimeWarning, match="stopped watching the loader: ValueError: broken"):
        delivered = list(loader)
    assert len(calls) == 1 and watcher.failed == "ValueError: broken"
    assert [b.tolist() for b in delivered] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]]
    watcher.restore()
    assert type(loader) is torch.utils.data.DataLoader
