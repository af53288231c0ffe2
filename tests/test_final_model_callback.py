"""The final-model audit in a Lightning run: logged next to the step audit, reported,
saved in checkpoints and resumed with the same secret inclusion; and the demo."""

import json

import pytest
import torch
from pytorch_lightning.loggers import TensorBoardLogger

from lightning_dpaudit import DPAuditCallback
from lightning_dpaudit.analysis.report import summary_table
from lightning_dpaudit.analysis.report_reading import load_report
from lightning_dpaudit.engine.final_model import FinalModelCanaries
from opacus.lightning import DPLightningDataModule

from lightning_dpaudit.integrations.final_model_data import CanaryDataModule

from test_callback import Digits, Private, _fit

CANARIES = 64


class Scored(Private):
    def forward(self, x):
        return self.model(x)


def _canaries(seed=None):
    return FinalModelCanaries(CANARIES, "ood", num_classes=10, seed=seed)


def _run(tmp_path, canaries, *, steps, every=None, logger=None, ckpt_path=None, trainer_kwargs=None):
    callback = DPAuditCallback(log_every_n_steps=8, seed=0, final_model_canaries=canaries, final_model_every_n_epochs=every)
    trainer = _fit(tmp_path, steps=steps, callback=callback, logger=logger, module=Scored(), datamodule=DPLightningDataModule(CanaryDataModule(Digits(poisson=False), canaries)),
                   ckpt_path=ckpt_path, **(trainer_kwargs or {}))
    return trainer, callback


def test_bounds_logged_reported_and_summarised_beside_the_step_audit(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    canaries = _canaries(seed=3)
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer, callback = _run(tmp_path, canaries, steps=3 * 9, every=1, logger=logger)
    # 512 digits + the included canaries, batch 64: the loader the Trainer used holds both
    assert len(trainer.train_dataloader.dataset) == 512 + canaries.num_included
    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "histograms": 0}).Reload()
    curve = events.Scalars("dpaudit/final_model/eps_lower_bound")
    assert len(curve) >= 3  # every epoch, and at the end of fit
    assert "dpaudit/final_model/eps_lower_bound_fdp_if_gaussian" in events.Tags()["scalars"]
    assert {"dpaudit/final_model/scores_trained_on", "dpaudit/final_model/scores_not_trained_on"} <= set(events.Tags()["histograms"])
    report = load_report(logger.log_dir)
    section = report["final_model"]
    assert section["num_canaries"] == CANARIES and section["num_included"] == int(canaries.included.sum())
    assert set(section["bounds"]) == {"steinke", "fdp"}
    assert section["accountant_epsilon"] == pytest.approx(report["result"]["epsilon_accountant"])
    assert section["epsilon_lower_bound"] == section["bounds"]["steinke"]["epsilon"]
    assert curve[-1].value == pytest.approx(section["epsilon_lower_bound"], rel=1e-6)  # TensorBoard keeps float32
    assert [h["epoch"] for h in section["history"]][:3] == [0, 1, 2]
    counts = section["histograms"][section["bounds"]["steinke"]["score"]]
    assert sum(counts["included"]) == section["num_included"] and sum(counts["excluded"]) == CANARIES - section["num_included"]
    printed = capsys.readouterr().out
    assert "Final model (64 ood canaries" in printed and "epsilon if Gaussian (f-DP)" in printed
    assert "Final model" in summary_table(report)


def test_the_checkpoint_carries_the_secret_inclusion_and_the_start_losses(tmp_path):
    first = _canaries()  # seed from the OS: only the checkpoint knows it
    trainer, callback = _run(tmp_path / "a", first, steps=8)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    state = torch.load(tmp_path / "a.ckpt", weights_only=False)["callbacks"]["DPAuditCallback"]["final_model"]
    assert state["canaries"]["seed"] is not None
    assert not (_canaries().included == first.included).all()  # a fresh secret differs (false failure 2^-64)
    resumed = _canaries()
    _, callback = _run(tmp_path / "b", resumed, steps=16, ckpt_path=tmp_path / "a.ckpt")
    assert (resumed.included == first.included).all()
    assert (resumed.start_losses == first.start_losses).all()  # loss change measured from the first start
    assert callback.final_model.result.step == 16


def test_a_module_without_forward_is_named(tmp_path):
    callback = DPAuditCallback(seed=0, final_model_canaries=_canaries(seed=1))
    with pytest.raises(ValueError, match="Private defines none: add forward"):
        _fit(tmp_path, steps=2, callback=callback, module=Private(), datamodule=DPLightningDataModule(CanaryDataModule(Digits(poisson=False), callback.final_model.canaries)))


def test_the_callback_refuses_what_is_not_a_final_model_canaries():
    with pytest.raises(ValueError, match="final_model_canaries"):
        DPAuditCallback(final_model_canaries=[1, 2, 3])
    with pytest.raises(ValueError, match="final_model_every_n_epochs"):
        DPAuditCallback(final_model_canaries=_canaries(), final_model_every_n_epochs=0)


def test_demo_shows_both_audits(tmp_path, capsys):
    from lightning_dpaudit.app.cli import main

    assert main(["demo", "--steps", "20", "--final-model", "100", "--no-progress-bar", "--out", str(tmp_path), "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "final model: 100 'ood' canaries" in printed
    assert "Final model (100 ood canaries" in printed and "(accountant)" in printed
    report = json.loads(next(tmp_path.rglob("audit_report.json")).read_text())
    assert report["final_model"]["num_canaries"] == 100 and report["result"]["steps"] == 20


def test_every_process_takes_rank_0s_secret_seed_before_the_data_is_read():
    from types import SimpleNamespace

    class Rank1Strategy:  # what rank 1 gets back from a broadcast of rank 0's object
        def broadcast(self, obj, src=0):
            assert src == 0
            return 12345

    canaries = _canaries()  # this process's own OS seed
    callback = DPAuditCallback(final_model_canaries=canaries)
    callback.setup(SimpleNamespace(world_size=2, strategy=Rank1Strategy()), None, "fit")
    assert (canaries.included == _canaries(seed=12345).included).all()
    alone = _canaries()
    before = alone.included.copy()
    DPAuditCallback(final_model_canaries=alone).setup(SimpleNamespace(world_size=1, strategy=Rank1Strategy()), None, "fit")
    assert (alone.included == before).all()
