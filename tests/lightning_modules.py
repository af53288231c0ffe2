"""The LightningModule the tests wrap a private model and optimizer in: cross-entropy on (images, labels)."""

from __future__ import annotations

import pytorch_lightning as pl
import torch


class DigitsClassifier(pl.LightningModule):
    def __init__(self, model: torch.nn.Module, optimizer):
        super().__init__()
        self.model, self._optimizer = model, optimizer

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return torch.nn.functional.cross_entropy(self.model(images), labels)

    def configure_optimizers(self):
        return self._optimizer
