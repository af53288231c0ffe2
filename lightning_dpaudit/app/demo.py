"""The demo: a LightningModule on scikit-learn's digits, private with Opacus, audited.

The module follows Opacus's Lightning pattern (a PrivacyEngine on the module, make_private
inside configure_optimizers) in the form that runs on current Lightning: the training
data loader comes from the datamodule, not from Trainer internals.

Progress: on a terminal, Lightning's progress bar; when stdout is not a terminal (a log
file, CI), a few plain lines instead (LineProgressBar: about ten per run), as the bar's
redrawn lines would run to hundreds of KB. Crafted and adversarial input canaries show the
progress of their first build, the seconds before the first step, the same way.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from pathlib import Path
from typing import List, Optional

import pytorch_lightning as pl
import torch
from opacus import PrivacyEngine
from opacus.data_loader import DPDataLoader
from opacus.lightning import DPLightningDataModule
from pytorch_lightning.callbacks import ProgressBar
from torch.utils.data import DataLoader, random_split

from ..integrations.digits import DigitsCNN, digits_dataset
from .limits import MIN_NOISE_MULTIPLIER

TRAIN = 1500  # of the 1,797 digits; the other 297 validate and supply input canaries

# Input canaries in the demo: (canaries per step, optimizer steps), chosen so that each
# kind's demo takes about a minute on a 2-core CPU and ends with a positive lower bound
# (docs/results.md, "Input canaries in the demo"). Gradient canaries keep the auditor's default
# count and DEMO_STEPS.
DEMO_STEPS = 600
INPUT_DEMO = {
    "mislabeled": (32, 800),
    "blank": (16, 800),  # zero inputs: their gradients differ only by the label, so 16 see as much as 32
    "adversarial": (32, 800),
    "crafted": (32, 400),
}


def _split(seed: int):
    full = digits_dataset()
    return random_split(full, [TRAIN, len(full) - TRAIN], torch.Generator().manual_seed(seed))


def held_out_digits(seed: int = 0):
    """(images, labels) of the digits DigitsDataModule(seed=seed) leaves out of training."""
    held_out = _split(seed)[1]
    images, labels = held_out.dataset.tensors
    index = torch.as_tensor(held_out.indices)
    return images[index], labels[index]


def demo_plan(canary: str, steps: Optional[int] = None, canaries_per_step: Optional[int] = None) -> dict:
    """What the demo runs for `canary`: steps, canaries per step and, for input canaries, their source.

    steps / canaries_per_step override the defaults (DEMO_STEPS and the auditor's count
    for gradient canaries, INPUT_DEMO for input canaries).
    """
    from ..engine.canaries.gradient_canaries import KINDS
    from ..engine.canaries.input_canaries import INPUT_KINDS
    from ..engine.options import auto_canaries

    if canary in INPUT_KINDS:
        default_count, default_steps = INPUT_DEMO[canary]
        count = int(canaries_per_step or default_count)
        held_out = len(digits_dataset()) - TRAIN
        return {"steps": int(steps or default_steps), "canaries_per_step": count, "source": f"{held_out} digits held out from training"}
    if canary not in KINDS:
        raise ValueError(f"Unexpected value for `canary`: {canary!r}; valid kinds are {', '.join(KINDS + INPUT_KINDS)}")
    with torch.device("meta"):  # the shapes only: no memory, no draw from the global generator
        parameters = sum(p.numel() for p in DigitsCNN().parameters())
    count = int(canaries_per_step or auto_canaries(canary, parameters, 16))
    return {"steps": int(steps or DEMO_STEPS), "canaries_per_step": count, "source": None}


def demo_max_canaries(canary: str) -> tuple:
    """(the most canaries per step the demo takes for `canary`, why): gradient canaries one coordinate each
    (support coordinates each but dirac) of the demo model's parameters; input canaries MAX_INPUT_CANARIES."""
    import inspect

    from ..engine.auditor import PrivacyAuditor
    from ..engine.canaries.input_canaries import INPUT_KINDS
    from ..engine.options import MAX_INPUT_CANARIES

    if canary in INPUT_KINDS:
        return MAX_INPUT_CANARIES, "each input canary holds a per-example gradient the size of the model"
    with torch.device("meta"):  # the shapes only: no memory, no draw from the global generator
        parameters = sum(p.numel() for p in DigitsCNN().parameters())
    width = 1 if canary == "dirac" else int(inspect.signature(PrivacyAuditor).parameters["support"].default)
    return parameters // width, f"the demo model's {parameters} parameters, {width} per canary"


