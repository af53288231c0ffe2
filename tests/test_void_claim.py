"""A noise multiplier of exactly 0 claims no privacy: a violation (the finding `no_noise`), not a refusal.

At attach or set mid-run, the audit reports it at the first step without noise, takes those steps plain (no canary),
never changes the training (the model equals plain Opacus's with the same seeds, to 1e-6: the audited steps before
it add and remove canaries) and never ends it by a failure of its own; under Lightning the fit completes, the report
is written and `dpaudit report` exits 3. Deterministic; no false-failure rate."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from opacus import PrivacyEngine
from pytorch_lightning.loggers import TensorBoardLogger
from lightning_modules import DigitsClassifier
from torch import nn

from lightning_dpaudit import DPAuditCallback, PrivacyAuditor
from lightning_dpaudit.datasets import make_private_digits
from lightning_dpaudit.app.cli import main
from lightning_dpaudit.engine.auditor import PrivacyViolationWarning

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")

STEPS = 8  # 128 examples, batch 32, two epochs


def _setup(noise_generator: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(128, 10, generator=g), torch.randint(0, 3, (128,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    module, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader, noise_multiplier=1.0,
        max_grad_norm=1.0, poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(1) if noise_generator else None)
    return module, optimizer, loader


def _trained(*, zero_from: int, noise_generator: bool, audit: bool):
    """Train STEPS steps with the noise multiplier set to 0 before step `zero_from` (1: before attach); the
    parameters and the auditor (None without the audit)."""
    module, optimizer, loader = _setup(noise_generator)
    if zero_from == 1:
        optimizer.noise_multiplier = 0.0
    auditor = PrivacyAuditor(optimizer, seed=3, canaries_per_step=64) if audit else None
    torch.manual_seed(11)  # dropout, and the noise when the optimizer has no generator of its own
    step = 0
    for _ in range(2):
        for x, y in loader:
            step += 1
            if step == zero_from:
                optimizer.noise_multiplier = 0.0
            optimizer.zero_grad()
            nn.functional.cross_entropy(module(x), y).backward()
            optimizer.step()
    return [p.detach().clone() for p in module.parameters()], auditor


@pytest.mark.parametrize("noise_generator", [True, False], ids=["own noise generator", "global generator"])
@pytest.mark.parametrize("zero_from", [1, 6], ids=["at attach", "after 5 steps"])
def test_no_noise_is_a_violation_and_the_training_is_plain_opacus(zero_from, noise_generator):
    plain, _ = _trained(zero_from=zero_from, noise_generator=noise_generator, audit=False)
    with pytest.warns(PrivacyViolationWarning, match=rf"no_noise: the optimizer's noise multiplier is 0 from step "
                                                     rf"{zero_from}: the release is the clipped sum without noise"):
        audited, auditor = _trained(zero_from=zero_from, noise_generator=noise_generator, audit=True)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(audited, plain))

    result = auditor.result()
    assert result.violation and result.audit_failed is None and result.steps == STEPS
    assert result.first_violation_step == result.detected_step == zero_from
    [finding] = result.findings
    assert (finding.code, finding.first_step, finding.scope) == ("no_noise", zero_from, "mechanism")
    assert finding.message.startswith(f"the optimizer's noise multiplier is 0 from step {zero_from}: the release is "
                                      "the clipped sum without noise, so no (epsilon, delta) holds")
    assert "the accountant's epsilon does not describe the run" in finding.message
    assert result.mu_claimed == math.inf and result.epsilon_accountant == math.inf  # no claim, no bound
    assert result.n_in + result.n_out == (zero_from - 1) * 64  # the steps without noise plant no canary
    assert str(result).startswith("VIOLATION")


def test_noise_restored_after_a_step_without_it_is_audited_again():
    """The finding names the first step without noise; the steps after the noise is back plant canaries again,
    read against the restored claim."""
    module, optimizer, loader = _setup(noise_generator=True)
    auditor = PrivacyAuditor(optimizer, seed=3, canaries_per_step=64)
    with pytest.warns(PrivacyViolationWarning, match=r"noise multiplier is 0 from step 3"):
        for step, (x, y) in enumerate(list(loader) * 2, start=1):
            optimizer.noise_multiplier = 0.0 if step in (3, 4) else 1.0
            optimizer.zero_grad()
            nn.functional.cross_entropy(module(x), y).backward()
            optimizer.step()
    result = auditor.result()
    assert [(f.code, f.first_step) for f in result.findings] == [("no_noise", 3)]
    assert result.n_in + result.n_out == (STEPS - 2) * 64 and result.mu_claimed == 1.0
    assert result.audit_failed is None


@pytest.mark.parametrize("attribute,value,message", [
    ("noise_multiplier", -1.0, r"noise_multiplier: -1.0; it must be a finite number > 0, or 0 \(no noise"),
    ("noise_multiplier", float("nan"), r"noise_multiplier: nan"),
    ("noise_multiplier", "0", r"noise_multiplier: '0' of type str"),
    ("max_grad_norm", 0.0, r"max_grad_norm: 0.0; clipping needs a finite bound > 0"),
])
def test_other_invalid_claims_are_still_refused_at_attach(attribute, value, message):
    _, optimizer, _ = _setup(noise_generator=True)
    setattr(optimizer, attribute, value)
    with pytest.raises(ValueError, match=message):
        PrivacyAuditor(optimizer)


# ------------------------------------------------------------------ Lightning


def test_lightning_fit_without_noise_completes_with_a_report_and_the_gate_fails(tmp_path):
    model, optimizer, loader, _ = make_private_digits(seed=0)
    optimizer.noise_multiplier = 0.0  # after make_private: the blatant bug

    callback = DPAuditCallback()  # the default alert: a warning, training goes on
    logger = TensorBoardLogger(tmp_path, name="tb")
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_steps=STEPS, callbacks=[callback], logger=logger, default_root_dir=tmp_path,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         accelerator="cpu")
    with pytest.warns(PrivacyViolationWarning, match=r"no_noise: the optimizer's noise multiplier is 0 from step 1"):
        trainer.fit(DigitsClassifier(model, optimizer), loader)

    assert trainer.global_step == STEPS  # the fit completed
    result = callback.auditor.result()
    assert result.violation and result.audit_failed is None and [f.code for f in result.findings] == ["no_noise"]
    assert (Path(logger.log_dir) / "audit_report.json").exists()
    assert main(["report", str(tmp_path)]) == 3


@pytest.mark.parametrize("alert", ["stop", "raise"])
def test_lightning_fit_without_noise_stops_only_as_the_alert_says(tmp_path, alert):
    from lightning_dpaudit import PrivacyViolationError

    model, optimizer, loader, _ = make_private_digits(seed=0)
    optimizer.noise_multiplier = 0.0

    callback = DPAuditCallback(alert=alert)
    trainer = pl.Trainer(max_steps=STEPS, callbacks=[callback], logger=TensorBoardLogger(tmp_path, name="tb"),
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         accelerator="cpu")
    if alert == "raise":
        with pytest.raises(PrivacyViolationError, match="no_noise"):
            trainer.fit(DigitsClassifier(model, optimizer), loader)
    else:
        trainer.fit(DigitsClassifier(model, optimizer), loader)
    assert trainer.global_step < STEPS  # stopped at the alarm, as the alert asks
    assert [f.code for f in callback.auditor.result().findings] == ["no_noise"]
