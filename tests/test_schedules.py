"""Privacy parameters that change during training: Opacus's noise and clipping schedulers.

Every run is a seeded digits-CNN training (29 steps an epoch, the scheduler stepped after
each epoch), so each outcome here is deterministic. For a fresh seed, a correct run raises
an alarm with probability <= 5% (the audit's confidence), and the tightness ratios move
by about 0.01 between seeds (bench/validity/false_alarms.py measures the rate).
"""

import math

import numpy as np
import pytest
import torch
from opacus import schedulers

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.analysis.claim_segments import FIRST_SHARE, later_share
from lightning_dpaudit.bugs import inject_bug
from lightning_dpaudit.engine.release.distributed import sample_rate_of
from lightning_dpaudit.engine.options import find_accountant
from lightning_dpaudit.estimators.changing_claims import mixture_mu, ratio_lower_bound
from lightning_dpaudit.integrations.digits import make_private_digits, train_steps

pytestmark = pytest.mark.usefixtures("one_thread")

SIGMA = 2.0
SCHEDULES = {
    "StepNoise": lambda o: schedulers.StepNoise(o, step_size=5, gamma=0.8),
    "ExponentialNoise": lambda o: schedulers.ExponentialNoise(o, gamma=0.97),
    "LambdaNoise": lambda o: schedulers.LambdaNoise(o, noise_lambda=lambda epoch: 1.5 if epoch < 10 else 1.0),
    "StepGradClip": lambda o: schedulers.StepGradClip(o, step_size=5, gamma=0.5),
    "ExponentialGradClip": lambda o: schedulers.ExponentialGradClip(o, gamma=0.9),
    "LambdaGradClip": lambda o: schedulers.LambdaGradClip(o, scheduler_function=lambda epoch: 1.0 / (1 + epoch)),
}



def _run(schedule=None, *, steps=1000, bug=None, seed=0, **bug_options):
    model, optimizer, loader, _ = make_private_digits(noise_multiplier=SIGMA, seed=seed)
    if bug is not None:
        inject_bug(optimizer, bug, **bug_options)
    auditor = PrivacyAuditor(optimizer, seed=seed, on_violation=lambda result: None)
    scheduler = schedule(optimizer) if schedule else None
    done = 0
    while done < steps:
        done += train_steps(model, optimizer, loader, min(len(loader), steps - done))
        last_sigma = optimizer.noise_multiplier  # the claim of the last step
        if scheduler is not None:
            scheduler.step()
    return auditor, last_sigma


@pytest.fixture(scope="module")
def fixed_ratio():
    auditor, _ = _run()
    result = auditor.result()
    assert not result.violation
    return result.epsilon_lower_bound / result.epsilon_accountant


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_opacus_scheduler_is_quiet_and_as_tight_as_a_fixed_claim(name, fixed_ratio):
    auditor, last_sigma = _run(SCHEDULES[name])
    result = auditor.result()
    assert not result.violation, result.findings
    changed = "Noise" in name
    assert (len(auditor.record.monitor.segments) > 1) == changed  # a clipping schedule keeps the claimed mu
    ratio = result.epsilon_lower_bound / result.epsilon_accountant
    assert abs(ratio - fixed_ratio) <= 0.05, (ratio, fixed_ratio)
    assert result.mu_claimed == pytest.approx(1.0 / last_sigma, rel=0.01)  # a segment claims its largest mu


def test_a_noise_schedule_moves_the_claim_the_result_reports():
    auditor, _ = _run(SCHEDULES["StepNoise"], steps=200)  # epochs 0-6: sigma 2.0, then 1.6
    result = auditor.result()
    assert len(auditor.record.monitor.segments) == 2
    assert result.mu_claimed == pytest.approx(1 / 1.6) and result.epsilon_step_claimed > 0
    assert 0.9 * result.mu_claimed < result.mu_lower_bound < result.mu_claimed


def test_noise_at_0_6_of_each_steps_claim_is_flagged_under_a_schedule():
    auditor, _ = _run(SCHEDULES["StepNoise"], steps=300, bug="wrong-noise", factor=0.6)
    result = auditor.result()
    assert result.violation and result.first_violation_step <= 10
    assert "pooled" in result.violating_layers


