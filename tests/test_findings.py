"""Findings name the cause of a violation: each code on the bug it explains, none on correct runs.

Bug runs are seeded digits trainings that stop at the first alarm (deterministic). The
statistics of the codes are checked on simulated sufficient statistics drawn exactly
(sample mean and variance of Gaussians), where the false-finding rate can be counted.
"""

import math
import warnings

import numpy as np
import pytest
import torch

import lightning_dpaudit
from lightning_dpaudit.engine.auditor import PrivacyAuditor, PrivacyViolationWarning
from lightning_dpaudit.bugs import inject_bug
from lightning_dpaudit.integrations.digits import make_private_digits, train_steps
from lightning_dpaudit.analysis.findings import Evidence, diagnose, noise_interval, shift_interval
from lightning_dpaudit.analysis.monitor import POOLED
from lightning_dpaudit.analysis.results import Finding, violation_message
from lightning_dpaudit.testing import PrivacyAuditFailure, audit_optimizer

NAMES = tuple(f"t{i}" for i in range(8))
# observations per side and tensor, shaped like a digits run of about 30 steps
SIZES = np.array([500, 50, 4000, 200, 4000, 400, 4000, 100])


def moments(rng, *, noise=None, shift=None, sizes=SIZES, sigma=1.0):
    """Exact draws of (count, sum, sum of squares) per tensor and side: out ~ N(0, (r sigma)^2), in ~ N(d, (r sigma)^2).

    noise[l] = r and shift[l] = d per tensor (1 by default): the sample mean and the
    sample variance of Gaussians are independent, N(mean, s^2 / n) and s^2 chi2(n-1) / (n-1).
    """
    t = len(sizes)
    noise = np.ones(t) if noise is None else np.asarray(noise, float)
    shift = np.ones(t) if shift is None else np.asarray(shift, float)
    out = np.zeros((t, 2, 3))
    for side, centre in ((0, np.zeros(t)), (1, shift)):
        s = noise * sigma
        mean = rng.normal(centre, s / np.sqrt(sizes))
        squares = s**2 * rng.chisquare(sizes - 1) + sizes * mean**2
        out[:, side] = np.stack([sizes, sizes * mean, squares], axis=-1)
    return out


def evidence(m, *, sigma=1.0, names=NAMES, **options):
    options.setdefault("alarms", {POOLED: 5})
    options.setdefault("mu_anytime", {POOLED: 1.2 / sigma})
    return Evidence(
        moments=m, claims=np.full(len(names), 1 / sigma), names=names, confidence=0.95,
        noise_multiplier=sigma, mu_claimed=1 / sigma, batch_size=64, **options,
    )


def codes(findings):
    return tuple(f.code for f in findings)


# ---------------------------------------------------------------------- the statistics


def test_correct_statistics_give_no_finding_at_the_audits_confidence():
    # 500 simulated correct runs, diagnosed as if the alarm had fired. Each of the 18
    # interval tests fires on one side only, with probability 0.05 / 18 / 2, so at most
    # 2.5% of runs show a finding (about 0.8% measured over 20,000 runs: Bonferroni is
    # conservative here); more than 12 of 500 would mean the budget is not split.
    rng = np.random.default_rng(0)
    fired = 0
    for _ in range(500):
        found = codes(diagnose(evidence(moments(rng, sigma=2.0), sigma=2.0), violation=True))
        fired += found != ("general",)
    assert fired <= 12, fired


def test_noise_interval_is_the_chi_square_interval():
    rng = np.random.default_rng(1)
    values = rng.normal(0.0, 0.5, 300)
    m = np.zeros((1, 2, 3))
    m[0, 0] = len(values), values.sum(), (values**2).sum()
    iv = noise_interval(m, np.array([2.0]), 0.05)  # claimed mu 2: std 0.5 is the claim
    assert iv.value == pytest.approx(2.0 * values.std(ddof=1))
    from scipy.stats import chi2

    assert iv.high == pytest.approx(iv.value * math.sqrt(299 / chi2.ppf(0.025, 299)))
    assert iv.low == pytest.approx(iv.value * math.sqrt(299 / chi2.ppf(0.975, 299)))
    assert iv.low < 1.0 < iv.high
    assert noise_interval(m[:, :, :] * 0, np.array([2.0]), 0.05) is None  # no observations, no interval


