"""One-run estimators of the final-model audit: reference values, the guess-selection
corrections, validity on simulated correct runs and size under a leaking one.

Statistical tests use fixed seeds; each states the chance that a correct implementation
fails it for a fresh seed.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import binom

from lightning_dpaudit.estimators import mu_to_epsilon, one_run_epsilon
from lightning_dpaudit.estimators.one_run_fdp import one_run_fdp_epsilon, one_run_fdp_margin
from lightning_dpaudit.estimators.one_run_guesses import GUESS_FRACTIONS, guess_counts, guess_rules, one_run_bounds

_JAX_PRIVACY = Path(__file__).parent / "data" / "jax_privacy_reference.json"


@pytest.mark.parametrize(
    "v, steinke, fdp", [(100, 3.46538, 5.54903), (90, 1.62614, 2.45641)]
)
def test_reference_values_at_95_percent(v, steinke, fdp):
    assert one_run_epsilon(1000, 100, v, delta=1e-5, confidence=0.95) == pytest.approx(steinke, abs=1e-5)
    # jax_privacy finds its root to xtol 1e-6 and its sigma numerically: agreement to 1e-5
    assert one_run_fdp_epsilon(1000, 100, v, delta=1e-5, confidence=0.95) == pytest.approx(fdp, abs=1e-5)


def _jax_privacy_records(key):
    if not _JAX_PRIVACY.exists():
        return []
    return json.loads(_JAX_PRIVACY.read_text())[key]


@pytest.mark.parametrize("record", _jax_privacy_records("one_run_fdp"), ids=lambda r: f"{r['m']}-{r['r']}-{r['v']}-{r['delta']}-{r['confidence']}")
def test_fdp_equals_jax_privacy(record):
    ours = one_run_fdp_epsilon(record["m"], record["r"], record["v"], delta=record["delta"], confidence=record["confidence"])
    assert ours == pytest.approx(record.get("epsilon_tight", record["epsilon"]), abs=2e-5)


@pytest.mark.parametrize("record", _jax_privacy_records("one_run"), ids=lambda r: f"{r['m']}-{r['r']}-{r['v']}-{r['delta']}-{r['confidence']}")
def test_steinke_equals_jax_privacy(record):
    ours = one_run_epsilon(record["m"], record["r"], record["v"], delta=record["delta"], confidence=record["confidence"])
    assert ours == pytest.approx(record.get("epsilon_tight", record["epsilon"]), abs=2e-5)


def test_jax_privacy_reference_is_present():
    assert len(_jax_privacy_records("one_run_fdp")) >= 10 and len(_jax_privacy_records("one_run")) >= 10


def test_fdp_margin_falls_with_epsilon_and_rejects_only_below_the_bound():
    eps = one_run_fdp_epsilon(1000, 200, 180, delta=1e-5)
    margins = [one_run_fdp_margin(e, num_canaries=1000, num_guesses=200, num_correct=180, delta=1e-5) for e in (0.5, 1, 2, eps + 0.01, 4)]
    assert all(a >= b for a, b in zip(margins, margins[1:]))
    assert margins[2] > 0 > margins[3]


def test_fdp_bound_grows_with_right_guesses_and_is_zero_at_chance():
    values = [one_run_fdp_epsilon(1000, 100, v, delta=1e-5) for v in (50, 70, 90, 100)]
    assert values[0] == 0.0 and values[1] < values[2] < values[3]


def test_fdp_needs_delta():
    with pytest.raises(ValueError, match="delta"):
        one_run_fdp_epsilon(1000, 100, 90, delta=0.0)


# ---------------------------------------------------------------- guesses and the corrections


def test_guess_counts_in_and_out():
    scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    included = np.array([True, True, False, True, False, False])
    assert guess_counts(scores, included, 2, 0) == (2, 2)
    assert guess_counts(scores, included, 3, 0) == (3, 2)
    assert guess_counts(scores, included, 2, 2) == (4, 4)  # the two lowest are both out
    assert guess_counts(scores, included, 1, 3) == (4, 3)  # of 2.0, 1.0, 0.0 two are out


def test_grid_is_fixed_by_the_score_names_and_m_only():
    rules = guess_rules(["loss", "logit_margin"], 1000)
    assert len(rules) == 2 * 2 * len(GUESS_FRACTIONS) and len(set(rules)) == len(rules)
    assert ("loss", 100, 0) in rules and ("logit_margin", 50, 50) in rules


def _gaussian_run(rng, m, mu, names=("loss", "loss_change", "logit_margin")):
    """A mu-GDP mechanism per canary: an included canary's score is N(mu, 1), an excluded one's N(0, 1)."""
    included = rng.random(m) < 0.5
    return {n: rng.normal(size=m) + mu * included for n in names}, included


def test_union_bound_pays_for_the_grid():
    rng = np.random.default_rng(1)
    scores, included = _gaussian_run(rng, 1000, 3.0, names=("loss",))
    union = one_run_bounds(scores, included, delta=1e-5)["steinke"]
    k = union.guesses_in + union.guesses_out
    alone = one_run_epsilon(1000, k, union.correct, delta=1e-5)  # the same rule, as if fixed in advance
    assert union.rules == 2 * len(GUESS_FRACTIONS)
    assert 0.0 < union.epsilon < alone


def test_split_tests_the_chosen_rule_on_the_other_half():
    rng = np.random.default_rng(2)
    scores, included = _gaussian_run(rng, 1000, 2.0)
    split = one_run_bounds(scores, included, delta=1e-5, selection="split", seed=7)
    estimators = {"steinke": one_run_epsilon, "fdp": one_run_fdp_epsilon}
    half = np.random.default_rng(7).permutation(1000)[500:]
    for name, bound in split.items():
        assert bound.num_canaries == 500 and bound.rules == 1 and bound.selection == "split"
        r, v = guess_counts(scores[bound.score][half], included[half], bound.guesses_in, bound.guesses_out)
        assert v == bound.correct and r == bound.guesses_in + bound.guesses_out
        assert bound.epsilon == pytest.approx(estimators[name](500, r, v, delta=1e-5)) and bound.epsilon > 0


@pytest.mark.parametrize("selection", ["union", "split"])
def test_valid_on_simulated_correct_runs(selection):
    """40 runs of a mechanism exactly mu-GDP per canary (mu = 2: epsilon 10.0 at delta 1e-5).

    At 95% confidence a valid bound exceeds the true epsilon in at most 5% of runs: at most
    2 + 6 = 8 of 40 for a correct estimator fails with chance P[Bin(40, 0.05) > 8] < 0.001.
    A bound that ignored the selection would count the best of the grid without paying for it.
    """
    mu, delta = 2.0, 1e-5
    true_eps = mu_to_epsilon(mu, delta)
    rng = np.random.default_rng(3)
    over = {"steinke": 0, "fdp": 0}
    seen = []
    for run in range(40):
        scores, included = _gaussian_run(rng, 600, mu)
        bounds = one_run_bounds(scores, included, delta=delta, selection=selection, seed=run)
        for name, b in bounds.items():
            over[name] += b.epsilon > true_eps
            seen.append(b.epsilon)
    assert binom.sf(8, 40, 0.05) < 1e-3
    assert over["steinke"] <= 8 and over["fdp"] <= 8
    assert min(seen) > 0.5  # and the bounds are not empty: mu = 2 is visible in one run


def test_perfect_attack_bounds_far_above_a_claim_of_one():
    rng = np.random.default_rng(4)
    scores, included = _gaussian_run(rng, 1000, 50.0)
    bounds = one_run_bounds(scores, included, delta=1e-5)
    assert bounds["steinke"].epsilon > 3.0 and bounds["fdp"].epsilon > 5.0


def test_chance_scores_give_zero_or_little():
    """Scores independent of inclusion: a valid bound is 0 in >= 95% of runs; with 20 runs
    more than 4 non-zero fails a correct estimator with chance P[Bin(20, .05) > 4] = 0.003."""
    rng = np.random.default_rng(5)
    positive = 0
    for run in range(20):
        scores, included = _gaussian_run(rng, 400, 0.0)
        positive += one_run_bounds(scores, included, delta=1e-5)["steinke"].epsilon > 0
    assert positive <= 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(scores={}, included=[True, False]), "empty"),
        (dict(scores={"loss": [1.0, 2.0, 3.0]}, included=[True, False]), "3 values for 2 canaries"),
        (dict(scores={"loss": [1.0, math.nan]}, included=[True, False]), "finite"),
        (dict(scores={"loss": [1.0, 2.0]}, included=[True, False], selection="best"), "selection"),
        (dict(scores={"loss": [1.0, 2.0]}, included=[True, False], delta=1.0), "delta"),
        (dict(scores={"loss": [1.0, 2.0]}, included=[0.9, 0.1]), "`included`: 0.9"),
    ],
)
def test_bad_input(kwargs, message):
    kwargs.setdefault("delta", 1e-5)
    with pytest.raises(ValueError, match=message):
        one_run_bounds(**kwargs)
