"""Opacus under Lightning's DDP strategy, audited: the recipe that keeps DP-SGD correct on several processes.

Three things make data-parallel DP-SGD correct, and the audit checks each of them:
1. make_private gets the DDP-wrapped model (`self.trainer.strategy.model`), so Opacus
   returns a DistributedDPOptimizer: noise is added once (on rank 0) and the ranks'
   clipped sums are all-reduced after it, so every replica applies the same update.
2. make_private gets a data loader with a DistributedSampler (one shard per rank), so
   the accountant's sample rate is that of the whole batch, over all ranks.
3. Every rank trains on the Poisson-sampled loader make_private returns, and Lightning
   does not replace its sampler (`use_distributed_sampler=False`).
4. The noise has its own generator, saved in checkpoints: a run resumed under
   seed_everything would otherwise replay the noise of its first steps.

Runs on 2 CPU processes (gloo); Lightning starts the second one itself:

    .venv/bin/python examples/lightning_ddp.py [--steps 200] [--out dpaudit_runs] [--threads 1]
    .venv/bin/tensorboard --logdir dpaudit_runs

--threads N sets torch's intra-op threads in each process before any work (default 1: the
model is small, and the processes share the cores; more threads wait for each other).
"""

import argparse
import os
import warnings

import pytorch_lightning as pl
import torch
from opacus import PrivacyEngine
from pytorch_lightning.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, DistributedSampler, random_split

from lightning_dpaudit import DPAuditCallback
from lightning_dpaudit.datasets import DigitsCNN, digits_dataset


class PrivateClassifier(pl.LightningModule):
    def __init__(self, noise_multiplier: float = 1.0, max_grad_norm: float = 1.0, lr: float = 0.5,
                 batch_size: int = 64, bug: str = None):
        super().__init__()
        self.save_hyperparameters()
        self.model = DigitsCNN()
        self.privacy_engine = PrivacyEngine()
        self.noise_generator = torch.Generator()
        self.noise_generator.seed()  # a fresh seed; its state travels with the checkpoints
        full = digits_dataset()
        self.train_set, _ = random_split(full, [1500, len(full) - 1500], torch.Generator().manual_seed(0))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = torch.nn.functional.cross_entropy(self.model(images), labels)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        shards = DataLoader(self.train_set, batch_size=self.hparams.batch_size, sampler=DistributedSampler(self.train_set))
        _, optimizer, self.private_loader = self.privacy_engine.make_private(
            module=self.trainer.strategy.model,  # the DDP-wrapped model: a DistributedDPOptimizer
            optimizer=optimizer,
            data_loader=shards,  # one shard per rank: the sample rate of the whole batch
            noise_multiplier=self.hparams.noise_multiplier,
            max_grad_norm=self.hparams.max_grad_norm,
            noise_generator=self.noise_generator,
        )
        if self.hparams.bug:  # for the tests: a broken optimizer the audit must catch
            from lightning_dpaudit.testing import inject_bug

            inject_bug(optimizer, self.hparams.bug)
        return optimizer

    def on_save_checkpoint(self, checkpoint):
        checkpoint["noise_generator"] = self.noise_generator.get_state()

    def on_load_checkpoint(self, checkpoint):  # runs before configure_optimizers on resume
        self.noise_generator.set_state(checkpoint["noise_generator"])

    def train_dataloader(self):
        return self.private_loader  # Poisson sampling over this rank's shard (built in configure_optimizers)


def main(steps: int, out: str, bug: str = None, alert: str = "warn", devices: int = 2) -> None:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=devices,
        strategy="ddp",
        use_distributed_sampler=False,  # keep the Poisson sampler make_private built
        logger=TensorBoardLogger(out, name="lightning_ddp"),
        callbacks=[DPAuditCallback(log_every_n_steps=25, alert=alert)],  # the only audit line
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Full backward hook|Secure RNG|does not have many workers).*")
        trainer.fit(PrivateClassifier(bug=bug))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="dpaudit_runs")
    parser.add_argument("--bug", default=None, help="inject a bug-zoo bug (to see the audit catch it)")
    parser.add_argument("--alert", default="warn", choices=["warn", "raise", "stop"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads in each process (default 1: the model is small, and the processes "
                        "share the cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # before any work, in each process
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"torch threads: {torch.get_num_threads()} per process (--threads)")
    main(args.steps, args.out, args.bug, args.alert, args.devices)
