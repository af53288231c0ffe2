"""PrivacyAuditor on real Opacus optimizers: exactness, wiring, coverage of Opacus, errors."""

import warnings

import numpy as np
import pytest
import torch
from opacus import PrivacyEngine
from opacus.optimizers import DPOptimizer, DPPerLayerOptimizer

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.engine.options import DEFAULT_GRADIENT_CANARIES as K
from lightning_dpaudit.integrations.digits import DigitsCNN, digits_dataset, make_private_digits
from lightning_dpaudit.testing import train_audited

warnings.filterwarnings("ignore", message=".*Full backward hook.*")


def _train(model, optimizer, loader, steps, *, accumulate=1, loss_reduction="mean"):
    loss_fn = torch.nn.CrossEntropyLoss(reduction=loss_reduction)
    done, batches = 0, 0
    while done < steps:
        for images, labels in loader:
            loss_fn(model(images), labels).backward()
            batches += 1
            if batches % accumulate:
                continue
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done >= steps:
                return


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ------------------------------------------------------------------ exactness


@pytest.mark.parametrize("mode", ["one-run", "paired"])
def test_update_is_unchanged_and_auditor_uses_only_its_own_generator(mode):
    runs = {}
    for audited in (False, True):
        torch.manual_seed(123)
        np.random.seed(123)
        model, opt, loader, _ = make_private_digits(noise_multiplier=1.0, seed=5)
        if audited:
            auditor = PrivacyAuditor(opt, seed=0, mode=mode)
        _train(model, opt, loader, 25)
        runs[audited] = (_params(model), torch.get_rng_state(), np.random.get_state()[1].copy(), opt.generator.get_state())
    plain, audited = runs[False], runs[True]
    if mode == "one-run":  # one privatization per step: the optimizer's noise stream is untouched
        assert torch.max(torch.abs(plain[0] - audited[0])).item() <= 1e-6
        assert torch.equal(plain[3], audited[3])
    assert torch.equal(plain[1], audited[1]), "the auditor drew from torch's global generator"
    assert np.array_equal(plain[2], audited[2]), "the auditor drew from numpy's global generator"
    assert auditor.result().n_in == 25 * (K // 2 if mode == "one-run" else K)


def test_detach_restores_the_optimizer_exactly():
    model, opt, loader, _ = make_private_digits(seed=0)
    before = dict(vars(opt))
    auditor = PrivacyAuditor(opt, seed=0)
    assert "add_noise" in vars(opt)
    auditor.detach()
    assert vars(opt).keys() == before.keys()
    assert type(opt).add_noise is DPOptimizer.add_noise
    PrivacyAuditor(opt, seed=0)  # attachable again after detach


class CountingOptimizer(DPOptimizer):
    """A user subclass overriding two template steps."""

    clips = 0
    noises = 0

    def clip_and_accumulate(self):
        type(self).clips += 1
        super().clip_and_accumulate()

    def add_noise(self):
        type(self).noises += 1
        super().add_noise()


def test_user_subclass_overrides_are_kept_and_audited():
    result = train_audited(steps=30, transform=lambda opt: _as(opt, CountingOptimizer))
    # the canaries go through the subclass's own clipping at the exact checks' steps (step 1 of 30 at the default
    # cadence): one extra clip there; in between they enter as a correct clipping leaves them
    assert CountingOptimizer.clips == 31 and CountingOptimizer.noises == 30
    assert result.steps == 30 and not result.violation


def _as(opt, cls):
    opt.__class__ = cls
    return opt


# ------------------------------------------------------------------ coverage of Opacus


def test_per_layer_clipping_optimizer():
    result = train_audited(steps=150, clipping="per_layer", noise_multiplier=1.0)
    assert not result.violation
    claims = [layer.mu_claimed for layer in result.layers]
    assert max(claims) < result.mu_claimed  # each tensor sees C_l / (sigma C) < 1 / sigma
    broken = train_audited(steps=150, clipping="per_layer", transform=lambda o: _inject(o, "no-noise"))
    assert broken.violation


def _inject(opt, name):
    from lightning_dpaudit.bugs import inject_bug

    return inject_bug(opt, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_dtypes_and_loss_reductions(dtype, loss_reduction):
    result = train_audited(steps=60, dtype=dtype, loss_reduction=loss_reduction)
    assert result.n_in == result.n_out == 60 * K // 2
    assert not result.violation
    assert 0.4 < result.mu_lower_bound <= 1.15


def test_poisson_sampling_with_empty_batches():
    data = torch.utils.data.Subset(digits_dataset(), range(40))
    model = DigitsCNN()
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=1),  # sample rate 1/40: many empty batches
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=True,
    )
    auditor = PrivacyAuditor(opt, seed=0)
    sizes = []
    loss_fn = torch.nn.CrossEntropyLoss()
    for images, labels in loader:
        sizes.append(len(labels))
        opt.zero_grad()
        loss_fn(model(images), labels).backward()
        opt.step()
    assert 0 in sizes
    assert auditor.result().steps == len(sizes)


