"""Adaptive clipping audited: AdaClipDPOptimizer and adaptive ghost clipping (engine/claims/adaptive.py).

The canaries must not move the clipping bound (training equals the plain run), a step claims
the gradient's own noise multiplier, and an accountant that composes less than the gradient
and the unclipped count together (Opacus before 1.6.0, #807) is a finding."""

import warnings

import numpy as np
import pytest
import torch
from opacus import PrivacyEngine
from opacus.optimizers import AdaClipDPOptimizer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.engine.claims.adaptive import CODE, StepNoise, adjusted
from lightning_dpaudit.engine.auditor import PrivacyViolationWarning
from lightning_dpaudit.engine.step.pipeline import AuditFailedWarning
from lightning_dpaudit.integrations.opacus_history import historical_bug

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")

SIGMA, SIGMA_U = 1.0, 2.0


def _data(n=256):
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(n, 10, generator=g), torch.randint(0, 3, (n,), generator=g))


def _model():
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))


def _adaclip(poisson=True):
    model = _model()
    engine = PrivacyEngine(accountant="rdp")
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=32), noise_multiplier=SIGMA, max_grad_norm=1.0,
        clipping="adaptive", target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0,
        min_clipbound=0.01, unclipped_num_std=SIGMA_U, poisson_sampling=poisson,
    )
    return module, optimizer, loader, engine, nn.CrossEntropyLoss()


def _adaptive_ghost(poisson=True):
    from opacus.utils.adaptive_clipping import PrivacyEngineAdaptiveClipping

    model = _model()
    engine = PrivacyEngineAdaptiveClipping(accountant="rdp")
    module, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(512), batch_size=64), noise_multiplier=SIGMA, max_grad_norm=1.0,
        grad_sample_mode="ghost", criterion=nn.CrossEntropyLoss(), poisson_sampling=poisson,
        target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0,
        min_clipbound=0.01,
    )
    return module, optimizer, loader, engine, criterion


SETUPS = {"adaclip": _adaclip, "ghost": _adaptive_ghost}


def _run(setup, steps, *, audit=None, poisson=True, seed=0):
    """Train `steps` steps; (parameters, the bound after each step, auditor, engine)."""
    torch.manual_seed(seed)
    module, optimizer, loader, engine, loss_fn = SETUPS[setup](poisson)
    auditor = None if audit is None else PrivacyAuditor(optimizer, **audit)
    bounds, done = [], 0
    while done < steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(module(x), y).backward()
            optimizer.step()
            bounds.append(float(optimizer.max_grad_norm))
            done += 1
            if done == steps:
                break
    params = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    return params, bounds, auditor, engine


def _alarming(auditor):
    return [code for code, _, _ in auditor.problems]


# ------------------------------------------------------------------ the canaries never move the bound


@pytest.mark.parametrize("setup", ["adaclip", "ghost"])
def test_audited_training_is_the_plain_run(setup):
    plain, plain_bounds, _, _ = _run(setup, 25)
    state = torch.get_rng_state()
    audited, audited_bounds, auditor, _ = _run(setup, 25, audit={"seed": 3})
    assert audited_bounds == plain_bounds  # every bound, exactly: the count is the data's alone
    assert len(set(plain_bounds)) > 10  # and the bound did move
    assert torch.max(torch.abs(plain - audited)).item() <= 1e-6
    assert torch.equal(torch.get_rng_state(), state)  # same draws from torch's generator
    assert auditor.steps == 25 and auditor.result().n_in > 0


def test_adaclip_counts_the_batch_only_in_both_modes():
    """sample_size at the bound's update is the batch (32), never the batch plus canaries; paired mode's second
    release (the audit's own noise) leaves the first one's noisy count, so every bound is the plain run's."""
    seen = []
    original = AdaClipDPOptimizer.update_max_grad_norm

    def update(self):
        seen.append(int(self.sample_size))
        original(self)

    _, plain_bounds, _, _ = _run("adaclip", 6, poisson=False)
    AdaClipDPOptimizer.update_max_grad_norm = update
    try:
        for mode in ("one-run", "paired"):
            seen.clear()
            _, bounds, auditor, _ = _run("adaclip", 6, poisson=False, audit={"seed": 1, "mode": mode})
            assert seen == [32] * 6, mode
            assert bounds == plain_bounds, mode
    finally:
        AdaClipDPOptimizer.update_max_grad_norm = original


def test_a_failed_release_leaves_the_data_count():
    module, optimizer, loader, _, loss_fn = _adaclip(poisson=False)
    auditor = PrivacyAuditor(optimizer, seed=0)
    x, y = next(iter(loader))
    loss_fn(module(x), y).backward()

    def broken(*args, **kwargs):
        raise RuntimeError("reading failed")

    auditor.kind.read = broken
    with pytest.warns(AuditFailedWarning, match="reading failed"):
        optimizer.pre_step()  # clip, audited noise (fails), accountant, bound update
    assert int(optimizer.sample_size) == 32


# ------------------------------------------------------------------ the claim


def test_adaclip_step_claims_the_gradient_noise_in_units_of_its_bound():
    _, bounds, auditor, _ = _run("adaclip", 5, audit={"seed": 0})
    sigma_g = adjusted(SIGMA, SIGMA_U)
    assert sigma_g == pytest.approx((1 - 1 / 16) ** -0.5)
    mechanism = auditor.pipeline.claims.mechanism
    assert mechanism.noise_multiplier == pytest.approx(sigma_g, rel=1e-6)
    assert auditor.results.claim.mu_claimed == pytest.approx(1 / sigma_g, rel=1e-6)
    assert mechanism.max_grad_norm == pytest.approx(bounds[-2])  # the last step clipped at the bound before its update
    assert StepNoise(sigma_g, SIGMA_U).joint == pytest.approx(SIGMA)


