"""Resuming a DP run under Lightning: the noise generator has to come back with the checkpoint.

Opacus draws each step's noise from the optimizer's generator: torch's global generator
unless make_private gets a noise_generator. Lightning checkpoints hold neither. A run
resumed the usual way (pl.seed_everything(0), the same set-up, trainer.fit(...,
ckpt_path=...)) re-seeds the generator, so after the resume it replays, step for step,
the noise of the first run's first steps, 320 steps back here. The audit's noise
fingerprints travel in the callback's checkpoint state and catch the replay at the first
resumed step. A small linear model keeps the 320 steps fast; every run is seeded.
"""

import warnings

import pytest
import pytorch_lightning as pl
import torch
from opacus.data_loader import DPDataLoader
from opacus import PrivacyEngine
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Subset

from lightning_dpaudit import DPAuditCallback
from lightning_dpaudit.integrations.digits import digits_dataset

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"), pytest.mark.usefixtures("one_thread")]


TRAIN, BATCH = 512, 64  # 8 steps per epoch
FIRST_EPOCHS, RESUMED_EPOCHS = 40, 2  # 320 steps, then the resume trains 16 more
STEPS_BEFORE = FIRST_EPOCHS * TRAIN // BATCH
STEPS_AFTER = RESUMED_EPOCHS * TRAIN // BATCH


class Digits(pl.LightningDataModule):
    def train_dataloader(self):  # Poisson sampling from torch's global generator
        return DPDataLoader.from_data_loader(DataLoader(Subset(digits_dataset(), range(TRAIN)), batch_size=BATCH))


class GlobalNoise(pl.LightningModule):
    """Opacus's Lightning pattern as usually written: make_private without a noise_generator."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
        self.privacy_engine = PrivacyEngine()

    def noise_generator(self):
        return None  # Opacus then draws the noise from torch's global generator

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return torch.nn.functional.cross_entropy(self.model(images), labels)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
        _, optimizer, _ = self.privacy_engine.make_private(
            module=self, optimizer=optimizer, data_loader=self.trainer.datamodule.train_dataloader(),
            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, noise_generator=self.noise_generator(),
        )
        return optimizer


class SeededNoise(GlobalNoise):
    """The noise from a generator of the module's own, seeded when the module is built."""

    def __init__(self):
        super().__init__()
        self.noise = torch.Generator().manual_seed(7)

    def noise_generator(self):
        return self.noise


class CheckpointedNoise(SeededNoise):
    """The working pattern: the generator's state is saved in and restored from the checkpoint."""

    def on_save_checkpoint(self, checkpoint):
        checkpoint["noise_generator"] = self.noise.get_state()

    def on_load_checkpoint(self, checkpoint):
        self.noise.set_state(checkpoint["noise_generator"])


class GeneratorAtStart(Callback):
    """The state of the optimizer's noise generator when training starts and ends."""

    def on_train_start(self, trainer, pl_module):
        self.start = trainer.optimizers[0].generator.get_state()

    def on_train_end(self, trainer, pl_module):
        self.end = trainer.optimizers[0].generator.get_state()


def _trainer(max_epochs, callbacks):
    return pl.Trainer(
        max_epochs=max_epochs, callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu",
    )


def _first_and_resumed(tmp_path, module_class, **callback_options):
    """(first run's audit, resumed run's audit, first run's generator probe, resumed run's generator probe)."""
    probes = [GeneratorAtStart(), GeneratorAtStart()] if module_class is not GlobalNoise else [Callback(), Callback()]
    alerts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.seed_everything(0, verbose=False)
        checkpoints = ModelCheckpoint(dirpath=tmp_path)  # saves at each epoch end, keeps the latest
        first = DPAuditCallback(seed=0, alert=alerts.append, report=False, **callback_options)
        _trainer(FIRST_EPOCHS, [first, checkpoints, probes[0]]).fit(module_class(), datamodule=Digits())
        assert checkpoints.best_model_path.endswith(f"step={STEPS_BEFORE}.ckpt")

        pl.seed_everything(0, verbose=False)  # the resumed run is set up exactly as the first was
        resumed = DPAuditCallback(seed=0, alert=alerts.append, report=False, **callback_options)
        _trainer(FIRST_EPOCHS + RESUMED_EPOCHS, [resumed, ModelCheckpoint(dirpath=tmp_path), probes[1]]).fit(
            module_class(), datamodule=Digits(), ckpt_path=checkpoints.best_model_path,
        )
    return first.auditor.result(), resumed.auditor.result(), probes, alerts


def test_a_resumed_run_that_replays_the_noise_of_its_first_steps_is_flagged(tmp_path):
    first, resumed, _, alerts = _first_and_resumed(tmp_path, GlobalNoise)
    assert first.steps == STEPS_BEFORE and first.noise_repeats == 0 and not first.violation
    assert resumed.steps == STEPS_BEFORE + STEPS_AFTER
    assert resumed.noise_repeats == STEPS_AFTER  # every resumed step replays one of the first run
    assert resumed.first_noise_repeat == (STEPS_BEFORE + 1, 1)
    assert resumed.violation and "noise repeats" in resumed.violating_layers
    assert resumed.first_violation_step == STEPS_BEFORE + 1 and len(alerts) == 1
    assert "noise_repeats" in [finding.code for finding in resumed.findings]


