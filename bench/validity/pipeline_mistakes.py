"""Pipeline mistakes a new Opacus user makes, under the default audit: which do the run checks flag?

The accountant's epsilon holds only if the whole run is the mechanism it composes: every
record one row, drawn independently with probability q at every step (Poisson), its clipped
gradient depending on that record alone, the parameters updated only through the noised sum.
Each scenario below breaks one of these clauses the way a user would, in a plain Opacus loop
(`PrivacyAuditor(optimizer, module=model, data_loader=loader, training_loss=...)`, as the
guides show) or under Lightning (`DPAuditCallback()` on the Trainer), on the bundled digits
with sigma 1, C 1 and batches of 64, for up to `--steps` (300) steps. A scenario stops at its
first alarm (the alert callable records it); the table gives the verdict, the findings' codes,
the first step of the first run-check finding and the start of its message. A correct control
per setting (plain, plain with BatchMemoryManager, Lightning) shows that the checks stay quiet
on a correct run.

The four kinds are the run checks' finding codes (lightning_dpaudit/engine/checks/run/):
`sampling`, `multiplicity`, `coupled_examples`, `outside_dp`. A mistake counts as flagged when
the audit reports any of them.

    OMP_NUM_THREADS=1 .venv/bin/python bench/validity/pipeline_mistakes.py [--only NAME[,NAME...]] [--steps 300] [--seed 0] [--list]
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

from _path import harness

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import (ConcatDataset, DataLoader, Dataset, RandomSampler, Subset, TensorDataset,
                              WeightedRandomSampler, random_split)

warnings.filterwarnings("ignore")


def quiet_logs() -> None:
    """Lightning's and the audit's INFO lines off (Lightning sets its level when imported: call after)."""
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning_dpaudit"):
        logging.getLogger(name).setLevel(logging.ERROR)


STEPS = 300
SEED = 0  # the data order, the model's initialisation and the audit's own draws (examples checked, replacements)
BATCH = 64
SIGMA, C, LR = 1.0, 1.0, 0.5
PIPELINE = ("sampling", "multiplicity", "coupled_examples", "outside_dp")
MESSAGE_CHARS = 150


# ---------------------------------------------------------------------------------------------------- outcome


@dataclass
class Outcome:
    verdict: str
    codes: list
    first_step: Optional[int]
    message: str
    steps: int


@dataclass
class Alarm:
    """The alert callable: keeps the first AuditResult and asks the run to stop."""

    result: object = None
    trainer: object = None

    def __call__(self, result) -> None:
        if self.result is None:
            self.result = result
        if self.trainer is not None:
            self.trainer.should_stop = True


def outcome(result, steps: int) -> Outcome:
    findings = list(result.findings)
    first = next((f for f in findings if f.code in PIPELINE), None)
    if first is not None:
        message = first.message
    else:  # nothing about the run: say what the checks compared
        message = "(no run-check finding) " + result.pipeline
    return Outcome(
        verdict="VIOLATION" if result.violation else "OK",
        codes=list(dict.fromkeys(f.code for f in findings)),
        first_step=None if first is None else first.first_step,
        message=" ".join(message.split())[:MESSAGE_CHARS],
        steps=steps,
    )


# ---------------------------------------------------------------------------------------------------- data


def digits() -> TensorDataset:
    from lightning_dpaudit.datasets import digits_dataset

    return digits_dataset()


def shuffled(dataset, **kwargs) -> DataLoader:
    return DataLoader(dataset, batch_size=BATCH, shuffle=True, **kwargs)


class Flipped(Dataset):
    """The dataset's images mirrored left to right ("free" augmentation)."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        image, label = self.base[i]
        return image.flip(-1), label


# ---------------------------------------------------------------------------------------------------- models


class BatchStandardize(nn.Module):
    """Standardise each feature over the batch in training (a BatchNorm without parameters, which Opacus accepts)."""

    def forward(self, x):
        if not self.training:
            return x
        return (x - x.mean(0, keepdim=True)) / (x.std(0, keepdim=True) + 1e-5)


