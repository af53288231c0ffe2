"""Opacus FSDP (FSDP2 + ghost clipping) under Lightning's ModelParallelStrategy, audited by one callback.

The recipe:
1. ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) runs FSDP2 on CPU
   processes (gloo); the sharding happens in `configure_model`, where Opacus's FSDP2Wrapper
   calls fully_shard on each layer and on the model.
2. `configure_optimizers` calls make_private on the sharded model with
   grad_sample_mode="ghost_fsdp": an FSDPOptimizerFastGradientClipping and a criterion
   whose loss is not a torch.Tensor, so the module optimizes manually (forward,
   criterion, manual_backward, step), as in examples/transformer_ghost.py.
3. make_private gets a data loader with a DistributedSampler (one shard per rank), so the
   accountant's sample rate is that of the whole batch; every rank trains on the
   Poisson-sampled loader make_private returns, and Lightning keeps its sampler
   (`use_distributed_sampler=False`).
4. The noise has its own generator, seeded from the OS in each process: every rank draws
   noise the shape of each whole tensor and adds the rows of it that it owns.

Runs on 2 CPU processes; Lightning starts the second one itself:

    .venv/bin/python examples/lightning_fsdp.py [--steps 200] [--out dpaudit_runs] [--threads 1]

--threads N sets torch's intra-op threads in each process before any work (default 1: the
model is small, and the processes share the cores; more threads wait for each other).
"""

import argparse
import os
import sys
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from opacus import PrivacyEngine
from opacus.utils.fsdp_utils import FSDP2Wrapper
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_torchrun import TokenClassifier, token_data  # noqa: E402

from lightning_dpaudit import DPAuditCallback  # noqa: E402


class ShardedPrivateClassifier(pl.LightningModule):
    def __init__(self, noise_multiplier: float = 1.0, max_grad_norm: float = 1.0, lr: float = 0.5,
                 batch_size: int = 32, bug: str = None):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False  # the ghost-clipping loss is not a tensor
        torch.manual_seed(0)  # the same initial model on every rank, before sharding
        self.model = TokenClassifier()
        self.privacy_engine = PrivacyEngine()
        self.noise_generator = torch.Generator()
        self.noise_generator.seed()  # a fresh seed, not the one the model's weights came from
        self.train_set = token_data()

    def configure_model(self):
        FSDP2Wrapper(self.model)  # shards self.model in place (its parameters become DTensors)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.model.parameters(), lr=self.hparams.lr)
        shards = DataLoader(self.train_set, batch_size=self.hparams.batch_size,
                            sampler=DistributedSampler(self.train_set, seed=0))
        _, optimizer, self.criterion, self.private_loader = self.privacy_engine.make_private(
            module=self.model,  # hooked in place: training_step calls self.model
            optimizer=optimizer,
            data_loader=shards,
            criterion=nn.CrossEntropyLoss(),
            noise_multiplier=self.hparams.noise_multiplier,
            max_grad_norm=self.hparams.max_grad_norm,
            grad_sample_mode="ghost_fsdp",
            noise_generator=self.noise_generator,
        )
        if self.hparams.bug:  # for the tests: a broken optimizer the audit must catch
            from lightning_dpaudit.testing import inject_bug

            inject_bug(optimizer, self.hparams.bug, module=self.model)
        return optimizer

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = self.criterion(self.model(tokens), labels)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)  # norms, then the clipped sum in this rank's shards
        optimizer.step()  # noise on this rank's rows, then the update
        self.log("train_loss", loss.detach(), sync_dist=True)

    def train_dataloader(self):
        return self.private_loader  # built in configure_optimizers


def main(steps: int, out: str, bug: str = None, alert: str = "warn") -> None:
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        use_distributed_sampler=False,  # keep the Poisson sampler make_private built
        logger=TensorBoardLogger(out, name="lightning_fsdp"),
        callbacks=[DPAuditCallback(log_every_n_steps=10, alert=alert)],  # the only audit line
        log_every_n_steps=10,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    module = ShardedPrivateClassifier(bug=bug)
    with warnings.catch_warnings():
        # FSDP2 warns of outputs that are views, in case an in-place op follows; this module makes none
        warnings.filterwarnings("ignore", message=".*(Full backward hook|Secure RNG|returned a view tensor).*")
        trainer.fit(module)
    if trainer.global_rank == 0:
        params = list(module.model.parameters())
        print(f"sharded: rank 0 holds {sum(p.to_local().numel() for p in params):,} of "
              f"{sum(p.numel() for p in params):,} parameters ({type(trainer.optimizers[0]).__name__})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="dpaudit_runs")
    parser.add_argument("--bug", default=None, help="inject a bug-zoo bug (to see the audit catch it)")
    parser.add_argument("--alert", default="warn", choices=["warn", "raise", "stop"])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads in each process (default 1: the model is small, and the processes "
                        "share the cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # before any work, in each process
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"torch threads: {torch.get_num_threads()} per process (--threads)")
    main(args.steps, args.out, args.bug, args.alert)
