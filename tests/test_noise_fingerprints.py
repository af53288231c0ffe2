"""Sign fingerprints of the sentinel noise: replays found at any distance, no false alarms.

Under fresh noise a run reports a match with probability at most `alpha` (1e-6 here), so
each test that asserts "no match" on fresh Gaussian noise fails on a correct
implementation with probability at most 1e-6 (and never with the fixed seeds).
"""

import ast
import math
import pickle
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from lightning_dpaudit.analysis import noise_fingerprints
from lightning_dpaudit.analysis.noise_fingerprints import NoiseFingerprints

BITS = 128


def _fresh(rng, steps, bits=BITS):
    """Fresh Gaussian noise, each step at its own scale (the scale may be anything)."""
    scales = np.exp(rng.uniform(-5.0, 3.0, size=(steps, 1)))
    return (rng.standard_normal((steps, bits)) * scales).astype(np.float32)


def _replay(rng, noise, scale, rel=1e-7):
    """`noise` reused at another scale, with tiny float perturbations."""
    replay = scale * noise.astype(np.float64) * (1.0 + rel * rng.standard_normal(noise.shape))
    return (replay + rel * np.abs(scale) * np.std(noise) * rng.standard_normal(noise.shape)).astype(np.float32)


def test_fresh_noise_never_matches_over_50000_steps():
    # False-failure rate at most alpha = 1e-6 (the union bound in the module).
    rng = np.random.default_rng(11)
    noise = _fresh(rng, 50_000)
    fps = NoiseFingerprints()
    results = [fps.check(noise[i], i) for i in range(len(noise))]
    assert results.count(None) == len(noise)
    assert fps.matches == 0 and fps.first_repeat is None and fps.last_repeat is None
    assert len(fps) == 50_000


def test_replays_700_and_5000_steps_back_are_found():
    rng = np.random.default_rng(12)
    noise = _fresh(rng, 6_000)
    t0 = 321
    noise[t0 + 700] = _replay(rng, noise[t0], 2.5)
    noise[t0 + 5000] = _replay(rng, noise[t0], 0.01)
    fps = NoiseFingerprints()
    first = 1000  # step labels need not start at 0
    results = {first + i: fps.check(noise[i], first + i) for i in range(len(noise))}
    found = {step: earlier for step, earlier in results.items() if earlier is not None}
    # the second replay repeats both t0 and t0 + 700: the earliest is reported
    assert found == {first + t0 + 700: first + t0, first + t0 + 5000: first + t0}
    assert fps.matches == 2
    assert fps.first_repeat == (first + t0 + 700, first + t0)
    assert fps.last_repeat == (first + t0 + 5000, first + t0)


def test_replays_of_steps_before_a_checkpoint_are_found_after_loading():
    rng = np.random.default_rng(13)
    noise = _fresh(rng, 4_000)
    steps = np.concatenate([np.arange(0, 1500), np.arange(2000, 3500), np.arange(3600, 4600)])
    before = NoiseFingerprints()
    for i in range(3000):
        assert before.check(noise[i], int(steps[i])) is None
    state = pickle.loads(pickle.dumps(before.state_dict()))  # as a checkpoint would

    after = NoiseFingerprints()
    after.load_state_dict(state)
    assert len(after) == 3000
    for key, value in after.state_dict().items():
        np.testing.assert_array_equal(value, state[key])
    with pytest.raises(ValueError):
        after.check(noise[3000], int(steps[2999]))  # steps must go on increasing
    for i in range(3000, 3500):
        assert after.check(noise[i], int(steps[i])) is None
    assert after.check(_replay(rng, noise[7], 4.0), int(steps[3500])) == 7
    assert after.check(_replay(rng, noise[2200], 0.3), int(steps[3501])) == int(steps[2200])
    assert after.check(_replay(rng, noise[3100], 1.0), int(steps[3502])) == int(steps[3100])
    assert after.matches == 3
    assert after.first_repeat == (int(steps[3500]), 7)
    assert after.last_repeat == (int(steps[3502]), int(steps[3100]))

    # the counts and repeats survive a second round trip
    again = NoiseFingerprints()
    again.load_state_dict(after.state_dict())
    assert again.matches == 3 and again.first_repeat == after.first_repeat
    assert again.check(_replay(rng, noise[1499], 1.0), int(steps[3503])) == 1499


