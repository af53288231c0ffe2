"""The user's LightningDataModule with final-model canaries added to its training data."""

from __future__ import annotations

import pytorch_lightning as pl
from pytorch_lightning.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader, IterableDataset

from ..engine.final_model import FinalModelCanaries

_DELEGATED = ("val_dataloader", "test_dataloader", "predict_dataloader", "transfer_batch_to_device",
              "on_before_batch_transfer", "on_after_batch_transfer")


class CanaryDataModule(pl.LightningDataModule):
    """`datamodule` whose train_dataloader reads canaries.wrap(its dataset), shuffled.

    The loader keeps the original's batch size, workers, collate_fn, drop_last,
    pin_memory, worker_init_fn, persistent_workers and generator; shuffle=True, which
    Opacus's make_private(poisson_sampling=True) replaces by Poisson sampling at rate
    1 / len(loader) = 1 / ceil((n + included) / batch_size), so its accountant sees the
    data trained on. The other loaders, hooks and state are the original's (only those
    it defines). Building the loader fixes the canaries' inclusion: restore the audit's
    state first (Lightning restores callbacks before it asks for the training loader).
    """

    def __init__(self, datamodule: pl.LightningDataModule, canaries: FinalModelCanaries):
        super().__init__()
        if not isinstance(datamodule, pl.LightningDataModule):
            raise ValueError(
                f"Unexpected value for `datamodule`: {type(datamodule).__name__}; pass the LightningDataModule whose "
                "training data the canaries join"
            )
        if not isinstance(canaries, FinalModelCanaries):
            raise ValueError(f"Unexpected value for `canaries`: {type(canaries).__name__}; pass a FinalModelCanaries")
        self.datamodule, self.canaries = datamodule, canaries
        for name in _DELEGATED:
            if is_overridden(name, datamodule, pl.LightningDataModule):
                setattr(self, name, getattr(datamodule, name))

    def prepare_data(self) -> None:
        self.datamodule.prepare_data()

    def setup(self, stage: str) -> None:
        self.datamodule.trainer = self.trainer
        self.datamodule.setup(stage)

    def teardown(self, stage: str) -> None:
        self.datamodule.teardown(stage)

    def state_dict(self) -> dict:
        return self.datamodule.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.datamodule.load_state_dict(state_dict)

    def train_dataloader(self) -> DataLoader:
        loader = self.datamodule.train_dataloader()
        if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset) or loader.batch_size is None:
            raise ValueError(
                f"the datamodule's train_dataloader returned {type(loader).__name__}; CanaryDataModule needs one "
                "DataLoader over a map-style dataset with a batch_size (no batch_sampler)"
            )
        return DataLoader(
            self.canaries.wrap(loader.dataset), batch_size=loader.batch_size, shuffle=True,
            num_workers=loader.num_workers, collate_fn=loader.collate_fn, drop_last=loader.drop_last,
            pin_memory=loader.pin_memory, worker_init_fn=loader.worker_init_fn,
            persistent_workers=loader.persistent_workers, generator=loader.generator,
        )
