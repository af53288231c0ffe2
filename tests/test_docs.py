"""Every Python example in README.md and docs/ runs: each ```python block is executed, in a fresh
namespace holding what the surrounding text assumes (a model and optimizer made private with
Opacus, held-out digits, a small data module), in a temporary working directory."""

import re
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks():
    for page in PAGES:
        for i, match in enumerate(BLOCK.finditer(page.read_text())):
            yield pytest.param(match.group(1), id=f"{page.relative_to(ROOT)}#{i + 1}")


def _namespace():
    """The names the examples take from their context."""
    import numpy as np
    import pytorch_lightning as pl
    from opacus import PrivacyEngine
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, DistributedSampler, Subset

    from lightning_dpaudit import DPAuditCallback, PrivacyAuditor
    from lightning_dpaudit.integrations.digits import DigitsCNN, digits_dataset, digits_holdout, make_private_digits

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(Subset(digits_dataset(), range(512)), batch_size=64, shuffle=True)

    model, optimizer, loader, _ = make_private_digits(seed=0, holdout=64)
    held_out_x, held_out_y = digits_holdout(64)
    return {
        "np": np, "pl": pl, "torch": torch, "PrivacyEngine": PrivacyEngine, "ModelCheckpoint": ModelCheckpoint,
        "DataLoader": DataLoader, "DistributedSampler": DistributedSampler, "DPAuditCallback": DPAuditCallback,
        "PrivacyAuditor": PrivacyAuditor, "DigitsCNN": DigitsCNN, "model": model, "optimizer": optimizer,
        "loader": loader, "held_out_x": held_out_x, "held_out_y": held_out_y, "data": Data(),
    }


def test_the_pages_have_examples():
    assert len(list(_blocks())) >= 8


@pytest.mark.parametrize("code", list(_blocks()))
def test_example_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(compile(code, "<example>", "exec"), _namespace())
    finally:
        torch.set_num_threads(threads)