class InputCentering(nn.Module):
    """Subtract a running mean of the training images (updated after use, like BatchNorm's running_mean)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(1, 8, 8))

    def forward(self, x):
        out = x - self.mean
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.99).add_(0.01 * x.mean(0))
        return out


def cnn() -> nn.Module:
    from lightning_dpaudit.datasets import DigitsCNN

    return DigitsCNN()


def cnn_with_batch_standardize() -> nn.Module:
    model = cnn()
    model.classifier.insert(2, BatchStandardize())  # after Linear(256, 32)
    return model


def cnn_with_input_centering() -> nn.Module:
    model = cnn()
    model.features.insert(0, InputCentering())
    return model


def cnn_behind_input_centering() -> nn.Module:
    return nn.Sequential(InputCentering(), cnn())


# ---------------------------------------------------------------------------------------------------- losses


def mixup(x, y, logits_of):
    """Mixup across the batch: each image blended with another image of the batch."""
    lam = float(np.random.beta(0.4, 0.4))
    perm = torch.randperm(len(x))
    logits = logits_of(lam * x + (1 - lam) * x[perm])
    return lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[perm])


def batch_balanced_ce(logits, y):
    """Cross-entropy with class weights from the batch's own label counts."""
    counts = torch.bincount(y, minlength=10).float()
    weight = counts.sum() / (10 * counts.clamp(min=1))
    return F.cross_entropy(logits, y, weight=weight)


def hardest_half_ce(logits, y):
    """Online hard-example mining: the mean loss of the batch's hardest half."""
    losses = F.cross_entropy(logits, y, reduction="none")
    return losses.topk(max(1, len(losses) // 2)).values.mean()


def supervised_contrastive(logits, y, temperature: float = 0.5):
    """A SupCon term on the normalised outputs: pull same-label pairs of the batch together."""
    z = F.normalize(logits, dim=1)
    sim = z @ z.T / temperature
    eye = torch.eye(len(y), dtype=torch.bool)
    sim = sim.masked_fill(eye, -1e9)
    positives = (y[:, None] == y[None, :]) & ~eye
    log_prob = sim - torch.logsumexp(sim, dim=1, keepdim=True)
    per_anchor = (log_prob * positives).sum(1) / positives.sum(1).clamp(min=1)
    return -per_anchor.mean()


class TemperatureCE(nn.Module):
    """Cross-entropy with a learned temperature (a parameter of the loss, not of the model)."""

    def __init__(self):
        super().__init__()
        self.log_t = nn.Parameter(torch.zeros(()))

    def forward(self, logits, y):
        return F.cross_entropy(logits / self.log_t.exp(), y)


# ---------------------------------------------------------------------------------------------------- plain loop


def private(model, loader, *, poisson: bool = True, params=None):
    """Opacus's make_private as a user calls it (SGD over `params`, default all of the model's)."""
    from opacus import PrivacyEngine

    optimizer = torch.optim.SGD(model.parameters() if params is None else params, lr=LR)
    return PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=SIGMA,
                                        max_grad_norm=C, poisson_sampling=poisson)


def run_plain(model, optimizer, loader, loss: Callable, *, audited=None, other_optimizers=(),
              after_step: Optional[Callable] = None, memory_manager: bool = False) -> Outcome:
    """A plain training loop with the audit attached as the guides show.

    loader      what the loop iterates: a DataLoader, or epoch -> a DataLoader built at each epoch (each given to
                `auditor.watch_loader`)
    audited     the loader the user tells the auditor about (default: `loader`)
    after_step  what the loop does after optimizer.step() (another optimizer's step, a manual update)
    memory_manager  iterate through BatchMemoryManager (physical batches of 16), watched with `watch_loader`
    """
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    from lightning_dpaudit import PrivacyAuditor

    steps = STEPS
    per_epoch = callable(loader) and not isinstance(loader, DataLoader)
    audited = audited if audited is not None else (None if per_epoch or memory_manager else loader)
    alarm = Alarm()
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=audited, training_loss=loss,
                             other_optimizers=list(other_optimizers), on_violation=alarm, seed=SEED)
    done, epoch = 0, 0
    try:
        while done < steps and alarm.result is None:
            epoch_loader = loader(epoch) if per_epoch else loader
            if per_epoch:
                auditor.watch_loader(epoch_loader)
            physical = BatchMemoryManager(data_loader=epoch_loader, max_physical_batch_size=16, optimizer=optimizer) \
                if memory_manager else contextlib.nullcontext(epoch_loader)
            with physical as batches:
                if memory_manager:
                    auditor.watch_loader(batches)
                for batch in batches:
                    optimizer.zero_grad()
                    loss(batch).backward()
                    optimizer.step()
                    if after_step is not None:
                        after_step()
                    if not getattr(optimizer, "_is_last_step_skipped", False):  # BatchMemoryManager's partial steps
                        done += 1
                    if done >= steps or alarm.result is not None:
                        break
            epoch += 1
        result = auditor.result()
    finally:
        auditor.detach()
    return outcome(result, done)