def test_shift_interval_is_welchs():
    rng = np.random.default_rng(2)
    ins, outs = rng.normal(2.0, 1.0, 40), rng.normal(0.0, 3.0, 90)
    m = np.zeros((1, 2, 3))
    m[0, 1] = len(ins), ins.sum(), (ins**2).sum()
    m[0, 0] = len(outs), outs.sum(), (outs**2).sum()
    from scipy.stats import ttest_ind

    iv = shift_interval(m, 0.05)
    ci = ttest_ind(ins, outs, equal_var=False).confidence_interval(0.95)
    assert (iv.value, iv.low, iv.high) == pytest.approx((ins.mean() - outs.mean(), ci.low, ci.high))


@pytest.mark.parametrize(
    "ratio,sigma,expected",
    [
        (1 / 64, 1.0, "about 1/64, one over the expected batch size: calibrated to C/B"),
        (0.5, 1.0, "half the claimed noise"),
        (0.0, 1.0, "no noise reaches the release"),
        (2.5 / 3.0, 3.0, "applied, 3 claimed"),
        (1 / 3.0, 3.0, "noise std C: the noise multiplier left out?"),
        (0.3, 0.3, "the variance used as the std?"),
    ],
)
def test_noise_hints(ratio, sigma, expected):
    rng = np.random.default_rng(3)
    m = moments(rng, noise=np.full(8, ratio), sigma=sigma)
    (finding,) = diagnose(evidence(m, sigma=sigma), violation=True)
    assert finding.code == "noise_scale" and expected in finding.message
    assert finding.measured == pytest.approx(ratio, rel=0.05, abs=1e-12) and finding.claimed == 1.0


def test_a_fault_in_every_tensor_is_not_called_a_layer():
    # noise 0.85 everywhere: the small tensors alone cannot show it, yet it is global
    rng = np.random.default_rng(4)
    (finding,) = diagnose(evidence(moments(rng, noise=np.full(8, 0.85))), violation=True)
    assert finding.code == "noise_scale" and finding.layers == ()
    assert finding.measured == pytest.approx(0.85, abs=0.02) and "applied, 1 claimed" in finding.message


def test_clipping_confined_to_one_tensor_is_named():
    rng = np.random.default_rng(5)
    shift = np.ones(8)
    shift[2] = 2.0
    (finding,) = diagnose(evidence(moments(rng, shift=shift)), violation=True, first_violation_step=5)
    assert finding.code == "layer" and finding.layers == ("t2",)
    assert "in-canaries move the release by more than C in 1 of 8 tensors: t2 1.98 C (95% CI" in finding.message
    assert "the other 7 clip" in finding.message
    assert finding.measured == pytest.approx(2.0, abs=0.1)


def test_an_alarm_confined_to_one_tensor_is_named_when_moments_agree():
    rng = np.random.default_rng(6)
    ev = evidence(moments(rng), alarms={6: 40}, mu_anytime={6: 1.1, POOLED: 0.9})
    (finding,) = diagnose(ev, violation=True, first_violation_step=40)
    assert finding.code == "layer" and finding.layers == ("t6",) and finding.first_step == 40
    assert finding.message.startswith("the alarm fired only in t6 mu >= 1.100 vs 1.000")


def test_general_when_nothing_explains_the_violation():
    rng = np.random.default_rng(7)
    (finding,) = diagnose(evidence(moments(rng)), violation=True, first_violation_step=12)
    assert (finding.code, finding.first_step, finding.measured, finding.claimed) == ("general", 12, 1.2, 1.0)
    assert "exceeds the claimed 1.000 in the pool" in finding.message


def test_input_canaries_get_only_noise_repeats_or_general():
    rng = np.random.default_rng(8)
    broken = moments(rng, noise=np.full(8, 0.01), shift=np.full(8, 2.0))  # would be noise_scale and clipping
    (finding,) = diagnose(evidence(broken, gradient=False), violation=True)
    assert finding.code == "general" and "canary='dirac'" in finding.message
    repeated = diagnose(evidence(broken, gradient=False, first_repeat=(9, 4), repeats=2), violation=True)
    assert codes(repeated) == ("noise_repeats",) and "step 9 repeats step 4's (2 repeating steps)" in repeated[0].message


