"""Tests for the bug zoo: each bug's effect on one optimizer step, and what injection preserves.

Tiny models: ``y = a.x + b.x`` (two weight tensors of D coordinates, no bias) and loss
``sum(y)`` or ``mean(y)``, so the per-sample gradient of both tensors is exactly the
input row. After ``step()`` Opacus leaves ``p.summed_grad`` in place, so the noise
is exactly ``p.grad * scale - p.summed_grad``. Statistical checks use fixed seeds
(deterministic runs); the stated false-failure rates are for a fresh seed.
"""

import pytest
import torch
from opacus import GradSampleModule, PrivacyEngine
from opacus.optimizers import DPOptimizer, DPPerLayerOptimizer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dpaudit.bugs import BUGS, inject_bug, list_bugs

NAMES = [
    "batch-clipping", "few-seeds", "wrong-noise", "mean-sensitivity", "no-noise",
    "no-clipping", "reused-noise", "unnoised-layer", "half-noise-last-layer", "reseeded-resume", "reseed-each-epoch",
    "antithetic-noise", "correlated-noise",
]
OPTIONS = {"reseed-each-epoch": {"epoch_steps": 3}}  # make() builds no accountant hook to read the epoch from
D = 3000  # coordinates per parameter tensor


class TwoWeights(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a = nn.Linear(d, 1, bias=False)
        self.b = nn.Linear(d, 1, bias=False)

    def forward(self, x):
        return self.a(x) + self.b(x)


def make(nm=1.0, c=1.0, d=D, reduction="sum", batch=4, per_layer=False, seed=0):
    model = GradSampleModule(TwoWeights(d), loss_reduction=reduction)
    cls, norm = (DPPerLayerOptimizer, [c, c]) if per_layer else (DPOptimizer, c)
    opt = cls(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=nm, max_grad_norm=norm,
              expected_batch_size=batch, loss_reduction=reduction, generator=torch.Generator().manual_seed(seed))
    return model, opt


def step(model, opt, x):
    """One step on inputs ``x`` (per-sample gradients = rows of x); returns the noise per tensor."""
    opt.zero_grad()
    out = model(x)
    (out.sum() if opt.loss_reduction == "sum" else out.mean()).backward()
    opt.step()
    scale = opt.expected_batch_size if opt.loss_reduction == "mean" else 1
    return [(p.grad.flatten() * scale - p.summed_grad.flatten()) for p in opt.params]


def zeros(n=4, d=D):
    return torch.zeros(n, d)


def clipped_sum(x, c):
    """Correct flat clipping for TwoWeights: each sample's joint norm is sqrt(2)*|row|."""
    norms = x.norm(dim=1) * 2 ** 0.5
    return (x * (c / (norms + 1e-6)).clamp(max=1.0)[:, None]).sum(0)


# Std checks: the sample std of m >= 3000 i.i.d. normals has relative sd <= 1/sqrt(2m) ~ 1.3%;
# a 6% tolerance is > 4.6 sd, so a correct implementation fails with probability < 1e-5.
def assert_std(noise, expected, rel=0.06):
    assert noise.std().item() == pytest.approx(expected, rel=rel)


# ---- the API ---------------------------------------------------------------------------

def test_registry():
    assert list_bugs() == NAMES == list(BUGS)
    assert all(isinstance(v, str) and v and "\n" not in v for v in BUGS.values())


def test_unknown_bug_name():
    _, opt = make()
    with pytest.raises(ValueError, match="unknown bug 'nope'.*valid names: batch-clipping"):
        inject_bug(opt, "nope")
    assert type(opt) is DPOptimizer


def test_not_a_dp_optimizer():
    plain = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(TypeError, match="PrivacyEngine.make_private"):
        inject_bug(plain, "no-noise")


def test_bad_options():
    _, opt = make()
    with pytest.raises(TypeError, match="unknown option"):
        inject_bug(opt, "no-noise", num_seeds=3)
    with pytest.raises(ValueError, match="out of range"):
        inject_bug(opt, "unnoised-layer", layer_index=2)
    assert type(opt) is DPOptimizer  # a failed injection leaves the class alone


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_injection_preserves_claims_and_class(name, per_layer):
    model, opt = make(nm=3.0, c=0.5, per_layer=per_layer, reduction="mean")
    hook = lambda o: None  # noqa: E731
    opt.attach_step_hook(hook)
    base, gen, before = type(opt), opt.generator, dict(vars(opt))
    assert inject_bug(opt, name, **OPTIONS.get(name, {})) is opt
    assert isinstance(opt, base) and type(opt) is not base
    assert type(opt).__name__.endswith(base.__name__) and opt.injected_bug == name
    step(model, opt, torch.randn(4, D))
    for key, value in before.items():  # every original attribute, incl. the claims, is kept
        assert getattr(opt, key) is value, key
    assert opt.noise_multiplier == 3.0 and opt.step_hook is hook and opt.generator is gen
    if per_layer:
        assert opt.max_grad_norms == [0.5, 0.5]


@pytest.mark.parametrize("name", NAMES)
def test_accountant_keeps_using_the_claim(name):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 6), torch.randint(0, 2, (40,)))
    engine = PrivacyEngine()
    net = nn.Linear(6, 2)
    model, opt, loader = engine.make_private(module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                                             data_loader=DataLoader(data, batch_size=10),
                                             noise_multiplier=2.0, max_grad_norm=1.0)
    inject_bug(opt, name)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert engine.accountant.history == [(2.0, 0.25, 4)]