def test_adaptive_ghost_claims_the_smaller_of_its_two_multipliers_and_checks_both_noises():
    """sigma_g = (sigma^-2 - (2 n / 20)^-2)^(-1/2) moves with the batch size n; the canaries claim sigma (a little
    more leak, one claim segment), the accountant check uses sigma_g and the count's n / 20."""
    _, _, auditor, _ = _run("ghost", 30, audit={"seed": 0})
    claims = auditor.pipeline.claims
    assert claims.mechanism.noise_multiplier == SIGMA and auditor.results.claim.mu_claimed == 1 / SIGMA
    assert len(auditor.record.monitor.segments) == 1
    n = len(claims.noise.module()._per_sample_gradient_norms)  # the last step's Poisson batch
    noise = claims.noise.predict()
    assert noise == StepNoise(pytest.approx((SIGMA ** -2 - (2 * n / 20) ** -2) ** -0.5), n / 20)
    assert noise.joint == pytest.approx(SIGMA)


def test_an_adaclip_optimizer_of_its_own_is_audited_and_detached_exactly():
    model = nn.Linear(4, 2)
    optimizer = AdaClipDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2, max_clipbound=10.0, min_clipbound=0.1, unclipped_num_std=2.0, max_grad_norm=1.0,
        expected_batch_size=8,
    )
    before = dict(vars(optimizer))
    auditor = PrivacyAuditor(optimizer)
    assert "add_noise" in vars(optimizer)
    auditor.detach()
    assert vars(optimizer).keys() == before.keys() and type(optimizer).add_noise is AdaClipDPOptimizer.add_noise


def test_adaclip_without_noise_is_the_finding_no_noise():
    """Noise multiplier 0 at attach: no gradient noise, a void claim, reported at the first step, not refused."""
    module, optimizer, loader, _, loss_fn = _adaclip(poisson=False)
    optimizer.noise_multiplier = 0.0
    auditor = PrivacyAuditor(optimizer, seed=0)
    x, y = next(iter(loader))
    optimizer.zero_grad()
    loss_fn(module(x), y).backward()
    with pytest.warns(PrivacyViolationWarning, match=r"no_noise: the optimizer's noise multiplier is 0 from step 1"):
        optimizer.step()
    result = auditor.result(accounting=False)
    assert result.violation and result.audit_failed is None and [f.code for f in result.findings] == ["no_noise"]


def test_noise_switched_off_mid_run_is_the_finding_no_noise():
    module, optimizer, loader, _, loss_fn = _adaclip(poisson=False)
    auditor = PrivacyAuditor(optimizer, seed=0)
    batches = iter(loader)
    for i in range(2):
        if i == 1:
            optimizer.noise_multiplier = 0.0
        x, y = next(batches)
        optimizer.zero_grad()
        loss_fn(module(x), y).backward()
        if i == 1:
            with pytest.warns(PrivacyViolationWarning, match=r"noise multiplier is 0 from step 2"):
                optimizer.step()
        else:
            optimizer.step()
    result = auditor.result(accounting=False)
    assert result.audit_failed is None and [f.code for f in result.findings] == ["no_noise"]


# ------------------------------------------------------------------ the accountant: opacus-807


@pytest.mark.parametrize("setup", ["adaclip", "ghost"])
def test_quiet_on_opacus_160_and_807_flagged(setup):
    _, _, auditor, engine = _run(setup, 60, audit={"seed": 0})
    result = auditor.result()
    assert _alarming(auditor) == [] and not result.violation
    assert engine.accountant.history[-1][0] == SIGMA  # 1.6.0 composes the sigma the run was calibrated for

    with historical_bug("opacus-807").patch():
        with pytest.warns(PrivacyViolationWarning):
            _, _, buggy, buggy_engine = _run(setup, 4, audit={"seed": 0})
    finding = next(f for f in buggy.result().findings if f.code == CODE)
    assert finding.first_step == 1  # the accountant's first entry, checked at the next step
    assert buggy_engine.accountant.history[-1][0] > SIGMA
    with pytest.raises(AssertionError, match=r"composed noise multiplier 1\.0\d+ for step 1 \(the gradient's own "
                                             r"multiplier, as Opacus 1\.1\.3-1\.5\.4 did: #807\).* noise multiplier 1 ="):
        raise AssertionError(finding.message)
    assert buggy.result().violation


def test_an_accountant_composing_more_noise_than_both_releases_is_flagged():
    """A step hook of its own composing 1.5 sigma: less than both releases leak together, a finding naming both noises."""
    module, optimizer, loader, engine, loss_fn = _adaclip(poisson=False)
    hook = optimizer.step_hook

    def composes_more(opt):
        sigma = opt.noise_multiplier
        opt.noise_multiplier = 1.5 * sigma
        try:
            hook(opt)
        finally:
            opt.noise_multiplier = sigma

    optimizer.attach_step_hook(composes_more)
    auditor = PrivacyAuditor(optimizer, accountant=engine.accountant, seed=0, on_violation=lambda result: None)
    for _, (x, y) in zip(range(3), loader):
        optimizer.zero_grad()
        loss_fn(module(x), y).backward()
        optimizer.step()
    codes = {code: message for code, message, _ in auditor.problems}
    assert list(codes) == [CODE]
    assert "composed noise multiplier 1.5 for step 1, but the step released the clipped gradient with noise " \
           "multiplier 1.033 and the unclipped count with std 2" in codes[CODE]
    assert np.isclose(engine.accountant.history[-1][0], 1.5)
