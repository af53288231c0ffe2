"""The verdict is hard to miss: the exit status of `dpaudit report`, the report figure's title, the alert's one
line (log, TensorBoard, a warning attributed to the user's code), the TensorBoard pointer, and the accountant's
epsilon equal to the accountant's own."""

import logging
import math
import warnings

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from opacus.data_loader import DPDataLoader
from pytorch_lightning.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, Subset

from lightning_dpaudit import DPAuditCallback, PrivacyAuditor, PrivacyViolationWarning
from lightning_dpaudit.analysis.report import report_figure, summary_table, verdict_title, write_report
from lightning_dpaudit.analysis.results import AuditResult, Finding, LayerAudit, violation_message
from lightning_dpaudit.app.cli import VIOLATION_EXIT, main
from lightning_dpaudit.integrations.digits import DigitsCNN, digits_dataset, make_private_digits, train_steps


def audit_result(violation: bool, **changes) -> AuditResult:
    values = dict(
        epsilon_lower_bound=1234.5 if violation else 0.97, epsilon_accountant=1.44, mu_lower_bound=6.98 if violation else 0.31,
        mu_lower_bound_anytime=3.12 if violation else 0.28, mu_claimed=1 / 3, violation=violation,
        violating_layers=("pooled", "fc.weight", "noise repeats") if violation else (), n_in=512, n_out=512, steps=30,
        estimator="gdp-cp", confidence=0.95, delta=1e-5, epsilon_step_lower_bound=53.4, epsilon_step_claimed=1.27,
        first_violation_step=6 if violation else None, detected_step=8 if violation else None, noise_repeats=0,
        mode="one-run", canary="dirac",
        layers=(LayerAudit("fc.weight", 6.0, 3.0, 1 / 3, 256, 256, violation), LayerAudit("fc.bias", 0.1, 0.0, 1 / 3, 256, 256, False)),
        findings=(Finding("noise_scale", "noise std 0 x claimed (95% CI 0-0): no noise reaches the release", 6),) if violation else (),
    )
    values.update(changes)
    return AuditResult(**values)


# ------------------------------------------------------------------ exit status