@pytest.mark.parametrize("name", ["batch-clipping", "no-clipping", "no-noise"])
def test_processed_flags_still_enforced(name):
    model, opt = make()
    inject_bug(opt, name)
    step(model, opt, torch.randn(4, D))
    model(torch.randn(4, D)).sum().backward()
    with pytest.raises(ValueError, match="haven't been cleared"):
        opt.step()


def test_user_subclass_keeps_its_behaviour():
    class Mine(DPOptimizer):
        def scale_grad(self):
            super().scale_grad()
            self.scaled = getattr(self, "scaled", 0) + 1

    model = GradSampleModule(TwoWeights(5))
    opt = Mine(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=1.0, max_grad_norm=1.0,
               expected_batch_size=4)
    inject_bug(opt, "no-noise")
    assert isinstance(opt, Mine) and type(opt).__name__ == "NoNoiseMine"
    step(model, opt, torch.randn(4, 5))
    assert opt.scaled == 1


# ---- each bug's effect -----------------------------------------------------------------

def test_batch_clipping_does_not_clip_single_examples():
    model, opt = make(c=1.0)
    inject_bug(opt, "batch-clipping")
    x = zeros(2)
    x[0, 0], x[1, 0] = 10.0, -9.9  # one gradient of joint norm 10*sqrt(2) C; batch mean small
    step(model, opt, x)
    for p in opt.params:
        assert torch.allclose(p.summed_grad.flatten(), x.sum(0))  # 0.1 e1: the outlier went through
        assert not torch.allclose(p.summed_grad.flatten(), clipped_sum(x, 1.0))  # correct: 0


def test_batch_clipping_clips_the_mean_jointly():
    model, opt = make(c=1.0)
    inject_bug(opt, "batch-clipping")
    x = zeros(4)
    x[0, 0] = 10.0  # mean 2.5 e1 has joint norm 2.5*sqrt(2) -> scaled to 1, then times n = 4
    step(model, opt, x)  # (correct clipping would give joint norm 1)
    joint = torch.cat([p.summed_grad.flatten() for p in opt.params])
    assert joint.norm().item() == pytest.approx(4.0, rel=1e-5)
    assert opt.params[0].summed_grad.flatten()[0].item() == pytest.approx(4 / 2 ** 0.5, rel=1e-5)


def test_batch_clipping_empty_batch():
    model, opt = make()
    inject_bug(opt, "batch-clipping")
    step(model, opt, zeros(0))
    assert all(torch.equal(p.summed_grad, torch.zeros_like(p.summed_grad)) for p in opt.params)
    assert all(torch.isfinite(p.grad).all() for p in opt.params)


def test_no_clipping_sums_raw_gradients():
    model, opt = make(c=1.0, nm=0.5)
    inject_bug(opt, "no-clipping")
    x = torch.randn(4, D)  # per-sample norms ~ sqrt(2 D) >> C
    noise = step(model, opt, x)
    for p in opt.params:
        assert torch.allclose(p.summed_grad.flatten(), x.sum(0), atol=1e-5)
    assert_std(torch.cat(noise), 0.5)  # the noise itself is correct


def test_no_noise_grad_is_scaled_clipped_sum():
    x = torch.randn(4, 10)
    model, opt = make(c=1.0, nm=2.0, d=10, reduction="mean", batch=4)
    inject_bug(opt, "no-noise")
    step(model, opt, x)
    for p in opt.params:
        assert torch.allclose(p.grad.flatten(), clipped_sum(x, 1.0) / 4, atol=1e-6)