class LineProgressBar(ProgressBar):
    """Lightning's progress bar as plain lines, for output that is not a terminal: one line every
    `every` optimizer steps (default: a tenth of the run, so about `lines` lines) and one at the end,
    each with the step, the epoch, the progress-bar metrics and the seconds since training started."""

    def __init__(self, every: Optional[int] = None, lines: int = 10):
        super().__init__()
        self.every, self.lines = every, lines
        self._enabled = True
        self._every, self._total, self._start, self._last = 1, None, 0.0, -1

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = time.perf_counter()
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else trainer.estimated_stepping_batches
        self._total = int(total) if math.isfinite(total) else None
        self._every = self.every or max(1, math.ceil((self._total or 100 * self.lines) / self.lines))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step and step % self._every == 0:
            self._line(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._line(trainer, pl_module)

    def _line(self, trainer, pl_module) -> None:
        step = trainer.global_step
        if not self._enabled or step == self._last:
            return
        self._last = step
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        audited = {k: metrics.pop(k) for k in ("eps_low", "eps_acc") if k in metrics}  # the audit's last logged step
        at = metrics.pop("eps_step", None)
        shown = "".join(f", {k} {v:.4g}" if isinstance(v, float) else f", {k} {v}" for k, v in metrics.items())
        if audited and at is not None:  # the epsilons named by the step they were computed at, which may be earlier
            shown += f"; audit at step {int(at)}:" + ",".join(f" {k} {v:.4g}" for k, v in audited.items())
        total = f"/{self._total}" if self._total else ""
        print(f"step {step}{total}, epoch {trainer.current_epoch}{shown} ({time.perf_counter() - self._start:.1f} s)",
              flush=True)


def progress_bar_callbacks(stream=None) -> List[ProgressBar]:
    """The progress bar for a Trainer with enable_progress_bar=True: none added (Lightning's tqdm bar) when
    `stream` (default sys.stdout, where Lightning's bar writes) is a terminal, a LineProgressBar otherwise."""
    stream = sys.stdout if stream is None else stream
    return [] if stream.isatty() else [LineProgressBar()]


class DigitsDataModule(pl.LightningDataModule):
    """scikit-learn's 1,797 digits: 1,500 for training, the rest for validation."""

    def __init__(self, batch_size: int = 256, seed: int = 0):
        super().__init__()
        self.batch_size, self.seed = batch_size, seed

    def setup(self, stage: Optional[str] = None) -> None:
        self.train_set, self.val_set = _split(self.seed)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=256)