def test_no_violation_no_finding_but_other_checks_come_first():
    rng = np.random.default_rng(9)
    broken = evidence(moments(rng, noise=np.full(8, 0.01)))
    assert diagnose(broken, violation=False) == ()
    setup = Finding(code="ddp_setup", message="each rank adds its own noise", layers=())
    assert diagnose(broken, violation=False, extra=[setup]) == (setup,)
    assert codes(diagnose(broken, violation=True, extra=[setup])) == ("ddp_setup", "noise_scale")
    # another check's finding explains the violation: no "general" beside it
    assert codes(diagnose(evidence(moments(rng)), violation=True, extra=[setup])) == ("ddp_setup",)


# ---------------------------------------------------------------------- the bug zoo


def test_batch_sensitivity_is_noise_scale_one_over_the_batch():
    result = audit_optimizer(bug="mean-sensitivity", steps=100, expect_violation=True)
    (finding,) = result.findings
    assert finding.code == "noise_scale" and finding.first_step == result.first_violation_step == 1
    assert finding.measured == pytest.approx(1 / 61, rel=0.1)  # the digits loader's expected batch size is 61
    assert "x claimed (95% CI" in finding.message and "1/61, one over the expected batch size" in finding.message


def test_missing_clipping_is_clipping():
    result = audit_optimizer(bug="no-clipping", steps=100, expect_violation=True, per_sample_check_every=0)
    (finding,) = result.findings  # the canaries' reading alone (the exact check: below)
    assert finding.code == "clipping" and finding.claimed == 1.0
    assert finding.measured == pytest.approx(2.0, abs=0.25)  # canaries planted at 2 C pass whole
    assert "the canary norm above C (2 C planted) reaches the update" in finding.message


def test_reused_noise_is_noise_repeats_naming_both_steps():
    result = audit_optimizer(bug="reused-noise", steps=100, expect_violation=True)
    (finding,) = result.findings
    assert (finding.code, finding.first_step, finding.measured) == ("noise_repeats", 2, 1.0)
    assert "the noise of step 2 repeats step 1's" in finding.message
    assert "secure_mode=True" in finding.message and "noise_generator" in finding.message


def test_unnoised_layer_is_layer_naming_the_tensor():
    result = audit_optimizer(bug="unnoised-layer", steps=1000, expect_violation=True)
    (finding,) = result.findings
    assert finding.code == "layer" and finding.layers == ("classifier.3.bias",)
    assert finding.measured == 0.0 and finding.first_step == result.first_violation_step
    assert "classifier.3.bias 0 x claimed" in finding.message and "the other 7 agree with the claim" in finding.message


@pytest.mark.parametrize(
    "bug,sigma,expected",
    [
        ("batch-clipping", 1.0, "clipping"),
        ("no-noise", 1.0, "noise_scale"),
        ("wrong-noise", 3.0, "noise_scale"),
        ("few-seeds", 1.0, "noise_repeats"),
    ],
)
def test_the_rest_of_the_zoo(bug, sigma, expected):
    result = audit_optimizer(bug=bug, steps=1000, noise_multiplier=sigma, expect_violation=True,
                             per_sample_check_every=0)
    assert codes(result.findings) == (expected,)


@pytest.mark.parametrize("bug", ["no-clipping", "batch-clipping"])
def test_clipping_bugs_are_also_a_certainty_of_the_clipped_sum(bug):
    """The exact check clips each real example itself at step 1: the optimizer's sum differs; at the same step the
    canaries' pass through the optimizer's clipping is not a correct clipping; the canaries' moments show it too."""
    result = audit_optimizer(bug=bug, steps=20, expect_violation=True)
    assert codes(result.findings) == ("clipped_sum", "canary_clipping", "clipping")
    exact, canaries = result.findings[:2]
    assert exact.first_step == 1 and "each example's gradient clipped to C" in exact.message
    assert canaries.first_step == 1 and "is not clipping to C in `features.0.weight`" in canaries.message


def test_paired_mode_reads_noise_and_clipping_too():
    noisy = audit_optimizer(bug="mean-sensitivity", steps=100, mode="paired", expect_violation=True)
    assert codes(noisy.findings) == ("noise_scale",)
    unclipped = audit_optimizer(bug="no-clipping", steps=100, mode="paired", expect_violation=True,
                                per_sample_check_every=0)
    assert codes(unclipped.findings) == ("clipping",)