def test_gradient_accumulation_gets_one_set_of_canaries_per_noised_step():
    runs = {}
    for audited in (False, True):
        model, opt, loader, _ = make_private_digits(seed=3, poisson_sampling=False)
        auditor = PrivacyAuditor(opt, seed=0) if audited else None
        _train(model, opt, loader, 10, accumulate=2)
        runs[audited] = _params(model)
    assert torch.max(torch.abs(runs[False] - runs[True])).item() <= 1e-6
    assert auditor.result().steps == 10
    assert auditor.result().n_in == 10 * K // 2


# ------------------------------------------------------------------ results and persistence


def test_result_observations_and_state_round_trip():
    model, opt, loader, _ = make_private_digits(seed=0)
    auditor = PrivacyAuditor(opt, seed=1, module=model)
    _train(model, opt, loader, 20)
    obs = auditor.observations()
    assert set(obs) == {"step", "layer", "kind", "is_in", "value"}
    assert len(obs["value"]) == 20 * K and obs["is_in"].sum() == 20 * K // 2
    assert set(obs["kind"]) == {"dirac"}
    result = auditor.result()
    assert [layer.name for layer in result.layers][0] == "features.0.weight"
    assert result.epsilon_accountant > 0 and 0 <= result.epsilon_lower_bound < result.epsilon_accountant

    state = auditor.state_dict()
    twin = PrivacyAuditor(make_private_digits(seed=0)[1], seed=99)
    twin.load_state_dict(state)
    assert twin.result().mu_lower_bound == result.mu_lower_bound
    np.testing.assert_array_equal(twin.observations()["value"], obs["value"])
    # the canary generator resumes where it stopped
    assert np.array_equal(twin.kind.sampler.next_step().coords, auditor.kind.sampler.next_step().coords)


# ------------------------------------------------------------------ bad input


def test_errors_name_the_problem():
    model, opt, _, _ = make_private_digits(seed=0)
    with pytest.raises(TypeError, match="needs an Opacus DPOptimizer, got SGD.*make_private"):
        PrivacyAuditor(torch.optim.SGD(model.parameters(), lr=0.1))
    for kwargs, match in [
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.5}, "delta"),
        ({"confidence": 1.0}, "confidence"),
        ({"canary": "laser"}, "valid kinds are dirac, constant, random"),
        ({"mode": "twice"}, "valid modes are one-run, paired"),
        ({"estimator": "guess"}, "`estimator`: 'guess'; valid estimators are"),
        ({"estimator": "katz"}, "pure epsilon-DP"),
        ({"canaries_per_step": 1}, "canaries_per_step"),
        ({"canaries_per_step": 10**6}, "the optimizer has 9802 parameters"),
    ]:
        with pytest.raises(ValueError, match=match):
            PrivacyAuditor(opt, **kwargs)
    PrivacyAuditor(opt)
    with pytest.raises(RuntimeError, match="already attached"):
        PrivacyAuditor(opt)
    _, quiet, _, _ = make_private_digits(seed=0)
    quiet.noise_multiplier = -1.0
    with pytest.raises(ValueError, match="noise_multiplier: -1.0"):
        PrivacyAuditor(quiet)


def test_per_layer_optimizer_type_is_recognised():
    _, opt, _, _ = make_private_digits(clipping="per_layer", seed=0)
    assert isinstance(opt, DPPerLayerOptimizer)
    auditor = PrivacyAuditor(opt, seed=0)
    assert np.allclose(auditor.kind.probe.clip_bounds, opt.max_grad_norms)


# ------------------------------------------------------------------ canary kinds


@pytest.mark.parametrize("canary", ["dirac", "constant", "random"])
@pytest.mark.parametrize("moving", [True, False])
def test_canary_kinds_observe_unit_shift_and_catch_missing_noise(canary, moving):
    result, obs = train_audited(steps=80, canary=canary, moving=moving, noise_multiplier=1.0, return_observations=True)
    ins, outs = obs["value"][obs["is_in"]], obs["value"][~obs["is_in"]]
    # normalized: out ~ N(0, 1), in ~ N(1, 1); >= 80 x 153 each, so the means are within 0.1 (> 9 sd)
    assert abs(outs.mean()) < 0.1 and abs(ins.mean() - 1.0) < 0.1
    assert abs(outs.std() - 1.0) < 0.1
    assert not result.violation
    broken = train_audited(steps=40, canary=canary, moving=moving, transform=lambda o: _inject(o, "no-noise"))
    assert broken.violation