def test_report_exit_status_is_a_ci_gate(tmp_path, capsys):
    ok, bad, damaged = tmp_path / "ok", tmp_path / "bad", tmp_path / "damaged"
    for directory, violation in ((ok, False), (bad, True)):
        write_report(directory, audit_result(violation), settings={}, versions={}, history=[], in_values=[1.0, 0.9],
                     out_values=[0.0, 0.1])
    assert main(["report", str(ok)]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("OK")
    assert main(["report", str(bad)]) == VIOLATION_EXIT == 3
    assert capsys.readouterr().out.splitlines()[1].startswith("VIOLATION")
    damaged.mkdir()
    (damaged / "audit_report.json").write_text('{"result": {"violation": tr')
    assert main(["report", str(damaged)]) == 1
    assert "not valid JSON" in capsys.readouterr().err


# ------------------------------------------------------------------ the figure


@pytest.mark.parametrize("violation", [False, True])
def test_report_figure_title_gives_the_verdict_delta_and_both_epsilons(violation):
    result = audit_result(violation)
    rng = np.random.default_rng(0)
    history = [{"step": k, "eps_lower_bound": 40.0 * k if violation else 0.03 * k, "eps_accountant": 0.05 * k} for k in range(1, 31)]
    fig = report_figure(rng.normal(1, 1, 500), rng.normal(0, 1, 500), history, mu_claimed=result.mu_claimed,
                        mu_lower=result.mu_lower_bound, result=result)
    title = fig._suptitle.get_text()
    assert title.startswith("VIOLATION found at step 8 (first violating step 6): " if violation else "OK: ")
    assert ("VIOLATION" in title) == violation
    assert "delta = 1e-05" in title and "1.44 (accountant)" in title
    assert ("1,234" if violation else "0.97") + " (empirical lower bound)" in title
    tradeoff, curves = fig.axes
    assert curves.get_yscale() == ("log" if violation else "linear")  # 800x the accountant: a log axis
    styles = {(ln.get_linestyle(), ln.get_marker()) for ln in tradeoff.get_lines()}
    assert len(styles) == len(tradeoff.get_lines())  # every curve its own line style and marker
    assert tradeoff.get_legend() is not None and curves.get_legend() is not None


def test_the_written_figure_carries_the_title(tmp_path, monkeypatch):
    import lightning_dpaudit.analysis.report as report

    built = []
    original = report.report_figure
    monkeypatch.setattr(report, "report_figure", lambda *a, **k: built.append(original(*a, **k)) or built[-1])
    write_report(tmp_path, audit_result(True), settings={}, versions={}, history=[], in_values=[1.0, 0.9], out_values=[0.0, 0.1])
    assert built[0]._suptitle.get_text().startswith("VIOLATION")


# ------------------------------------------------------------------ the alert's line


def test_violation_message_puts_the_verdict_and_cause_first():
    headline, finding = violation_message(audit_result(True)).splitlines()
    assert headline.startswith("DP AUDIT VIOLATION found at step 8 (first violating step 6): noise_scale: noise std 0 x claimed")
    cause, numbers = headline.split("; epsilon >= ", 1)
    assert numbers.startswith("1.23e+03 vs accountant 1.44 (delta 1e-05); per-step mu lower bound 3.120")
    assert numbers.endswith("violating: pooled, fc.weight, noise repeats")
    assert finding == "  - noise_scale: noise std 0 x claimed (95% CI 0-0): no noise reaches the release"


def test_summary_counts_only_layers():
    verdict = summary_table({"result": audit_result(True).to_dict()}).splitlines()[0]
    assert verdict == ("VIOLATION: leak beyond the claim in pooled, noise repeats and 1 layer (fc.weight); found at step 8 "
                       "(first violating step 6)")
    only_groups = audit_result(True, violating_layers=("noise correlated", "exact checks"))
    assert "in noise correlated and exact checks;" in summary_table({"result": only_groups.to_dict()})


def test_a_report_without_the_detection_step_names_the_first_violating_step_alone():
    """Reports written before the detection step was kept (and a violation not alarmed yet) say what they know."""
    older = {k: v for k, v in audit_result(True).to_dict().items() if k != "detected_step"}
    assert summary_table({"result": older}).splitlines()[0].endswith("(fc.weight); first violating step 6")
    assert verdict_title(older).startswith("VIOLATION (first violating step 6): epsilon >= ")


def test_the_alert_and_the_summary_name_the_step_found_at_and_the_first_violating_step(one_thread):
    """check_every="auto" (8): a leak from step 1 is alarmed at the check after step 8, and says both; the step
    found at travels in the audit's state."""
    from lightning_dpaudit.integrations.bugs import inject_bug

    model, optimizer, loader, _ = make_private_digits(seed=0)
    inject_bug(optimizer, "no-noise")
    auditor = PrivacyAuditor(optimizer, seed=0)
    with pytest.warns(PrivacyViolationWarning, match=r"^DP AUDIT VIOLATION found at step 8 \(first violating step 1\): ") as alerts:
        train_steps(model, optimizer, loader, 12)
    assert sum(w.category is PrivacyViolationWarning for w in alerts) == 1
    result = auditor.result()
    assert (result.first_violation_step, result.detected_step, result.steps) == (1, 8, 12)
    assert violation_message(result).startswith("DP AUDIT VIOLATION found at step 8 (first violating step 1): noise_scale")
    assert auditor.summary().splitlines()[0].endswith("; found at step 8 (first violating step 1)")
    assert verdict_title(result).startswith("VIOLATION found at step 8 (first violating step 1): ")
    saved = auditor.record.state_dict()
    assert saved["detected"] == 8
    auditor.record.detected = None
    auditor.record.load_state_dict(saved)
    assert auditor.result().detected_step == 8
    auditor.detach()


class Digits(pl.LightningDataModule):
    def train_dataloader(self):
        loader = DataLoader(Subset(digits_dataset(), range(512)), batch_size=64, generator=torch.Generator().manual_seed(0))
        return DPDataLoader.from_data_loader(loader)  # Poisson sampling, as the accountant assumes


class Private(pl.LightningModule):
    def __init__(self, bug=None):
        super().__init__()
        self.model = DigitsCNN()
        self.bug = bug

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return torch.nn.functional.cross_entropy(self.model(images), labels)

    def configure_optimizers(self):
        from opacus import PrivacyEngine

        self.privacy_engine = PrivacyEngine()
        _, optimizer, _ = self.privacy_engine.make_private(
            module=self, optimizer=torch.optim.SGD(self.parameters(), lr=0.2),
            data_loader=self.trainer.datamodule.train_dataloader(), noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=False, noise_generator=torch.Generator().manual_seed(7),
        )
        if self.bug:
            from lightning_dpaudit.bugs import inject_bug

            inject_bug(optimizer, self.bug)
        return optimizer


def _fit(tmp_path, module, steps=16, callback=None):
    pl.seed_everything(0, verbose=False)
    logger = TensorBoardLogger(tmp_path, name="tb")
    callback = callback if callback is not None else DPAuditCallback(seed=0, log_every_n_steps=8)
    trainer = pl.Trainer(max_steps=steps, callbacks=[callback], logger=logger,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         accelerator="cpu", default_root_dir=tmp_path)
    trainer.fit(module, datamodule=Digits())
    return logger


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_warn_alert_is_one_warning_at_user_code_and_tensorboard_text(tmp_path, caplog, capsys, one_thread):
    """alert="warn" (the default) shows one line: the warning, attributed to the code that ran trainer.fit (its
    findings on the lines below); no log line repeats it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with caplog.at_level(logging.WARNING, logger="lightning_dpaudit"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger = _fit(tmp_path, Private(bug="no-noise"))
    assert not [r for r in caplog.records if r.name == "lightning_dpaudit"]
    alerts = [w for w in caught if str(w.message).startswith("DP AUDIT VIOLATION")]
    assert len(alerts) == 1 and alerts[0].category is PrivacyViolationWarning and issubclass(PrivacyViolationWarning, UserWarning)
    assert alerts[0].filename == __file__  # attributed to the code that ran trainer.fit, not to a library's path
    line = str(alerts[0].message).splitlines()[0]
    assert line.startswith("DP AUDIT VIOLATION found at step ") and "(first violating step " in line
    assert ": noise_scale: noise std" in line
    assert line.index("noise_scale") < line.index("epsilon >= ") < line.index("vs accountant")
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0}).Reload()
    (text,) = events.Tensors("dpaudit/alert/text_summary")
    assert line in text.tensor_proto.string_val[0].decode()
    assert capsys.readouterr().out.count(f"tensorboard --logdir {logger.log_dir}") == 1


def test_stop_alert_is_one_log_line_saying_training_stopped(tmp_path, caplog, one_thread):
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path, Private(bug="no-noise"), callback=DPAuditCallback(alert="stop", seed=0))
    assert not [w for w in caught if "DP AUDIT VIOLATION" in str(w.message)]
    records = [r.getMessage() for r in caplog.records if "DP AUDIT VIOLATION" in r.getMessage()]
    assert len(records) == 1 and records[0].startswith("DP AUDIT VIOLATION found at step ")
    headline, *findings = records[0].splitlines()
    assert headline.endswith('; training stopped by DPAuditCallback(alert="stop")')
    assert findings and findings[0].startswith("  - noise_scale: ")


def test_a_correct_run_logs_no_alert_and_points_at_tensorboard_once(tmp_path, caplog, capsys, one_thread):
    with caplog.at_level(logging.WARNING, logger="lightning_dpaudit"):
        logger = _fit(tmp_path, Private(), steps=8)
    assert not [r for r in caplog.records if r.name == "lightning_dpaudit"]
    assert capsys.readouterr().out.count(f"tensorboard --logdir {logger.log_dir}") == 1


# ------------------------------------------------------------------ the accountant's epsilon


@pytest.mark.parametrize("kind", ["prv", "rdp"])
def test_the_accountant_epsilon_is_the_accountants_own(kind, one_thread):
    model, optimizer, loader, engine = make_private_digits(seed=0, accountant=kind, batch_size=256)
    auditor = PrivacyAuditor(optimizer, module=model, seed=0)
    train_steps(model, optimizer, loader, 70, loss_fn=torch.nn.CrossEntropyLoss())  # 70: off LiveEpsilon's PRV step grid
    result = auditor.result()
    auditor.detach()
    history = list(engine.accountant.history)
    assert result.epsilon_accountant == pytest.approx(engine.accountant.get_epsilon(result.delta), abs=1e-6)
    assert engine.accountant.history == history  # asking did not change the accountant
    assert 0 < result.epsilon_lower_bound <= result.epsilon_accountant and math.isfinite(result.epsilon_accountant)


def test_the_plain_auditors_warning_points_at_the_users_code():
    """Without the callback, the default alert is a PrivacyViolationWarning attributed to the training loop's
    own line (this file), not to a path inside the package, torch or Opacus."""
    import warnings

    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.integrations.bugs import inject_bug
    from lightning_dpaudit.integrations.digits import make_private_digits, train_steps

    model, optimizer, loader, _ = make_private_digits(seed=0)
    inject_bug(optimizer, "no-noise")
    PrivacyAuditor(optimizer, seed=0, check_every=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_steps(model, optimizer, loader, 3)
    alerts = [w for w in caught if w.category.__name__ == "PrivacyViolationWarning"]
    assert len(alerts) == 1 and str(alerts[0].message).startswith("DP AUDIT VIOLATION found at step 1 (first violating step 1)")
    assert alerts[0].filename == __file__