def test_input_canaries_name_a_noise_repeat():
    result = audit_optimizer(bug="reused-noise", steps=100, canary="mislabeled", canaries_per_step=16, expect_violation=True)
    assert codes(result.findings) == ("noise_repeats",)


def test_alert_and_failure_messages_carry_the_findings():
    result = audit_optimizer(bug="mean-sensitivity", steps=100, expect_violation=True)
    first, cause = violation_message(result).splitlines()
    assert first.startswith("DP AUDIT VIOLATION found at step ") and "(first violating step 1): noise_scale: noise std 0.0" in first
    assert first.index("noise_scale") < first.index("; epsilon >= ")  # the verdict and the cause first
    assert "; epsilon >= " in first and "; per-step mu lower bound" in first  # the numbers after
    assert cause.startswith("  - noise_scale: noise std 0.0") and "calibrated to C/B" in cause
    with pytest.raises(PrivacyAuditFailure, match=r"leaks more than it claims: .*\n  - clipped_sum: .*\n  - canary_clipping: "
                                                  r".*\n  - clipping: in-canaries move the release"):
        audit_optimizer(bug="no-clipping", steps=20)
    with pytest.warns(PrivacyViolationWarning, match=r"violating: classifier.3.bias\n  - layer: noise std below the claim"):
        audited(0, 60, bug="unnoised-layer", on_violation=None)
    assert lightning_dpaudit.Finding is Finding


# ---------------------------------------------------------------------- correct runs


def audited(seed: int, steps: int, *, bug=None, clipping="flat", **options) -> PrivacyAuditor:
    """An auditor after `steps` digits steps of Opacus (with `bug` injected); it alerts through `on_violation`."""
    model, optimizer, loader, _ = make_private_digits(seed=seed, clipping=clipping)
    if bug is not None:
        inject_bug(optimizer, bug)
    options.setdefault("on_violation", lambda result: None)
    auditor = PrivacyAuditor(optimizer, module=model, seed=seed, **options)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Full backward hook.*")
        train_steps(model, optimizer, loader, steps, loss_fn=torch.nn.CrossEntropyLoss())
    return auditor


@pytest.mark.parametrize("seed,options", [(0, {}), (1, {}), (2, {"clipping": "per_layer"}), (3, {"mode": "paired"})])
def test_correct_opacus_has_no_finding(seed, options):
    # No alarm, so no findings; and diagnosed as if it had alarmed, no code but "general"
    # fires. Each seed fails with probability <= 2.5% (the simulated rate is about 0.8%).
    auditor = audited(seed, 100, **options)
    result = auditor.result(accounting=False)
    assert not result.violation and result.findings == ()
    forced = diagnose(auditor.results.evidence(auditor.record, auditor.kind.layer_names, {POOLED: 1.1}), violation=True)
    assert codes(forced) == ("general",), [f.message for f in forced]


def test_correlated_noise_is_named_with_its_lag_steps_and_interval_and_no_interval_test_runs():
    from lightning_dpaudit.analysis.noise_correlation import Correlation

    c = Correlation(lag=3, step=40, earlier=37, pairs=37, sign=-0.4, value=-0.59, low=-0.8, high=-0.3, confidence=0.95)
    rng = np.random.default_rng(3)
    low_noise = moments(rng, noise=[0.5] * 8)  # would be a noise_scale finding with independent noise
    assert codes(diagnose(evidence(low_noise), violation=True)) == ("noise_scale",)
    (found,) = diagnose(evidence(low_noise, correlation=c), violation=True)
    assert (found.code, found.first_step, found.measured, found.claimed) == ("noise_correlated", 40, -0.59, 0.0)
    assert found.message.startswith("the noise of step 40 is correlated with step 37's, 3 steps back: correlation "
                                    "-0.59 (95% CI -0.80 to -0.30) over 37 pairs of steps 3 apart")
    assert "negated and reused (antithetic noise" in found.message
    assert diagnose(evidence(low_noise, correlation=c), violation=False) == ()
    repeat = diagnose(evidence(low_noise, first_repeat=(9, 4), repeats=1, first_negated=True), violation=True)[0]
    assert repeat.code == "noise_repeats" and "the noise of step 9 repeats the negation of step 4's" in repeat.message
