"""Opacus's Lightning pattern on current Lightning, audited by one added callback.

A PrivacyEngine lives on the LightningModule and make_private runs inside
configure_optimizers, with the training data loader taken from the datamodule (public
API; the older pattern read Trainer internals that current Lightning no longer has).
DPLightningDataModule turns the datamodule's loader into Poisson sampling.

    .venv/bin/python examples/lightning_opacus.py [--steps 600] [--out dpaudit_runs] [--threads 1]
    .venv/bin/tensorboard --logdir dpaudit_runs

--threads N sets torch's intra-op threads before any work (default 1: the model is small,
so more threads add overhead, and on cores shared with other work they wait for each other).
When stdout is not a terminal, progress is a few lines (progress_bar_callbacks) rather than
Lightning's redrawn bar.
"""

import argparse

import pytorch_lightning as pl
import torch
from opacus import PrivacyEngine
from opacus.data_loader import DPDataLoader
from opacus.lightning import DPLightningDataModule
from pytorch_lightning.loggers import TensorBoardLogger

from lightning_dpaudit import DPAuditCallback
from lightning_dpaudit.app.demo import DigitsDataModule, progress_bar_callbacks
from lightning_dpaudit.datasets import DigitsCNN


class PrivateClassifier(pl.LightningModule):
    def __init__(self, noise_multiplier: float = 1.0, max_grad_norm: float = 1.0, lr: float = 0.5):
        super().__init__()
        self.save_hyperparameters()
        self.model = DigitsCNN()
        self.privacy_engine = PrivacyEngine()

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = torch.nn.functional.cross_entropy(self.model(images), labels)
        self.log("train_loss", loss)
        return loss

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
        return optimizer


def main(steps: int, out: str) -> None:
    trainer = pl.Trainer(
        max_steps=steps,
        logger=TensorBoardLogger(out, name="lightning_opacus"),
        callbacks=[
            DPAuditCallback(log_every_n_steps=25),  # the only added line
            *progress_bar_callbacks(),  # when stdout is not a terminal: a few lines of progress, not the bar
        ],
        enable_checkpointing=False,
        accelerator="cpu",
    )
    trainer.fit(PrivateClassifier(), datamodule=DPLightningDataModule(DigitsDataModule()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", default="dpaudit_runs")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: the model is small, more threads only add overhead)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # before any work
    print(f"torch threads: {torch.get_num_threads()} (--threads)")
    main(args.steps, args.out)
