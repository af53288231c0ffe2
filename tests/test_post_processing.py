"""Tensors outside the DP optimizer: post-processing of the DP iterates is quiet, training on the data is not.

A tensor of the module that the DP optimizer does not hold and that changes is an alarm only with evidence
that a gradient of the data trained it (a gradient reached it while the audit watched). An average of the DP
iterates (EMA or SWA), or a copy made for evaluation, changes with no gradient ever reaching it: a note.
"""

from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
from opacus import PrivacyEngine
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Subset

from lightning_dpaudit import DPAuditCallback, PrivacyAuditor
from lightning_dpaudit.datasets import make_private_digits
from lightning_dpaudit.integrations.digits import DigitsCNN, digits_dataset

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")
CE = nn.CrossEntropyLoss()
EIGHT = "8 tensor(s) outside the DP optimizer changed without receiving a gradient"


def _codes(result):
    return [(f.code, f.first_step) for f in result.findings]


def _outside_notes(result):
    return [n for n in result.notes if n.startswith("outside_dp: ")]


def _run(update, steps=4, *, shadow_loss=False, separate=None):
    """A plain loop over the private digits with a shadow copy of the model (`shadow`, requires_grad kept) beside it.

    update(model, shadow)   after each DP step (the EMA, the copy, or a manual step)
    shadow_loss             the step's loss also runs the shadow on the private batch (a gradient reaches it)
    separate(x, y, shadow)  a second backward pass of the shadow alone, after the DP step
    """
    model, optimizer, loader, _ = make_private_digits(seed=0)
    shadow = DigitsCNN()  # a deep copy would carry Opacus's hooks on the model's layers
    shadow.load_state_dict(model._module.state_dict())
    auditor = PrivacyAuditor(optimizer, module=nn.ModuleDict({"model": model, "shadow": shadow}), data_loader=loader,
                             seed=1)
    done = 0
    while done < steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss = CE(model(x), y) + (CE(shadow(x), y) if shadow_loss else 0)
            loss.backward()
            optimizer.step()
            if separate is not None:
                separate(x, y, shadow)
            update(model._module, shadow)
            done += 1
            if done >= steps:
                break
    return auditor, shadow


def _lerp(model, shadow):
    with torch.no_grad():
        for e, p in zip(shadow.parameters(), model.parameters()):
            e.lerp_(p, 0.01)


def _timm(model, shadow, decay=0.99):
    with torch.no_grad():
        for e, p in zip(shadow.parameters(), model.parameters()):
            e.mul_(decay).add_(p, alpha=1 - decay)


def _load_state_dict(model, shadow):
    shadow.load_state_dict(model.state_dict())


def _copy(model, shadow):
    with torch.no_grad():
        for e, p in zip(shadow.parameters(), model.parameters()):
            e.copy_(p)


@pytest.mark.parametrize("update", [_lerp, _timm, _load_state_dict, _copy], ids=["lerp", "timm", "load_state_dict",
                                                                                 "copy_"])
def test_a_shadow_computed_from_the_dp_parameters_alone_is_quiet_with_a_note(update):
    auditor, _ = _run(update)
    result = auditor.result()
    assert not result.violation, _codes(result)
    assert _outside_notes(result) == [
        f"outside_dp: {EIGHT} (`shadow.classifier.1.bias`, `shadow.classifier.1.weight`, `shadow.classifier.3.bias`, "
        "`shadow.classifier.3.weight` and 4 more): post-processing such as an average of the DP iterates (EMA), not "
        "trained on the data's gradients"]
    assert "8 watched, 2 comparisons" in result.pipeline