def test_canary_scale_above_the_bound_exposes_missing_clipping():
    # with canaries at exactly the clipping bound, an optimizer that does not clip looks correct to them
    # (the exact check of the clipped sum, off here, sees it on real data whatever the canaries' scale)
    at_bound = train_audited(steps=150, canary_scale=1.0, transform=lambda o: _inject(o, "no-clipping"),
                             per_sample_check_every=0)
    above = train_audited(steps=150, canary_scale=2.0, transform=lambda o: _inject(o, "no-clipping"),
                          per_sample_check_every=0)
    assert not at_bound.violation and above.violation
    exact = train_audited(steps=150, canary_scale=1.0, transform=lambda o: _inject(o, "no-clipping"))
    assert exact.violation and [f.code for f in exact.findings] == ["clipped_sum"]


def test_paired_mode_is_quiet_on_correct_opacus_and_catches_a_bug():
    result, obs = train_audited(steps=150, mode="paired", return_observations=True)
    assert not result.violation and result.n_in == result.n_out == 150 * K
    ins, outs = obs["value"][obs["is_in"]], obs["value"][~obs["is_in"]]
    assert abs(outs.mean()) < 0.05 and abs(ins.mean() - 1.0) < 0.05  # 150 x 1,024 each: the sd of a mean is 0.003
    assert train_audited(steps=60, mode="paired", transform=lambda o: _inject(o, "reused-noise")).violation


# ------------------------------------------------------------------ layer names without `module`

DIGITS_NAMES = [
    "features.0.weight", "features.0.bias", "features.2.weight", "features.2.bias",
    "classifier.1.weight", "classifier.1.bias", "classifier.3.weight", "classifier.3.bias",
]


def _global_pre_hooks():
    from torch.nn.modules import module

    return len(module._global_forward_pre_hooks)


def test_layer_names_without_module_come_from_the_grad_sample_module():
    hooks = _global_pre_hooks()
    model, opt, loader, _ = make_private_digits(seed=0)
    _inject(opt, "unnoised-layer")
    alerts = []
    auditor = PrivacyAuditor(opt, seed=0, on_violation=alerts.append)  # no module=
    assert auditor.kind.layer_names[-1] == "param7(10,)"  # before the model has run
    stranger = torch.nn.Linear(3, 2)
    stranger(torch.zeros(1, 3))  # another model's forward pass leaves the names alone
    assert auditor.kind.layer_names[-1] == "param7(10,)" and _global_pre_hooks() == hooks + 1
    _train(model, opt, loader, 60)
    assert auditor.kind.layer_names == DIGITS_NAMES and _global_pre_hooks() == hooks
    result = auditor.result(accounting=False)
    assert "classifier.3.bias" in result.violating_layers and [layer.name for layer in result.layers] == DIGITS_NAMES
    from lightning_dpaudit.analysis.results import violation_message

    assert len(alerts) == 1 and "violating: classifier.3.bias" in violation_message(alerts[0])


def _optimizer_over(model):
    return DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                       expected_batch_size=4)


def test_layer_names_when_opacus_hooks_the_model_in_place():
    from opacus import GradSampleModule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    GradSampleModule(model)  # hooks in place; the wrapper is dropped, as in Opacus's Lightning pattern
    opt = _optimizer_over(model)
    auditor = PrivacyAuditor(opt, seed=0)
    assert auditor.kind.layer_names == ["param0(64, 6)", "param1(64,)", "param2(3, 64)", "param3(3,)"]
    _train(model, opt, [(torch.randn(4, 6), torch.tensor([0, 1, 2, 0]))], 1)
    assert auditor.kind.layer_names == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_layer_names_stay_placeholders_without_opacus_hooks_and_the_watch_ends():
    hooks = _global_pre_hooks()
    model = torch.nn.Linear(300, 2)  # no GradSampleModule: nothing names these parameters
    auditor = PrivacyAuditor(_optimizer_over(model), seed=0)
    model(torch.zeros(1, 300))
    assert auditor.kind.layer_names == ["param0(2, 300)", "param1(2,)"] and _global_pre_hooks() == hooks
    model, opt, loader, _ = make_private_digits(seed=0)
    detached = PrivacyAuditor(opt, seed=0)
    detached.detach()
    model(torch.zeros(1, 1, 8, 8))  # a detached auditor stops watching at the next forward pass
    assert detached.layer_names[0] == "param0(8, 1, 3, 3)" and _global_pre_hooks() == hooks