def test_flipped_signs_are_tolerated_but_weak_correlation_is_not_a_match():
    rng = np.random.default_rng(14)
    noise = _fresh(rng, 3_000)
    fps = NoiseFingerprints()
    for i in range(len(noise)):
        assert fps.check(noise[i], i) is None
    # three flipped signs in three different 32-bit bands (values near zero, as from
    # rounding): only one band is intact, and the replay is still found
    flipped = noise[100].copy()
    for coord in (3, 40, 100):
        flipped[coord] = -np.sign(flipped[coord]) * 1e-9
    assert (NoiseFingerprints().fingerprint(flipped) ^ fps.fingerprint(noise[100])).bit_count() == 3
    assert fps.check(flipped, 3000) == 100

    # correlation 0.3 with step 200: signs agree on about 60% of coordinates, a
    # Hamming distance near 52, far above h (18 here); a match has probability
    # below 1e-5 for this draw
    z = noise[200] / np.std(noise[200])
    correlated = 0.3 * z + math.sqrt(1 - 0.3**2) * rng.standard_normal(BITS)
    assert fps.check(correlated, 3001) is None

    # a vector sharing one whole band with step 300 is a candidate through the index but
    # differs in about 48 of the other 96 signs: not a match
    shared = rng.standard_normal(BITS)
    shared[:32] = noise[300, :32]
    assert fps.check(shared, 3002) is None
    assert fps.matches == 1 and fps.first_repeat == (3000, 100)

    # replaying the replay: its changed bands lead to step 3000, its intact band to step
    # 100; the earliest is reported
    assert fps.check(flipped, 3003) == 100
    assert fps.matches == 2 and fps.last_repeat == (3003, 100)


def test_negated_replays_are_found_and_named_as_such():
    rng = np.random.default_rng(16)
    noise = _fresh(rng, 4_000)
    noise[3_500] = _replay(rng, noise[40], -0.7)  # the noise of step 40, negated, 3,460 steps later
    noise[3_501] = _replay(rng, noise[41], 1.3)  # an exact repeat right after
    fps = NoiseFingerprints()
    found = {i: fps.check(noise[i], i) for i in range(len(noise))}
    assert {i: e for i, e in found.items() if e is not None} == {3_500: 40, 3_501: 41}
    assert fps.first_repeat == (3_500, 40) and fps.first_negated
    assert fps.last_repeat == (3_501, 41) and not fps.last_negated
    again = NoiseFingerprints()
    again.load_state_dict(fps.state_dict())
    assert again.first_negated and not again.last_negated
    assert again.check(-noise[7], 4_000) == 7 and again.last_negated


def test_saved_state_is_about_16_bytes_per_step():
    rng = np.random.default_rng(15)
    noise = _fresh(rng, 2_400)
    fps = NoiseFingerprints()
    for i in range(len(noise)):
        fps.check(noise[i], 3 + 2 * i)  # every other step, as with gradient accumulation
    state = fps.state_dict()
    assert state["step_runs"].shape == (1, 3)  # evenly spaced labels: one run
    arrays = sum(v.nbytes for v in state.values() if isinstance(v, np.ndarray))
    assert state["fingerprints"].dtype == np.uint64 and state["fingerprints"].shape == (2_400, 2)
    assert 16 * 2_400 <= arrays <= 32 * 2_400
    assert len(pickle.dumps(state)) <= 17 * 2_400
    memory = fps.memory_bytes()
    assert 16.0 <= memory["saved_per_step"] <= 17.0
    assert memory["index"] > 0 and memory["allocated"] >= memory["fingerprints"] + memory["index"]
    assert fps.check(_replay(rng, noise[1000], 1.0), 5_000) == 3 + 2 * 1000


def test_thresholds_decrease_and_spend_at_most_alpha():
    alpha = 1e-6
    fps = NoiseFingerprints(alpha=alpha)
    t = np.arange(1, 10**6 + 1)
    h = fps.threshold(t)
    assert h[0] == BITS  # nothing to compare with at the first step
    assert np.all(np.diff(h) <= 0)
    assert h[-1] >= 0  # still accepts exact replays at a million steps
    for s in (2, 10, 999, 10**5, 10**6):
        assert fps._threshold_at(s) == fps.threshold(s) == h[s - 1]

    # exact binomial tails, P[Binomial(128, 1/2) <= k]
    cdf, total = {}, 0
    for k in range(BITS + 1):
        total += math.comb(BITS, k)
        cdf[k] = Fraction(total, 2**BITS)
    spent = 0.0
    for k in np.unique(h[1:]):
        ts = t[1:][h[1:] == k]
        spent += float(np.sum(2.0 * (ts - 1.0))) * float(cdf[int(k)])  # each earlier step and its negation
    assert spent <= alpha
    assert spent >= alpha / 10  # the budget is used, not thrown away
    # each h(t) is the largest allowed: one more would exceed the step's budget
    for s in (2, 10, 1000, 10**5, 10**6):
        k = int(h[s - 1])
        budget = Fraction(alpha) * 6 / (Fraction(math.pi) ** 2 * s * s)
        assert 2 * (s - 1) * cdf[k] <= budget < 2 * (s - 1) * cdf[k + 1]


def test_bad_input_is_rejected_and_the_module_imports_no_torch():
    fps = NoiseFingerprints()
    with pytest.raises(ValueError):
        fps.check(np.zeros(BITS - 1), 0)
    with pytest.raises(ValueError):
        fps.check(np.full(BITS, np.nan), 0)
    with pytest.raises(ValueError):
        NoiseFingerprints(bits=100)
    with pytest.raises(ValueError):
        NoiseFingerprints().load_state_dict(NoiseFingerprints(bits=64).state_dict())
    assert len(fps) == 0
    tree = ast.parse(Path(noise_fingerprints.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name.split(".")[0] == "torch" for name in imported if name)
    assert "numpy" in imported
