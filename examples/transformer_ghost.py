"""A transformer language model trained with Opacus ghost clipping under Lightning, audited by one callback.

Ghost clipping's criterion (returned by make_private with grad_sample_mode="ghost") gives a
DPTensorFastGradientClipping, not a torch.Tensor: its backward() runs two backward passes,
one for the per-sample gradient norms and one for the clipped gradient. Lightning's
automatic optimization refuses it as training_step's output, so the module optimizes
manually: forward, criterion(..., shape=(batch, length)), manual_backward, step.
make_private runs in configure_optimizers on the inner transformer, which Opacus hooks in
place; the data is a seeded random Markov chain over tokens (examples/_transformer.py).

    .venv/bin/python examples/transformer_ghost.py [--steps 20] [--size 25M] [--batch-size 16]
        [--seq-len 64] [--noise-multiplier 1.0] [--seed 0] [--log-dir dpaudit_runs] [--threads 1]

--threads N sets torch's intra-op threads before any work (default 1: on a CPU that other
work shares, threads wait for each other; on cores of its own a larger model may gain from
more). When stdout is not a terminal, progress is a few lines (progress_bar_callbacks)
rather than Lightning's redrawn bar.
"""

import argparse
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from opacus import PrivacyEngine
from opacus.data_loader import DPDataLoader
from opacus.lightning import DPLightningDataModule
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _transformer import SIZES, build_model, count_parameters, markov_tokens  # noqa: E402

from lightning_dpaudit import DPAuditCallback  # noqa: E402
from lightning_dpaudit.app.demo import progress_bar_callbacks  # noqa: E402


class MarkovText(pl.LightningDataModule):
    """`batch_size * 64` sequences of a seeded Markov chain, in batches of `batch_size` (sample rate 1/64)."""

    def __init__(self, vocab: int, seq_len: int, batch_size: int, seed: int = 0):
        super().__init__()
        self.vocab, self.seq_len, self.batch_size, self.seed = vocab, seq_len, batch_size, seed

    def setup(self, stage=None):
        self.tokens = markov_tokens(self.vocab, 64 * self.batch_size, self.seq_len, seed=self.seed)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(self.seed)  # DPLightningDataModule's Poisson sampling uses it
        return DataLoader(TensorDataset(self.tokens), batch_size=self.batch_size, shuffle=True, generator=generator)


class GhostClippedLM(pl.LightningModule):
    """Next-token prediction with ghost clipping: manual optimization, make_private in configure_optimizers."""

    def __init__(self, size: str = "25M", seq_len: int = 64, noise_multiplier: float = 1.0,
                 max_grad_norm: float = 1.0, lr: float = 1e-3, seed: int = 0):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False  # the ghost-clipping loss is not a tensor
        self.model = build_model(size, seq_len, seed)
        self.privacy_engine = PrivacyEngine()
        self.losses = []

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        batch_size, length, vocab = logits.shape
        # one loss per sequence (the privacy unit), the mean over its positions
        loss = self.criterion(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1), shape=(batch_size, length))
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)  # loss.backward(): norms, then clipped gradients in p.grad
        optimizer.step()  # noise and the update
        self.losses.append(loss.item())
        self.log("train_loss", loss.detach(), prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.model.parameters(), lr=self.hparams.lr)
        data_loader = self.trainer.datamodule.train_dataloader()
        _, optimizer, self.criterion, _ = self.privacy_engine.make_private(
            module=self.model,
            optimizer=optimizer,
            data_loader=data_loader,
            criterion=nn.CrossEntropyLoss(),
            noise_multiplier=self.hparams.noise_multiplier,
            max_grad_norm=self.hparams.max_grad_norm,
            poisson_sampling=isinstance(data_loader, DPDataLoader),
            grad_sample_mode="ghost",
            noise_generator=torch.Generator().manual_seed(self.hparams.seed),
        )
        return optimizer


def train(size: str = "25M", steps: int = 20, batch_size: int = 16, seq_len: int = 64, noise_multiplier: float = 1.0,
          seed: int = 0, log_dir: str = "dpaudit_runs", lr: float = 1e-3, audit: bool = True, log_every_n_steps: int = 5,
          progress_bar: bool = True):
    """Fit `steps` steps; the LightningModule (its `losses`, one per step) and the callback (None if not audited)."""
    torch.manual_seed(seed)
    callback = DPAuditCallback(log_every_n_steps=log_every_n_steps, seed=seed) if audit else None
    progress = progress_bar_callbacks() if progress_bar else []  # stdout not a terminal: a few lines, not the bar
    trainer = pl.Trainer(
        max_steps=steps,
        logger=TensorBoardLogger(log_dir, name="transformer_ghost"),
        callbacks=([callback] if audit else []) + progress,  # the only line the audit adds
        enable_checkpointing=False,
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
        accelerator="cpu",
    )
    module = GhostClippedLM(size, seq_len, noise_multiplier=noise_multiplier, lr=lr, seed=seed)
    data = MarkovText(SIZES[size][0], seq_len, batch_size, seed=seed)
    trainer.fit(module, datamodule=DPLightningDataModule(data))
    return module, callback


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", default="25M", choices=list(SIZES))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default="dpaudit_runs")
    parser.add_argument("--no-audit", action="store_true", help="train without DPAuditCallback")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: threads on a CPU that other work shares wait for "
                        "each other; on cores of its own a larger model may gain from more)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)  # before any work
    print(f"torch threads: {torch.get_num_threads()} (--threads)")
    start = time.perf_counter()
    module, callback = train(args.size, args.steps, args.batch_size, args.seq_len, args.noise_multiplier, args.seed,
                             args.log_dir, args.lr, audit=not args.no_audit)
    seconds = time.perf_counter() - start
    print(f"parameters: {count_parameters(module.model):,} ({args.size}); {len(module.losses)} steps in {seconds:.1f} s; "
          f"loss {module.losses[0]:.3f} -> {module.losses[-1]:.3f}")
    if callback is not None:
        result = callback.auditor.result()
        print(f"audit: empirical epsilon >= {result.epsilon_lower_bound:.2f}, accountant epsilon "
              f"{result.epsilon_accountant:.2f} (delta {result.delta:g}); violation: {result.violation}")


if __name__ == "__main__":
    main()