def test_a_noise_generator_saved_and_restored_by_the_module_is_not_flagged(tmp_path):
    first, resumed, probes, alerts = _first_and_resumed(tmp_path, CheckpointedNoise)
    assert torch.equal(probes[1].start, probes[0].end)  # the resumed run continues the noise stream
    assert resumed.steps == STEPS_BEFORE + STEPS_AFTER and resumed.noise_repeats == 0
    assert not resumed.violation and resumed.first_noise_repeat is None and not alerts


def test_the_callback_checkpoints_the_noise_generator_when_asked(tmp_path):
    # SeededNoise re-seeds its generator on resume: the replay happens unless the callback restores it
    first, resumed, probes, alerts = _first_and_resumed(tmp_path / "off", SeededNoise)
    assert resumed.first_noise_repeat == (STEPS_BEFORE + 1, 1) and resumed.violation
    first, resumed, probes, alerts = _first_and_resumed(tmp_path / "on", SeededNoise, checkpoint_noise_generator=True)
    assert torch.equal(probes[1].start, probes[0].end)
    assert resumed.noise_repeats == 0 and not resumed.violation and not alerts


def test_checkpoint_noise_generator_warns_when_the_noise_comes_from_the_global_generator(tmp_path):
    callback = DPAuditCallback(seed=0, report=False, checkpoint_noise_generator=True)
    pl.seed_everything(0, verbose=False)
    with pytest.warns(UserWarning, match="torch's global generator, whose state the callback does not save"):
        _trainer(1, [callback, ModelCheckpoint(dirpath=tmp_path)]).fit(GlobalNoise(), datamodule=Digits())
    assert "noise_generator" not in callback.state_dict()


def _one_epoch_checkpoint(tmp_path):
    """The checkpoint of one audited epoch of SeededNoise (seed 0), in tmp_path."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.seed_everything(0, verbose=False)
        _trainer(1, [DPAuditCallback(seed=0, report=False), ModelCheckpoint(dirpath=tmp_path)]).fit(
            SeededNoise(), datamodule=Digits())
    (path,) = tmp_path.glob("*.ckpt")
    return path


def test_a_checkpoint_whose_accounting_is_another_runs_is_refused_at_resume(tmp_path):
    """The saved accountant history never composes the optimizer's noise multiplier: the resumed fit
    stops at fit start, naming it, with the optimizer as it was and the callback's history untouched."""
    from lightning_dpaudit import AuditStateError

    path = _one_epoch_checkpoint(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpoint = torch.load(path, weights_only=False)
        saved = checkpoint["callbacks"]["DPAuditCallback"]
        assert saved["accountant_history"] == [[1.0, BATCH / TRAIN, TRAIN // BATCH]]
        saved["accountant_history"] = [[2.0, BATCH / TRAIN, TRAIN // BATCH]]
        torch.save(checkpoint, tmp_path / "foreign.ckpt")
        resumed = DPAuditCallback(seed=0, report=False)
        module = SeededNoise()
        with pytest.raises(AuditStateError, match=r"`accountant_history` composes noise multipliers \[2.0\], never the optimizer's 1"):
            _trainer(2, [resumed]).fit(module, datamodule=Digits(), ckpt_path=tmp_path / "foreign.ckpt")
    assert resumed.auditor is None and resumed.history == [] and not resumed.alerted
    optimizer = module.trainer.optimizers[0]
    assert "add_noise" not in vars(optimizer) and not hasattr(optimizer, "_dpaudit_auditor")


def test_a_checkpoint_without_its_audit_or_with_a_damaged_one_is_refused_when_it_is_loaded(tmp_path):
    """Before the auditor exists (the callback's load_state_dict before fit start): a state without the auditor's
    (which would restart the audit at step 0) and an auditor state damaged in what needs no set-up are refused
    by name, nothing kept; the intact state, and one of a callback that never audited, load."""
    from lightning_dpaudit import AuditStateError

    path = _one_epoch_checkpoint(tmp_path)
    saved = torch.load(path, weights_only=True)["callbacks"]["DPAuditCallback"]
    steps = TRAIN // BATCH
    assert saved["auditor"]["steps"] == steps and saved["accountant_history"] == [[1.0, BATCH / TRAIN, steps]]
    for corrupt, message in [
        (lambda s: {k: v for k, v in s.items() if k != "auditor"}, r"`auditor` is missing, but the state holds .*`accountant_history`"),
        (lambda s: {**s, "auditor": {**s["auditor"], "steps": -5}}, r"`steps` is -5; expected a whole number >= 0"),
        (lambda s: {**s, "auditor": {**s["auditor"], "steps": steps + 1}},
         rf"`steps` is {steps + 1}; expected a whole number from 0 to {steps}, the steps the accountant's history composes"),
        (lambda s: {**s, "auditor": {**s["auditor"], "log": None}}, r"`log` is None; expected a dict"),
    ]:
        callback = DPAuditCallback(seed=0, report=False)
        with pytest.raises(AuditStateError, match=message):
            callback.load_state_dict(corrupt(saved))
        assert callback._pending_state is None and callback.auditor is None
    callback = DPAuditCallback(seed=0, report=False)
    callback.load_state_dict(saved)
    assert callback._pending_state["auditor"]["steps"] == steps
    DPAuditCallback(seed=0).load_state_dict({"history": [], "alerted": False})  # never audited (0.1.0 wrote no auditor)
