"""The correlation test on the sentinel noise: correlated and negated noise found, fresh noise quiet.

Every run uses a fixed seed, so each outcome is deterministic. For a fresh seed, a test
asserting "no crossing" on fresh noise fails with probability at most the alpha it runs
at (stated at each); a detection test fails only if a drift of several boundary widths
goes unseen (probability below 1e-6 for the draws here).
"""

import ast
import math
from pathlib import Path

import numpy as np
import pytest

from lightning_dpaudit.analysis import noise_correlation
from lightning_dpaudit.analysis.noise_correlation import RHO, NoiseCorrelation, boundary

BITS = 128


def _fresh(rng, steps):
    """Fresh Gaussian noise, each step at its own scale and each sentinel at its own (signs do not care)."""
    scales = np.exp(rng.uniform(-3.0, 3.0, size=(steps, 1))) * np.exp(rng.uniform(-1.0, 1.0, size=BITS))
    return rng.standard_normal((steps, BITS)) * scales


def _ar(rng, steps, a, lag):
    """z_t = a z_(t-lag) + sqrt(1 - a^2) fresh: correlation a with the noise `lag` steps back."""
    z = rng.standard_normal((steps, BITS))
    for t in range(lag, steps):
        z[t] = a * z[t - lag] + math.sqrt(1 - a * a) * z[t]
    return z


def _first_crossing(noise, **options):
    test = NoiseCorrelation(BITS, **options)
    for i, z in enumerate(noise):
        if test.check(z, i + 1) is not None:
            return test
    return test


def test_sums_are_the_sign_products_of_every_lag():
    rng = np.random.default_rng(1)
    for steps in (5, 512, 513, 1_300):
        noise = _fresh(rng, steps)
        noise[rng.random(noise.shape) < 0.01] = 1e-4  # below QUIET: no noise there, sign 0
        test = NoiseCorrelation(BITS, lags=512, alpha=1e-9)
        for i, z in enumerate(noise):
            test.check(z, i)
        signs = np.sign(noise) * (np.abs(noise) >= noise_correlation.QUIET)
        expected = [(signs[l:] * signs[:-l]).sum() / math.sqrt(BITS) if l < steps else 0.0 for l in range(1, 513)]
        np.testing.assert_allclose(test.sums, expected, atol=1e-4)
        assert list(test.pairs()) == [max(steps - l, 0) for l in range(1, 513)]


def test_fresh_noise_never_crosses():
    # 40 runs of 2,000 steps at alpha = 1e-6 each: a correct implementation fails with
    # probability <= 4e-5. One run of 20,000 steps at the default 0.0005: <= 0.0005.
    rng = np.random.default_rng(2)
    for _ in range(40):
        test = _first_crossing(_fresh(rng, 2_000), alpha=1e-6)
        assert test.first is None and test.evidence(0.95) is None
    test = _first_crossing(_fresh(rng, 20_000))
    assert test.first is None and test.n == 20_000
    # under fresh noise |S_T| stays well inside the boundary (here within 5 sd of 0 at every lag)
    assert np.all(np.abs(test.sums) < 5 * np.sqrt(test.pairs()))


@pytest.mark.parametrize("a,lag,within", [(0.8, 1, 50), (0.3, 1, 500), (0.5, 300, 1_000), (-0.6, 7, 100), (0.9, 512, 600)])
def test_correlation_with_a_recent_step_is_found_at_that_lag(a, lag, within):
    test = _first_crossing(_ar(np.random.default_rng(3), within, a, lag))
    assert test.first is not None
    step, earlier, found_lag = test.first
    assert found_lag == lag and step - earlier == lag and step <= within
    c = test.evidence(0.95)
    assert (c.lag, c.step, c.earlier, c.pairs) == (lag, step, earlier, step - lag)
    assert c.low <= a <= c.high and math.copysign(1, c.value) == math.copysign(1, a)
    assert c.low > 0 or c.high < 0  # the interval excludes 0 when the test has fired


