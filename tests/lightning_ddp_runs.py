"""Lightning DDP runs (2 CPU processes, gloo) of examples/lightning_ddp.py's module, for test_distributed_lightning.py.

    python tests/lightning_ddp_runs.py VARIANT OUT [--steps N] [--alert A] [--bug NAME] [--resume CKPT] [--final-model M]

VARIANT "recipe" is the example's module; "unwrapped" gives make_private the bare
LightningModule and the unsharded loader, the common mistake (a plain DPOptimizer);
"unsharded" gives it the wrapped model but a loader without a DistributedSampler while
Lightning shards the training data (the accountant's sample rate is one rank's).
--final-model M adds M final-model canaries (seed from each process's OS) to the recipe's data.
"""

import argparse
import sys
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from lightning_ddp import PrivateClassifier  # noqa: E402

from lightning_dpaudit import DPAuditCallback  # noqa: E402


class Unwrapped(PrivateClassifier):
    """make_private(module=self) with a loader that is not sharded: what many first write."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        _, optimizer, self.private_loader = self.privacy_engine.make_private(
            module=self, optimizer=optimizer, data_loader=DataLoader(self.train_set, batch_size=self.hparams.batch_size),
            noise_multiplier=self.hparams.noise_multiplier, max_grad_norm=self.hparams.max_grad_norm,
        )
        return optimizer


class Unsharded(PrivateClassifier):
    """The DDP-wrapped model, but make_private sees a loader over the whole dataset."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        _, optimizer, _ = self.privacy_engine.make_private(
            module=self.trainer.strategy.model, optimizer=optimizer,
            data_loader=DataLoader(self.train_set, batch_size=self.hparams.batch_size),
            noise_multiplier=self.hparams.noise_multiplier, max_grad_norm=self.hparams.max_grad_norm,
        )
        return optimizer

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, sampler=DistributedSampler(self.train_set))


class Scored(PrivateClassifier):
    """The recipe with a forward, through which the final-model canaries are scored."""

    def forward(self, x):
        return self.model(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("variant", choices=["recipe", "unwrapped", "unsharded"])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--alert", default="warn")
    parser.add_argument("--bug", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--final-model", type=int, default=None)
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    module = {"recipe": PrivateClassifier, "unwrapped": Unwrapped, "unsharded": Unsharded}[args.variant](bug=args.bug)
    canaries = None
    if args.final_model:
        from lightning_dpaudit.engine.final_model import FinalModelCanaries

        module, canaries = Scored(bug=args.bug), FinalModelCanaries(args.final_model, "ood", num_classes=10)
        module.train_set = canaries.wrap(module.train_set)  # first read by configure_optimizers' sampler
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=2, strategy="ddp", use_distributed_sampler=False,
        logger=CSVLogger(args.out, name="run"), enable_progress_bar=False, enable_model_summary=False,
        callbacks=[DPAuditCallback(alert=args.alert, log_every_n_steps=10, seed=5, final_model_canaries=canaries),
                   ModelCheckpoint(dirpath=Path(args.out) / "checkpoints", save_last=True)],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Full backward hook|Secure RNG|does not have many workers).*")
        trainer.fit(module, ckpt_path=args.resume)
    print(f"rank {trainer.global_rank} finished at step {trainer.global_step}")
    if canaries is not None:
        final = trainer.callbacks[0].final_model.result
        print(f"rank {trainer.global_rank} canaries {canaries.included.astype(int).tolist()} "
              f"trained on {len(module.train_set)} final-model bound {final.epsilon_lower_bound!r}")


if __name__ == "__main__":
    main()