class PrivateDigitsModule(pl.LightningModule):
    """DigitsCNN trained with DP-SGD; `bug` swaps in a bug-zoo optimizer for the demo."""

    def __init__(
        self, *, noise_multiplier: float = 3.0, max_grad_norm: float = 1.0, lr: float = 1.0,
        bug: Optional[str] = None, accountant: str = "rdp",
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = DigitsCNN()
        self.privacy_engine = PrivacyEngine(accountant=accountant)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = self.loss(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        self.log("val_acc", (self(images).argmax(-1) == labels).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        data_loader = self.trainer.datamodule.train_dataloader()
        _, optimizer, _ = self.privacy_engine.make_private(
            module=self,
            optimizer=optimizer,
            data_loader=data_loader,
            noise_multiplier=self.hparams.noise_multiplier,
            max_grad_norm=self.hparams.max_grad_norm,
            poisson_sampling=isinstance(data_loader, DPDataLoader),
        )
        if self.hparams.bug:
            from ..integrations.bugs import inject_bug

            inject_bug(optimizer, self.hparams.bug)
        return optimizer


def demo_max_final_model(kind: str) -> Optional[tuple]:
    """(the most final-model canaries the demo takes of `kind`, why), or None when the kind has no bound of its own:
    "mislabeled" and "crafted" canaries are distinct digits held out from training (held_out_digits)."""
    if kind not in ("mislabeled", "crafted"):
        return None
    held_out = len(digits_dataset()) - TRAIN
    return held_out, f"the demo holds {held_out} digits out of training, one per canary"


def run_demo(
    *,
    steps: Optional[int] = None,
    noise_multiplier: float = 3.0,
    canary: str = "dirac",
    canaries_per_step: Optional[int] = None,
    bug: Optional[str] = None,
    audit: bool = True,
    out: str = "dpaudit_runs",
    seed: int = 0,
    progress_bar: bool = True,
    alert="warn",
    log_every_n_steps: int = 20,
    final_model: Optional[int] = None,
    final_model_kind: str = "ood",
):
    """Train the private digits model and audit it; returns (trainer, callback or None).

    steps and canaries_per_step default to demo_plan(canary); input canaries are the
    digits held out from training (held_out_digits). progress_bar: Lightning's progress bar on a
    terminal, a few lines otherwise (progress_bar_callbacks), and the progress of crafting
    input canaries before the first step. final_model: that many final-model
    canaries of `final_model_kind` join the training data, each with probability 1/2
    (the demo fixes their secret seed from `seed`, so that a run can be repeated); it needs the audit.
    """
    from pytorch_lightning.loggers import TensorBoardLogger

    if final_model and not audit:
        raise ValueError(
            f"Unexpected value for `final_model`: {final_model} with audit=False; the final-model canaries are "
            "scored by the audit's callback: pass audit=True or final_model=None"
        )

    from ..integrations.bugs import BUGS
    from ..integrations.callback import DPAuditCallback

    if bug is not None and bug not in BUGS:  # "" too: an empty name is no bug of the zoo
        raise ValueError(f"Unexpected value for `bug`: {bug!r}; use None (no bug) or one of {', '.join(BUGS)}")
    if not (isinstance(noise_multiplier, (int, float)) and MIN_NOISE_MULTIPLIER <= noise_multiplier < math.inf):
        raise ValueError(f"Unexpected value for `noise_multiplier`: {noise_multiplier!r}; use a finite number >= "
                         f"{MIN_NOISE_MULTIPLIER:g} (the audit claims mu = 1 / noise_multiplier, a finite number)")
    plan = demo_plan(canary, steps, canaries_per_step)
    steps = plan["steps"]
    options = {"canaries_per_step": plan["canaries_per_step"]}
    if plan["source"] is not None:
        from ..engine.canaries.input_canaries import InputCanaries

        inputs, labels = held_out_digits(seed)
        canary = InputCanaries(canary, inputs=inputs, labels=labels, progress=progress_bar)
    pl.seed_everything(seed, verbose=False)
    data = DigitsDataModule(seed=seed)
    if final_model:
        from ..engine.final_model import FinalModelCanaries
        from ..integrations.final_model_data import CanaryDataModule

        held_out = held_out_digits(seed) if final_model_kind in ("mislabeled", "crafted") else None
        model = DigitsCNN() if final_model_kind == "crafted" else None
        options["final_model_canaries"] = FinalModelCanaries(
            final_model, final_model_kind, held_out=held_out, num_classes=10, model=model, seed=seed + 7919,
        )
        data = CanaryDataModule(data, options["final_model_canaries"])
    datamodule = DPLightningDataModule(data, generator=torch.Generator().manual_seed(seed))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")  # from the PrivacyEngine, as in fit
        module = PrivateDigitsModule(noise_multiplier=noise_multiplier, bug=bug)
    callback = (
        DPAuditCallback(alert=alert, canary=canary, seed=seed, log_every_n_steps=log_every_n_steps, **options)
        if audit else None
    )
    logger = TensorBoardLogger(str(Path(out)), name="demo")
    callbacks = ([callback] if callback else []) + (progress_bar_callbacks() if progress_bar else [])
    trainer = pl.Trainer(
        max_steps=steps,
        logger=logger,
        callbacks=callbacks,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=progress_bar,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=log_every_n_steps,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=10,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Full backward hook.*")
        warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(module, datamodule=datamodule)
    return trainer, callback