def ce(model):
    """The plain step's loss on a loader batch."""
    return lambda batch: F.cross_entropy(model(batch[0]), batch[1])


# ---------------------------------------------------------------------------------------------------- Lightning


def lightning_classes():
    """The LightningModule and datamodules of the Lightning guide, built on first use (Lightning imports slowly)."""
    import pytorch_lightning as pl
    from opacus import PrivacyEngine
    from opacus.data_loader import DPDataLoader

    class Digits(pl.LightningDataModule):
        def __init__(self, dataset=None, loader: Optional[Callable] = None):
            super().__init__()
            self.dataset = dataset if dataset is not None else digits()
            self.loader = loader or shuffled

        def train_dataloader(self):
            return self.loader(self.dataset)

    class PrivateClassifier(pl.LightningModule):
        """The guide's LightningModule: made private in configure_optimizers with the datamodule's loader."""

        model_factory = staticmethod(cnn)

        def __init__(self):
            super().__init__()
            self.model = self.model_factory()
            self.privacy_engine = PrivacyEngine()

        def forward(self, images):
            return self.model(images)

        def loss(self, images, labels):
            return F.cross_entropy(self(images), labels)

        def training_step(self, batch, batch_idx):
            images, labels = batch
            return self.loss(images, labels)

        def dp_parameters(self):
            return self.parameters()

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.dp_parameters(), lr=LR)
            data_loader = self.trainer.datamodule.train_dataloader()
            _, optimizer, _ = self.privacy_engine.make_private(
                module=self, optimizer=optimizer, data_loader=data_loader, noise_multiplier=SIGMA, max_grad_norm=C,
                poisson_sampling=isinstance(data_loader, DPDataLoader),
            )
            return optimizer

    return pl, Digits, PrivateClassifier


