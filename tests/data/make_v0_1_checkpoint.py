"""Write tests/data/v0_1_checkpoint.ckpt: a Lightning checkpoint of an audited run, as version 0.1.0 saved it.

Run once at version 0.1.0 (the flat package layout, before the step pipeline); the file is
committed so that tests/test_old_checkpoint.py shows that later versions still resume it.
A linear model on 512 digits, batch 64, 16 steps with DPAuditCallback's defaults.

    .venv/bin/python tests/data/make_v0_1_checkpoint.py
"""

import json
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, Subset

from lightning_dpaudit import DPAuditCallback
from lightning_dpaudit.integrations.digits import digits_dataset

HERE = Path(__file__).parent


class Digits(pl.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(Subset(digits_dataset(), range(512)), batch_size=64, shuffle=True)


class Linear(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
        self.privacy_engine = PrivacyEngine()

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return torch.nn.functional.cross_entropy(self.model(images), labels)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
        _, optimizer, _ = self.privacy_engine.make_private(
            module=self, optimizer=optimizer, data_loader=self.trainer.datamodule.train_dataloader(),
            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
        )
        return optimizer


def main():
    warnings.filterwarnings("ignore")
    pl.seed_everything(0)
    callback = DPAuditCallback(seed=0)
    trainer = pl.Trainer(
        max_epochs=2, callbacks=[callback], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
    )
    trainer.fit(Linear(), datamodule=Digits())
    trainer.save_checkpoint(HERE / "v0_1_checkpoint.ckpt")
    r = callback.auditor.result()
    summary = {"steps": r.steps, "n_in": r.n_in, "n_out": r.n_out, "mu_lower_bound": r.mu_lower_bound,
               "epsilon_accountant": r.epsilon_accountant, "state_key": callback.state_key}
    (HERE / "v0_1_checkpoint.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(summary)


if __name__ == "__main__":
    main()