def test_missing_clipping_is_flagged_under_a_clipping_schedule():
    auditor, _ = _run(SCHEDULES["StepGradClip"], steps=300, bug="no-clipping")
    result = auditor.result()
    assert result.violation and result.first_violation_step <= 10
    # certain at the exact checks' first step: the canaries' clipping and the data's clipped sum
    assert {"canary_clipping", "clipped_sum"} <= {f.code for f in result.findings}


def test_a_bug_that_starts_after_the_claim_changed_is_flagged_in_its_segment():
    """Noise at 0.6 x the claim from epoch 10 on (sigma 1.6 by then): the later segment's own test finds it."""
    model, optimizer, loader, _ = make_private_digits(noise_multiplier=SIGMA, seed=1)
    inject_bug(optimizer, "wrong-noise", factor=1.0)  # correct noise at first
    auditor = PrivacyAuditor(optimizer, seed=1, on_violation=lambda result: None)
    scheduler = SCHEDULES["StepNoise"](optimizer)
    for epoch in range(20):
        if epoch == 10:
            optimizer.factor = 0.6
        train_steps(model, optimizer, loader, len(loader))
        scheduler.step()
    result = auditor.result()
    assert result.steps == 20 * 29 and result.n_in + result.n_out == result.steps * 1024
    assert result.violation and 290 < result.first_violation_step <= 340


def _stale_hook(accountant, sample_rate, sigma):
    """A step hook that composes a fixed noise multiplier whatever the optimizer uses."""
    return lambda optimizer: accountant.step(noise_multiplier=sigma, sample_rate=sample_rate)


def test_a_schedule_the_accountant_does_not_see_is_a_finding():
    model, optimizer, loader, _ = make_private_digits(noise_multiplier=SIGMA, seed=0)
    optimizer.attach_step_hook(_stale_hook(find_accountant(optimizer), sample_rate_of(optimizer), SIGMA))
    auditor = PrivacyAuditor(optimizer, seed=0, on_violation=lambda result: None)
    scheduler = SCHEDULES["StepNoise"](optimizer)
    for _ in range(7):
        train_steps(model, optimizer, loader, len(loader))
        scheduler.step()
    result = auditor.result()
    finding = next(f for f in result.findings if f.code == "claim_unaccounted")
    assert result.violation and finding.first_step == 29 * 5 + 1  # the first step after sigma changed
    assert "composed noise multiplier 2 for step 146, but the optimizer used 1.6" in finding.message


def test_a_correct_schedule_is_no_finding_of_the_accountant():
    auditor, _ = _run(SCHEDULES["ExponentialNoise"], steps=100)
    assert auditor.problems == []


def test_a_resumed_audit_keeps_its_segments_and_follows_the_optimizer_it_resumes_with():
    auditor, _ = _run(SCHEDULES["StepNoise"], steps=200)
    state = auditor.state_dict()
    model, optimizer, loader, _ = make_private_digits(noise_multiplier=SIGMA, seed=5)  # rebuilt, with fresh noise
    fresh = PrivacyAuditor(optimizer, seed=0, on_violation=lambda result: None)
    fresh.load_state_dict(state)
    assert len(fresh.record.monitor.segments) == 2 and fresh.result(accounting=False).mu_claimed == pytest.approx(1 / SIGMA)
    optimizer.noise_multiplier = 1.6  # the restored scheduler sets the epoch's sigma
    train_steps(model, optimizer, loader, 10)
    result = fresh.result(accounting=False)
    assert len(fresh.record.monitor.segments) == 2 and result.mu_claimed == pytest.approx(1 / 1.6)
    assert result.steps == 210 and not result.violation


# ------------------------------------------------------------------ the statistics, without training


def test_segment_budgets_sum_to_the_whole():
    total = FIRST_SHARE + sum(later_share(k) for k in range(1, 200_000))
    assert total == pytest.approx(1.0, abs=1e-5) and total <= 1.0


def test_ratio_of_one_claim_is_the_plain_quotient():
    assert ratio_lower_bound(0.45, [100], [100], [0.5]) == pytest.approx(0.9)