def test_correlation_beyond_the_window_is_not_the_window_tests():
    test = _first_crossing(_ar(np.random.default_rng(4), 2_000, 0.9, 513), lags=512)
    assert test.first is None  # the fingerprints cover replays at any distance


def test_antithetic_noise_is_found_within_a_few_steps():
    rng = np.random.default_rng(5)
    noise = rng.standard_normal((10, BITS))
    noise[1::2] = -noise[0::2]  # every second step negates the previous one
    test = _first_crossing(noise)
    assert test.first is not None and test.first[2] == 1 and test.first[0] <= 10
    assert test.evidence(0.95).value < 0


def test_interval_holds_the_correlation_over_a_long_run():
    # at confidence 0.999 for every lag at once: a correct interval misses with probability <= 1e-3
    test = NoiseCorrelation(BITS, lags=64)
    for i, z in enumerate(_ar(np.random.default_rng(6), 3_000, 0.2, 2)):
        test.check(z, i)
    c = test.evidence(0.999)
    assert c.lag == 2 and c.low <= 0.2 <= c.high and c.high - c.low < 0.1


def test_boundary_is_the_normal_mixture_one():
    a = 1e-5
    for t in (1, 10, 1000):
        expected = math.sqrt((t + RHO) * (2 * math.log(1 / a) + math.log((t + RHO) / RHO)))
        assert float(boundary(t, a)) == pytest.approx(expected)


def test_saved_state_resumes_the_same_test_in_fixed_memory():
    rng = np.random.default_rng(7)
    noise = _ar(rng, 1_500, 0.12, 40)
    whole = NoiseCorrelation(BITS, lags=128)
    for i, z in enumerate(noise):
        whole.check(z, 10 + i)
    first = NoiseCorrelation(BITS, lags=128)
    for i, z in enumerate(noise[:700]):
        first.check(z, 10 + i)
    memory = first.memory_bytes()
    state = first.state_dict()
    assert sum(v.nbytes for v in state.values() if isinstance(v, np.ndarray)) <= 128 * (BITS + 16)
    resumed = NoiseCorrelation(BITS, lags=128)
    resumed.load_state_dict(state)
    for i, z in enumerate(noise[700:], start=700):
        resumed.check(z, 10 + i)
    assert resumed.first == whole.first and resumed.first is not None and resumed.first[2] == 40
    np.testing.assert_allclose(resumed.sums, whole.sums)
    assert resumed.memory_bytes() == memory == whole.memory_bytes()
    with pytest.raises(ValueError, match="state has 128 lags, this object 64"):
        NoiseCorrelation(BITS, lags=64).load_state_dict(state)


def test_bad_input_is_rejected_and_the_module_imports_no_torch():
    with pytest.raises(ValueError, match="alpha must be in"):
        NoiseCorrelation(alpha=0.0)
    with pytest.raises(ValueError, match="lags must be >= 1"):
        NoiseCorrelation(lags=0)
    with pytest.raises(ValueError, match=r"expected noise of shape \(128,\)"):
        NoiseCorrelation().check(np.zeros(64), 1)
    tree = ast.parse(Path(noise_correlation.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "torch" not in imported


def test_sentinels_without_noise_carry_no_correlation():
    # An un-noised tensor leaves rounding residues of one sign at its sentinels every step:
    # below QUIET they count as no noise, so the fresh rest decides (alpha 1e-6: a correct
    # implementation fails with probability <= 1e-6).
    noise = _fresh(np.random.default_rng(8), 3_000)
    noise[:, :40] = 3e-7
    test = _first_crossing(noise, alpha=1e-6)
    assert test.first is None
    counted = NoiseCorrelation(BITS, alpha=1e-6)  # the same residues counted as signs would be found at once
    assert _first_crossing(noise * np.where(np.arange(BITS) < 40, 1e4, 1.0), alpha=1e-6).first[0] < 20
    assert counted.signs(noise[0])[:40].tolist() == [0.0] * 40