def run_lightning(module, datamodule) -> Outcome:
    """trainer.fit with DPAuditCallback() on the Trainer (the alert a callable that stops the fit)."""
    import pytorch_lightning as pl

    from lightning_dpaudit import DPAuditCallback

    quiet_logs()
    alarm = Alarm()
    callback = DPAuditCallback(alert=alarm, report=False, seed=SEED)
    trainer = pl.Trainer(max_steps=STEPS, callbacks=[callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                         num_sanity_val_steps=0)
    alarm.trainer = trainer
    trainer.fit(module, datamodule=datamodule)
    result = callback.auditor.result()
    return outcome(result, callback.auditor.steps)


def dp_datamodule(datamodule):
    from opacus.lightning import DPLightningDataModule

    return DPLightningDataModule(datamodule)


# ---------------------------------------------------------------------------------------------------- plain scenarios


def plain_control():
    model, optimizer, loader = private(cnn(), shuffled(digits()))
    return run_plain(model, optimizer, loader, ce(model))


def plain_control_memory_manager():
    model, optimizer, loader = private(cnn(), shuffled(digits()))
    return run_plain(model, optimizer, loader, ce(model), memory_manager=True)


def never_private_loader():
    """The loader keeps shuffle=True: make_private(poisson_sampling=False) leaves it as it is."""
    model, optimizer, loader = private(cnn(), shuffled(digits()), poisson=False)
    return run_plain(model, optimizer, loader, ce(model))


def loops_over_own_loader():
    """make_private's Poisson loader is discarded; the loop (and the auditor) use the user's shuffled one."""
    loader = shuffled(digits())
    model, optimizer, _ = private(cnn(), loader)
    return run_plain(model, optimizer, loader, ce(model))


def loops_over_own_loader_audits_private():
    """As above, but the auditor is told about make_private's loader, which the loop never iterates."""
    loader = shuffled(digits())
    model, optimizer, dp_loader = private(cnn(), loader)
    return run_plain(model, optimizer, loader, ce(model), audited=dp_loader)


def weighted_sampler():
    """Class-balanced batches: a WeightedRandomSampler the user keeps with poisson_sampling=False."""
    data = digits()
    labels = data.tensors[1]
    weights = (1.0 / torch.bincount(labels).float())[labels]
    loader = DataLoader(data, batch_size=BATCH, sampler=WeightedRandomSampler(weights, len(data)))
    model, optimizer, loader = private(cnn(), loader, poisson=False)
    return run_plain(model, optimizer, loader, ce(model))


def replacement_sampler_after():
    """A loader rebuilt after make_private with RandomSampler(replacement=True) ("more steps per epoch")."""
    data = digits()
    model, optimizer, _ = private(cnn(), shuffled(data))
    loader = DataLoader(data, batch_size=BATCH, sampler=RandomSampler(data, replacement=True, num_samples=4 * len(data)))
    return run_plain(model, optimizer, lambda epoch: loader, ce(model))


def loader_rebuilt_each_epoch():
    """For reproducible epochs the Poisson loader is rebuilt every epoch from a generator seeded the same way."""
    from opacus.data_loader import DPDataLoader

    data = digits()
    model, optimizer, _ = private(cnn(), shuffled(data))

    def epoch_loader(epoch):
        return DPDataLoader.from_data_loader(shuffled(data, generator=torch.Generator().manual_seed(1234)))

    return run_plain(model, optimizer, epoch_loader, ce(model))


def split_after_private():
    """make_private on all the data, then training on an 80% split: the loader's q is not the accountant's."""
    from opacus.data_loader import DPDataLoader

    data = digits()
    model, optimizer, _ = private(cnn(), shuffled(data))
    train, _ = random_split(data, [0.8, 0.2], generator=torch.Generator().manual_seed(0))
    loader = DPDataLoader.from_data_loader(shuffled(train))
    return run_plain(model, optimizer, lambda epoch: loader, ce(model))


def flipped_copies_in_step():
    """Each batch doubled inside the step with its mirrored images."""
    model, optimizer, loader = private(cnn(), shuffled(digits()))

    def loss(batch):
        x, y = batch
        return F.cross_entropy(model(torch.cat([x, x.flip(-1)])), torch.cat([y, y]))

    return run_plain(model, optimizer, loader, loss)


def concat_flipped_dataset():
    """ConcatDataset of the data and a mirrored view of it."""
    data = digits()
    model, optimizer, loader = private(cnn(), shuffled(ConcatDataset([data, Flipped(data)])))
    return run_plain(model, optimizer, loader, ce(model))


def oversampled_rare_classes():
    """The rarest three classes appended again to balance the data."""
    data = digits()
    counts = torch.bincount(data.tensors[1])
    rare = torch.isin(data.tensors[1], counts.argsort()[:3]).nonzero().flatten().tolist()
    model, optimizer, loader = private(cnn(), shuffled(ConcatDataset([data, Subset(data, rare)])))
    return run_plain(model, optimizer, loader, ce(model))


def augmented_arrays_concatenated():
    """The images and their mirror images stacked into one tensor before building the dataset."""
    images, labels = digits().tensors
    data = TensorDataset(torch.cat([images, images.flip(-1)]), torch.cat([labels, labels]))
    model, optimizer, loader = private(cnn(), shuffled(data))
    return run_plain(model, optimizer, loader, ce(model))


def batch_standardize_layer():
    model, optimizer, loader = private(cnn_with_batch_standardize(), shuffled(digits()))
    return run_plain(model, optimizer, loader, ce(model))


def mixup_in_step():
    model, optimizer, loader = private(cnn(), shuffled(digits()))
    return run_plain(model, optimizer, loader, lambda batch: mixup(batch[0], batch[1], model))


def batch_class_weights():
    model, optimizer, loader = private(cnn(), shuffled(digits()))
    return run_plain(model, optimizer, loader, lambda batch: batch_balanced_ce(model(batch[0]), batch[1]))


def hard_example_mining():
    model, optimizer, loader = private(cnn(), shuffled(digits()))
    return run_plain(model, optimizer, loader, lambda batch: hardest_half_ce(model(batch[0]), batch[1]))


def second_optimizer_head():
    """Only the features are private; the classifier head has its own Adam (passed as other_optimizers)."""
    base = cnn()
    model, optimizer, loader = private(base, shuffled(digits()), params=base.features.parameters())
    head = torch.optim.Adam(base.classifier.parameters(), lr=1e-3)
    return run_plain(model, optimizer, loader, ce(model), other_optimizers=[head],
                     after_step=lambda: (head.step(), head.zero_grad()))


def head_bias_manual_step():
    """The last bias left out of the DP optimizer and updated by hand from its gradient."""
    base = cnn()
    bias = base.classifier[3].bias
    model, optimizer, loader = private(base, shuffled(digits()), params=[p for p in base.parameters() if p is not bias])

    def manual_step():
        with torch.no_grad():
            bias.sub_(LR * bias.grad)
        model.zero_grad()  # else Opacus refuses the next forward: the bias still holds its per-sample gradients

    return run_plain(model, optimizer, loader, ce(model), after_step=manual_step)


def running_mean_buffer():
    model, optimizer, loader = private(cnn_with_input_centering(), shuffled(digits()))
    return run_plain(model, optimizer, loader, ce(model))


def normalizer_in_front_buffer():
    """The same running mean in a preprocessing module put in front of the network: nn.Sequential(centering, cnn)."""
    model, optimizer, loader = private(cnn_behind_input_centering(), shuffled(digits()))
    return run_plain(model, optimizer, loader, ce(model))


def learned_loss_temperature():
    """A temperature learned by the loss module with its own optimizer (passed as other_optimizers)."""
    model, optimizer, loader = private(cnn(), shuffled(digits()))
    criterion = TemperatureCE()
    temperature = torch.optim.Adam(criterion.parameters(), lr=1e-2)
    return run_plain(model, optimizer, loader, lambda batch: criterion(model(batch[0]), batch[1]),
                     other_optimizers=[temperature], after_step=lambda: (temperature.step(), temperature.zero_grad()))


# ---------------------------------------------------------------------------------------------------- Lightning scenarios


def lightning_control():
    _, Digits, PrivateClassifier = lightning_classes()
    return run_lightning(PrivateClassifier(), dp_datamodule(Digits()))


def lightning_no_dp_datamodule():
    """The datamodule not wrapped in DPLightningDataModule: the Trainer's loader stays shuffled."""
    _, Digits, PrivateClassifier = lightning_classes()
    return run_lightning(PrivateClassifier(), Digits())


def lightning_balanced_sampler():
    """Balanced batches from the datamodule's WeightedRandomSampler (not wrapped, to keep the balance)."""
    _, Digits, PrivateClassifier = lightning_classes()

    def balanced(dataset):
        labels = dataset.tensors[1]
        weights = (1.0 / torch.bincount(labels).float())[labels]
        return DataLoader(dataset, batch_size=BATCH, sampler=WeightedRandomSampler(weights, len(dataset)))

    return run_lightning(PrivateClassifier(), Digits(loader=balanced))


def lightning_seed_every_epoch():
    """pl.seed_everything(0) at every epoch start "for reproducibility": the Poisson draws repeat each epoch."""
    pl, Digits, PrivateClassifier = lightning_classes()

    class Reseeded(PrivateClassifier):
        def on_train_epoch_start(self):
            pl.seed_everything(0, verbose=False)

    return run_lightning(Reseeded(), dp_datamodule(Digits()))


def lightning_two_views_in_step():
    """Two shifted views of each image concatenated in training_step."""
    _, Digits, PrivateClassifier = lightning_classes()

    class TwoViews(PrivateClassifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            views = torch.cat([x, torch.roll(x, shifts=1, dims=-1)])
            return self.loss(views, y.repeat(2))

    return run_lightning(TwoViews(), dp_datamodule(Digits()))


def lightning_concat_flipped_tensors():
    """The datamodule's data: ConcatDataset of the digits and TensorDataset(images.flip(-1), labels)."""
    _, Digits, PrivateClassifier = lightning_classes()
    data = digits()
    images, labels = data.tensors
    both = ConcatDataset([data, TensorDataset(images.flip(-1), labels)])
    return run_lightning(PrivateClassifier(), dp_datamodule(Digits(both)))


def lightning_mixup():
    _, Digits, PrivateClassifier = lightning_classes()

    class Mixup(PrivateClassifier):
        def training_step(self, batch, batch_idx):
            return mixup(batch[0], batch[1], self)

    return run_lightning(Mixup(), dp_datamodule(Digits()))


def lightning_contrastive():
    _, Digits, PrivateClassifier = lightning_classes()

    class Contrastive(PrivateClassifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            return F.cross_entropy(logits, y) + 0.5 * supervised_contrastive(logits, y)

    return run_lightning(Contrastive(), dp_datamodule(Digits()))


def lightning_batch_standardize():
    _, Digits, PrivateClassifier = lightning_classes()

    class Standardized(PrivateClassifier):
        model_factory = staticmethod(cnn_with_batch_standardize)

    return run_lightning(Standardized(), dp_datamodule(Digits()))


def lightning_head_optimizer():
    """Manual optimization: DP-SGD for the features, a plain Adam for the classifier head."""
    _, Digits, PrivateClassifier = lightning_classes()

    class TwoOptimizers(PrivateClassifier):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def dp_parameters(self):
            return self.model.features.parameters()

        def configure_optimizers(self):
            return [super().configure_optimizers(), torch.optim.Adam(self.model.classifier.parameters(), lr=1e-3)]

        def training_step(self, batch, batch_idx):
            dp, head = self.optimizers()
            dp.zero_grad()
            head.zero_grad()
            self.manual_backward(self.loss(*batch))
            dp.step()
            head.step()

    return run_lightning(TwoOptimizers(), dp_datamodule(Digits()))


def lightning_running_mean_buffer():
    _, Digits, PrivateClassifier = lightning_classes()

    class Centered(PrivateClassifier):
        model_factory = staticmethod(cnn_with_input_centering)

    return run_lightning(Centered(), dp_datamodule(Digits()))


def lightning_label_prior_buffer():
    """Logit adjustment by a running label prior, a buffer updated in training_step from the batch's labels."""
    _, Digits, PrivateClassifier = lightning_classes()

    class LogitAdjusted(PrivateClassifier):
        def __init__(self):
            super().__init__()
            self.register_buffer("prior", torch.full((10,), 0.1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x) + self.prior.log(), y)
            with torch.no_grad():
                self.prior.mul_(0.99).add_(0.01 * F.one_hot(y, 10).float().mean(0))
            return loss

    return run_lightning(LogitAdjusted(), dp_datamodule(Digits()))


# ---------------------------------------------------------------------------------------------------- the table


@dataclass
class Scenario:
    kind: str  # a run check's code, or "control"
    name: str
    setting: str  # plain / Lightning
    run: Callable[[], Outcome]
    outcome: Optional[Outcome] = None
    seconds: float = math.nan
    error: str = ""


SCENARIOS = [
    Scenario("control", "plain-control", "plain", plain_control),
    Scenario("control", "plain-control-bmm", "plain", plain_control_memory_manager),
    Scenario("control", "lightning-control", "Lightning", lightning_control),
    # sampling
    Scenario("sampling", "never-private-loader", "plain", never_private_loader),
    Scenario("sampling", "loops-over-own-loader", "plain", loops_over_own_loader),
    Scenario("sampling", "loops-own-audits-private", "plain", loops_over_own_loader_audits_private),
    Scenario("sampling", "weighted-sampler", "plain", weighted_sampler),
    Scenario("sampling", "replacement-sampler-after", "plain", replacement_sampler_after),
    Scenario("sampling", "loader-rebuilt-each-epoch", "plain", loader_rebuilt_each_epoch),
    Scenario("sampling", "split-after-private", "plain", split_after_private),
    Scenario("sampling", "no-dp-datamodule", "Lightning", lightning_no_dp_datamodule),
    Scenario("sampling", "balanced-sampler", "Lightning", lightning_balanced_sampler),
    Scenario("sampling", "seed-every-epoch", "Lightning", lightning_seed_every_epoch),
    # multiplicity
    Scenario("multiplicity", "flipped-copies-in-step", "plain", flipped_copies_in_step),
    Scenario("multiplicity", "concat-flipped-dataset", "plain", concat_flipped_dataset),
    Scenario("multiplicity", "oversampled-rare-classes", "plain", oversampled_rare_classes),
    Scenario("multiplicity", "augmented-arrays-stacked", "plain", augmented_arrays_concatenated),
    Scenario("multiplicity", "two-views-in-step", "Lightning", lightning_two_views_in_step),
    Scenario("multiplicity", "concat-flipped-tensors", "Lightning", lightning_concat_flipped_tensors),
    # coupled_examples
    Scenario("coupled_examples", "batch-standardize-layer", "plain", batch_standardize_layer),
    Scenario("coupled_examples", "mixup", "plain", mixup_in_step),
    Scenario("coupled_examples", "batch-class-weights", "plain", batch_class_weights),
    Scenario("coupled_examples", "hard-example-mining", "plain", hard_example_mining),
    Scenario("coupled_examples", "mixup", "Lightning", lightning_mixup),
    Scenario("coupled_examples", "contrastive-loss", "Lightning", lightning_contrastive),
    Scenario("coupled_examples", "batch-standardize-layer", "Lightning", lightning_batch_standardize),
    # outside_dp
    Scenario("outside_dp", "second-optimizer-head", "plain", second_optimizer_head),
    Scenario("outside_dp", "head-bias-manual-step", "plain", head_bias_manual_step),
    Scenario("outside_dp", "running-mean-buffer", "plain", running_mean_buffer),
    Scenario("outside_dp", "normalizer-in-front-buffer", "plain", normalizer_in_front_buffer),
    Scenario("outside_dp", "learned-loss-temperature", "plain", learned_loss_temperature),
    Scenario("outside_dp", "head-optimizer", "Lightning", lightning_head_optimizer),
    Scenario("outside_dp", "running-mean-buffer", "Lightning", lightning_running_mean_buffer),
    Scenario("outside_dp", "label-prior-buffer", "Lightning", lightning_label_prior_buffer),
]


def key(s: Scenario) -> str:
    return f"{s.name}" if s.setting == "plain" else f"lightning/{s.name}"


def run(s: Scenario, steps: int, seed: int) -> None:
    global STEPS, SEED
    STEPS, SEED = steps, seed
    torch.manual_seed(seed)
    np.random.seed(seed)
    start = time.perf_counter()
    try:
        s.outcome = s.run()
    except Exception as error:  # a scenario that cannot run is reported, the others still run
        s.error = f"{type(error).__name__}: {error}"
    s.seconds = time.perf_counter() - start


def row(s: Scenario) -> str:
    if s.outcome is None:
        return f"| {s.kind} | {s.name} | {s.setting} | ERROR | | | {s.error[:MESSAGE_CHARS]} |"
    o = s.outcome
    first = "-" if o.first_step is None else str(o.first_step)
    codes = ", ".join(o.codes) or "-"
    return f"| {s.kind} | {s.name} | {s.setting} | {o.verdict} | {codes} | {first} | {o.message} |"


def flagged(s: Scenario) -> bool:
    return s.outcome is not None and any(c in PIPELINE for c in s.outcome.codes)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--only", default="", help="run only these scenarios (comma-separated names; a Lightning "
                                                   "scenario as lightning/NAME, or NAME for every setting)")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per scenario unless flagged earlier")
    parser.add_argument("--seed", type=int, default=SEED, help="seeds torch, numpy and the audit (default 0)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.list:
        for s in SCENARIOS:
            print(f"{key(s):40s} {s.kind:18s} {s.setting}")
        return
    wanted = {n.strip() for n in args.only.split(",") if n.strip()}
    chosen = [s for s in SCENARIOS if not wanted or key(s) in wanted or s.name in wanted]
    if not chosen:
        parser.error(f"no scenario named {args.only!r} (see --list)")
    started = time.perf_counter()
    for s in chosen:
        run(s, args.steps, args.seed)
        o = s.outcome
        status = s.error or f"{o.verdict} {','.join(o.codes) or '-'} after {o.steps} steps"
        print(f"  {key(s):40s} {s.seconds:6.1f} s  {status}", flush=True)
    print()
    print("| kind | name | setting | verdict | findings | first step | first run-check finding (150 chars) |")
    print("|---|---|---|---|---|---|---|")
    for s in chosen:
        print(row(s))
    mistakes = [s for s in chosen if s.kind != "control"]
    controls = [s for s in chosen if s.kind == "control"]
    quiet = [s for s in controls if s.outcome is not None and s.outcome.verdict == "OK"]
    print()
    print(f"flagged {sum(flagged(s) for s in mistakes)} of {len(mistakes)} mistakes; "
          f"{len(quiet)} of {len(controls)} controls quiet")
    missed = [key(s) for s in mistakes if not flagged(s)]
    if missed:
        print(f"missed: {', '.join(missed)}")
    wrong = [key(s) for s in mistakes if flagged(s) and s.kind not in s.outcome.codes]
    if wrong:
        print(f"flagged under another code than their kind: {', '.join(wrong)}")
    print(f"wall time {time.perf_counter() - started:.0f} s ({args.steps} steps at most per scenario, seed {args.seed})")


if __name__ == "__main__":
    main()