def test_ratio_inverts_the_mixture():
    n_in, n_out, mus = [300, 200, 500], [250, 250, 500], [0.5, 0.8, 1.3]
    for r in (0.3, 0.9, 1.0, 1.7):
        assert ratio_lower_bound(mixture_mu(r, n_in, n_out, mus), n_in, n_out, mus) == pytest.approx(r, rel=1e-8)


def test_mixture_at_ratio_one_is_what_a_correct_run_shows():
    """Simulated threshold-0.5 attack on steps with mu 0.5 and 2: the pooled mu matches m(1) (seeded)."""
    rng = np.random.default_rng(0)
    mus = np.repeat([0.5, 2.0], 200_000)
    is_in = rng.random(mus.size) < 0.5
    values = is_in + rng.standard_normal(mus.size) / mus
    fpr = np.mean(values[~is_in] >= 0.5)
    fnr = np.mean(values[is_in] < 0.5)
    from scipy.special import ndtri

    pooled = -ndtri(fpr) - ndtri(fnr)
    expected = mixture_mu(1.0, [is_in[:200_000].sum(), is_in[200_000:].sum()],
                          [(~is_in[:200_000]).sum(), (~is_in[200_000:]).sum()], [0.5, 2.0])
    assert pooled == pytest.approx(expected, abs=0.01) and expected < 0.5 * (0.5 + 2.0)


def test_ratio_refuses_claims_that_are_not_positive():
    with pytest.raises(ValueError, match="every claim must be > 0"):
        ratio_lower_bound(1.0, [1], [1], [0.0])
    assert ratio_lower_bound(0.0, [1], [1], [1.0]) == 0.0 and math.isinf(ratio_lower_bound(math.inf, [1], [1], [1.0]))


def test_under_lightning_both_epsilon_curves_follow_a_noise_schedule(tmp_path):
    """StepNoise stepped in on_train_epoch_end: the claimed mu rises each epoch, and both epsilons track it."""
    import csv

    import pytorch_lightning as pl
    from opacus import PrivacyEngine
    from pytorch_lightning.loggers import CSVLogger
    from torch.utils.data import DataLoader, Subset

    from lightning_dpaudit import DPAuditCallback
    from lightning_dpaudit.integrations.digits import DigitsCNN, digits_dataset

    class Scheduled(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = DigitsCNN()

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.model(batch[0]), batch[1])

        def train_dataloader(self):
            from opacus.data_loader import DPDataLoader

            loader = DataLoader(Subset(digits_dataset(), range(512)), batch_size=64, generator=torch.Generator().manual_seed(0))
            return DPDataLoader.from_data_loader(loader)  # Poisson sampling, as the accountant assumes

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.2)
            _, optimizer, _ = PrivacyEngine().make_private(
                module=self, optimizer=optimizer, data_loader=self.train_dataloader(), noise_multiplier=2.0,
                max_grad_norm=1.0, poisson_sampling=False, noise_generator=torch.Generator().manual_seed(7),
            )
            self.scheduler = schedulers.StepNoise(optimizer, step_size=1, gamma=0.5)
            return optimizer

        def on_train_epoch_end(self):
            self.scheduler.step()

    pl.seed_everything(0, verbose=False)
    logger = CSVLogger(tmp_path, name="csv")
    callback = DPAuditCallback(log_every_n_steps=8, seed=0)  # 8 steps an epoch: one row per epoch
    trainer = pl.Trainer(max_epochs=4, callbacks=[callback], logger=logger, default_root_dir=tmp_path,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         accelerator="cpu")
    trainer.fit(Scheduled())
    rows = list(csv.DictReader(open(f"{logger.log_dir}/metrics.csv")))

    def column(name):
        return [float(r[name]) for r in rows if r.get(name)]

    claimed, lower, accountant = column("dpaudit/mu_claimed"), column("dpaudit/eps_lower_bound"), column("dpaudit/eps_accountant")
    assert claimed == pytest.approx([0.5, 1.0, 2.0, 4.0])  # sigma 2, 1, 0.5, 0.25
    assert not callback.auditor.result().violation
    # each epoch at half the noise adds more to both epsilons than the one before
    assert all(np.diff(accountant) > 0) and all(np.diff(np.diff(accountant)) > 0)
    assert all(np.diff(lower) > 0) and all(0.5 < lo / acc <= 1.0 for lo, acc in zip(lower[1:], accountant[1:]))