def test_wrong_noise_applies_the_smaller_multiplier():
    model, opt = make(nm=3.0, c=0.5)
    inject_bug(opt, "wrong-noise")
    assert opt.applied_noise_multiplier == pytest.approx(2.5) and opt.noise_multiplier == 3.0
    noise = torch.cat(step(model, opt, zeros()))
    assert_std(noise, 2.5 * 0.5)  # 1.25, while the claim is 1.5 (20% away: > 15 sd)
    model, opt = make(nm=3.0, c=0.5)
    inject_bug(opt, "wrong-noise", applied_noise_multiplier=0.4)
    assert_std(torch.cat(step(model, opt, zeros())), 0.2)


def test_mean_sensitivity_divides_noise_by_batch_size():
    model, opt = make(nm=1.0, c=1.0, batch=50, reduction="mean")
    inject_bug(opt, "mean-sensitivity")
    assert_std(torch.cat(step(model, opt, zeros(50))), 1.0 / 50)


def test_few_seeds_repeats_noise():
    model, opt = make(nm=1.0, d=4)
    inject_bug(opt, "few-seeds", seed_chooser_seed=0)
    seen = {tuple(torch.cat(step(model, opt, zeros(2, 4))).tolist()) for _ in range(300)}
    # 300 draws from 100 seeds: E[distinct] = 95.1, sd ~ 1.5; P(< 85) < 1e-9
    assert 85 <= len(seen) <= 100
    model, opt = make(nm=1.0, d=4)  # the correct optimizer never repeats
    assert len({tuple(torch.cat(step(model, opt, zeros(2, 4))).tolist()) for _ in range(300)}) == 300


def test_few_seeds_noise_is_seeded_normal():
    model, opt = make(nm=1.0, c=2.0, d=D, seed=5)
    inject_bug(opt, "few-seeds", num_seeds=1)  # the only seed is 0
    noise = step(model, opt, zeros())
    g = torch.Generator().manual_seed(0)
    expected = [torch.normal(0, 2.0, (1, D), generator=g).flatten() for _ in range(2)]
    assert all(torch.equal(n, e) for n, e in zip(noise, expected))


def test_reused_noise_is_identical_across_steps():
    model, opt = make(nm=1.0, c=1.0)
    inject_bug(opt, "reused-noise")
    first = step(model, opt, torch.randn(4, D))
    step(model, opt, torch.randn(3, D))
    third = step(model, opt, zeros())
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(first, third))
    assert_std(torch.cat(first), 1.0)
    model, opt = make(nm=1.0, c=1.0)  # the correct optimizer draws fresh noise
    assert not torch.allclose(step(model, opt, zeros())[0], step(model, opt, zeros())[0])


@pytest.mark.parametrize("index", [-1, 0])
def test_unnoised_layer(index):
    model, opt = make(nm=2.0, c=1.0)
    inject_bug(opt, "unnoised-layer", **({} if index == -1 else {"layer_index": index}))
    noise = step(model, opt, zeros())
    assert torch.equal(noise[index], torch.zeros(D))
    assert_std(noise[1 + index], 2.0)  # the other tensor is noised correctly


def test_half_noise_last_layer():
    model, opt = make(nm=2.0, c=1.0)
    inject_bug(opt, "half-noise-last-layer")
    first, last = step(model, opt, zeros())
    assert_std(first, 2.0)
    assert_std(last, 1.0)


def test_clipping_bugs_see_accumulated_batches():
    # Two backward passes before one step: p.grad_sample is a list of two tensors.
    model, opt = make(c=100.0)
    inject_bug(opt, "batch-clipping")
    x1, x2 = torch.randn(3, D) * 0.01, torch.randn(2, D) * 0.01
    opt.zero_grad()
    model(x1).sum().backward()
    model(x2).sum().backward()
    assert isinstance(opt.params[0].grad_sample, list) and opt.accumulated_iterations == 2
    opt.step()
    assert torch.allclose(opt.params[0].summed_grad.flatten(), torch.cat([x1, x2]).sum(0), atol=1e-6)