def test_an_averaged_model_ema_in_a_plain_loop_is_quiet_with_a_note():
    model, optimizer, loader, _ = make_private_digits(seed=0)
    ema = AveragedModel(model._module, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    assert all(p.requires_grad for p in ema.parameters())  # the copy keeps requires_grad=True
    auditor = PrivacyAuditor(optimizer, module=nn.ModuleDict({"model": model, "ema": ema}), data_loader=loader, seed=1)
    done = 0
    for x, y in loader:
        optimizer.zero_grad()
        CE(model(x), y).backward()
        optimizer.step()
        ema.update_parameters(model._module)
        done += 1
        if done == 4:
            break
    result = auditor.result()
    assert not result.violation, _codes(result)
    assert len(_outside_notes(result)) == 1 and f"outside_dp: {EIGHT} (`ema.module." in _outside_notes(result)[0]


def test_a_shadow_trained_by_a_plain_optimizer_on_the_private_batch_is_outside_dp():
    holder = {}

    def sgd(model, shadow):
        if "sgd" not in holder:
            holder["sgd"] = torch.optim.SGD(shadow.parameters(), lr=0.1)  # not given as other_optimizers
        holder["sgd"].step()
        holder["sgd"].zero_grad()

    auditor, _ = _run(sgd, shadow_loss=True)
    result = auditor.result()
    assert _codes(result) == [("outside_dp", 2)]
    assert ("`shadow.features.0.weight`, `shadow.features.0.bias`, `shadow.features.2.weight`, `shadow.features.2.bias` "
            "and 4 more changed by step 2 and received gradients") in result.findings[0].message
    assert not _outside_notes(result)


def test_a_shadow_trained_in_its_own_backward_pass_after_the_dp_step_is_outside_dp():
    """Its gradients are set to None before the DP optimizer's next step: the hooks saw them arrive."""
    sgd = {}

    def own_pass(x, y, shadow):
        sgd.setdefault("opt", torch.optim.SGD(shadow.parameters(), lr=0.1))
        CE(shadow(x), y).backward()
        sgd["opt"].step()
        sgd["opt"].zero_grad(set_to_none=True)

    auditor, shadow = _run(lambda model, shadow: None, separate=own_pass)
    assert all(p.grad is None for p in shadow.parameters())
    assert _codes(auditor.result()) == [("outside_dp", 2)]


def test_a_manual_update_from_the_gradient_that_reaches_a_copy_is_outside_dp():
    def manual(model, shadow):
        for p in shadow.parameters():
            p.data -= 0.1 * p.grad

    auditor, _ = _run(manual, shadow_loss=True)
    result = auditor.result()
    assert _codes(result) == [("outside_dp", 2)] and "received gradients" in result.findings[0].message


def test_the_gradient_hooks_are_removed_at_detach():
    auditor, shadow = _run(_lerp, steps=2)
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in shadow.parameters())
    auditor.detach()
    assert not any(p._post_accumulate_grad_hooks for p in shadow.parameters())


# ------------------------------------------------------------------ Lightning


class Digits(pl.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(Subset(digits_dataset(), range(512)), batch_size=64, shuffle=True,
                          generator=torch.Generator().manual_seed(0))


class WithEMA(pl.LightningModule):
    """The DP model and an EMA of it (AveragedModel, updated after every batch, its copy requiring grad)."""

    def __init__(self):
        super().__init__()
        self.model = DigitsCNN()
        self.ema = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
        self.privacy_engine = PrivacyEngine()

    def training_step(self, batch, batch_idx):
        return CE(self.model(batch[0]), batch[1])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.ema.update_parameters(self.model)

    def configure_optimizers(self):
        loader = self.trainer.datamodule.train_dataloader()
        _, optimizer, _ = self.privacy_engine.make_private(
            module=self, optimizer=torch.optim.SGD(self.model.parameters(), lr=0.2), data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0, noise_generator=torch.Generator().manual_seed(7),
        )
        return optimizer


def test_lightning_an_ema_updated_after_each_batch_is_quiet_with_a_note(tmp_path):
    from opacus.lightning import DPLightningDataModule

    pl.seed_everything(0, verbose=False)
    seen = []
    callback = DPAuditCallback(alert=seen.append, seed=0, report=False)
    trainer = pl.Trainer(max_steps=4, callbacks=[callback], logger=False, default_root_dir=tmp_path,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         accelerator="cpu")
    trainer.fit(WithEMA(), datamodule=DPLightningDataModule(Digits()))
    result = callback.auditor.result()
    assert not seen and not result.violation, _codes(result)
    assert len(_outside_notes(result)) == 1 and f"outside_dp: {EIGHT} (`ema.module." in _outside_notes(result)[0]