def test_clipping_bugs_refuse_ghost_clipping():
    from opacus.optimizers import DPOptimizerFastGradientClipping

    opt = DPOptimizerFastGradientClipping(torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1),
                                          noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)
    with pytest.raises(TypeError, match="per-sample gradients"):
        inject_bug(opt, "no-clipping")
    assert isinstance(inject_bug(opt, "no-noise"), DPOptimizerFastGradientClipping)


def _noises(model, opt, steps, d=D):
    return [torch.cat(step(model, opt, zeros(2, d))) for _ in range(steps)]


def test_reseeded_resume_replays_the_first_steps_after_the_resume():
    model, opt = make(nm=1.0, c=1.0)
    inject_bug(opt, "reseeded-resume", resume_at=3)
    noise = _noises(model, opt, 6)
    assert [torch.equal(noise[i], noise[i + 3]) for i in range(3)] == [True, True, True]
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[1], noise[2])
    assert_std(torch.cat(noise[:3]), 1.0)  # each step's noise alone looks right
    model, opt = make(nm=1.0, c=1.0, d=4)
    inject_bug(opt, "reseeded-resume")  # default: a resume after 300 steps
    noise = _noises(model, opt, 302, d=4)
    assert torch.equal(noise[300], noise[0]) and torch.equal(noise[301], noise[1])
    assert len({tuple(n.tolist()) for n in noise[:300]}) == 300
    with pytest.raises(ValueError, match="resume_at must be >= 1"):
        inject_bug(make()[1], "reseeded-resume", resume_at=0)


def test_antithetic_noise_negates_every_second_step():
    model, opt = make(nm=1.0, c=1.0)
    inject_bug(opt, "antithetic-noise")
    noise = _noises(model, opt, 6)
    assert all(torch.equal(noise[i + 1], -noise[i]) for i in (0, 2, 4))
    assert not torch.equal(noise[2].abs(), noise[0].abs()) and not torch.equal(noise[4].abs(), noise[2].abs())
    assert_std(torch.cat(noise), 1.0)  # each step's noise alone looks right


# Correlation checks: the sample correlation of m = 6000 pairs has sd <= 1/sqrt(m) ~ 0.013;
# a 0.06 tolerance is > 4.6 sd, so a correct bug fails with probability < 1e-5.
def _correlation(a, b):
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


@pytest.mark.parametrize("correlation,lag", [(0.8, 1), (0.3, 1), (-0.5, 3)])
def test_correlated_noise_has_the_right_size_and_correlation(correlation, lag):
    model, opt = make(nm=2.0, c=1.0)
    inject_bug(opt, "correlated-noise", **({} if (correlation, lag) == (0.8, 1) else {"correlation": correlation, "lag": lag}))
    noise = _noises(model, opt, lag + 4)
    assert_std(torch.cat(noise), 2.0)
    for t in range(lag, lag + 4):
        assert _correlation(noise[t], noise[t - lag]) == pytest.approx(correlation, abs=0.06)
    if lag > 1:
        assert abs(_correlation(noise[lag + 1], noise[lag])) < 0.06  # only `lag` steps back
    with pytest.raises(ValueError, match="`correlation`: 1.5"):
        inject_bug(make()[1], "correlated-noise", correlation=1.5)
    with pytest.raises(ValueError, match="`lag`: 0"):
        inject_bug(make()[1], "correlated-noise", lag=0)


def test_reseed_each_epoch_replays_the_first_epoch():
    model, opt = make(nm=1.0, c=1.0)
    inject_bug(opt, "reseed-each-epoch", epoch_steps=2)
    noise = _noises(model, opt, 6)
    assert all(torch.equal(noise[i], noise[i % 2]) for i in range(6)) and not torch.equal(noise[0], noise[1])
    assert_std(torch.cat(noise[:2]), 1.0)


def test_reseed_each_epoch_reads_the_epoch_from_make_private():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 6), torch.randint(0, 2, (40,)))
    net = nn.Linear(6, 2)
    model, opt, loader = PrivacyEngine().make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.0), data_loader=DataLoader(data, batch_size=10),
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
    )
    inject_bug(opt, "reseed-each-epoch")
    assert opt.epoch_steps == 4 == len(loader)
    noise = []
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            noise.append(torch.cat([(p.grad * 10 - p.summed_grad).flatten() for p in opt.params]))
    assert all(torch.allclose(noise[i], noise[i + 4], atol=1e-6) for i in range(4))
    assert not torch.allclose(noise[0], noise[1])
    with pytest.raises(ValueError, match="needs the steps per epoch"):
        inject_bug(make()[1], "reseed-each-epoch")
