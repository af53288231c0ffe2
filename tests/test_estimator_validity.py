"""The estimators certify themselves: on data with a known truth, a bound at confidence 0.95
exceeds the truth in at most about 5% of trials (bench/validity/estimator_validity.py measures the
same with 10^4 trials per row; docs/estimators.md has the table).

Seeds are fixed, so each test is deterministic; the false-failure rate stated in a
docstring is the chance that a correct estimator fails with a fresh seed. Rates are
compared with the 0.999 quantile of Binomial(trials, 0.05): a correct estimator with an
exceedance rate of at most 5% fails such a check with probability <= 0.001.
"""

import json
import math
import re

import numpy as np
import pytest
from scipy.stats import binom, norm

from lightning_dpaudit.analysis.final_model import audit_final_model, section_problem, summary_lines
from lightning_dpaudit.estimators import (
    METHODS,
    epsilon_from_counts,
    mu_to_epsilon,
    one_run_bounds,
    one_run_epsilon,
)
from lightning_dpaudit.estimators.bounds import DEFAULT_THRESHOLD, bound_exceeds
from lightning_dpaudit.estimators.one_run_guesses import FDP_AT_DELTA_ZERO, guess_rules

DELTA = 1e-5
BUDGET = 0.05  # 1 - confidence
BAYES = ("epsdelta-bayes", "gdp-bayes")


def _allowed(trials: int) -> int:
    """Most trials above the truth a correct estimator shows, but for probability <= 0.001."""
    return int(binom.ppf(0.999, trials, BUDGET))


def _threshold_counts(rng, trials, n, p_in, p_out):
    """(tp, fn, fp, tn) per trial: Binomial counts of scores >= the threshold, in and out."""
    tp, fp = rng.binomial(n, p_in, trials), rng.binomial(n, p_out, trials)
    return tp, n - tp, fp, n - fp


def _rr_p(epsilon):
    return 1.0 / (1.0 + math.exp(epsilon))


# ---------------------------------------------------------------- the Bayesian null rule


@pytest.mark.parametrize("method", BAYES)
def test_null_data_give_zero_for_the_bayesian_bounds(method):
    """2,000 trials, 50 observations a side from one distribution (scores at the threshold 0.5:
    FPR + FNR = 1). The bound is 0 unless the separation is credibly nonzero, so it is above 0
    in at most about 5% of trials (bench: 3.0-4.3%); allowed: _allowed(2000) = 131 (6.6%).
    False failure <= 0.001. Each count tuple goes through epsilon_from_counts itself."""
    rng = np.random.default_rng(11)
    p = norm.sf(DEFAULT_THRESHOLD)
    tp, fn, fp, tn = _threshold_counts(rng, 2000, 50, p, p)
    table = np.stack([tp, fn, fp, tn], axis=1)
    rows, counts = np.unique(table, axis=0, return_counts=True)
    positive = sum(c for row, c in zip(rows, counts)
                   if epsilon_from_counts(*map(int, row), delta=DELTA, method=method).epsilon > 0)
    assert positive <= _allowed(2000), f"{method}: {positive} of 2000 null trials above 0"
    assert positive > 0  # the rule is not "always 0": about 5% of null trials are positive


@pytest.mark.parametrize("method", BAYES)
def test_a_chance_attack_gives_zero_and_a_clear_one_does_not(method):
    assert epsilon_from_counts(0, 50, 0, 50, delta=DELTA, method=method).epsilon == 0.0  # says "out" always
    assert epsilon_from_counts(50, 50, 50, 50, delta=DELTA, method=method).epsilon == 0.0
    assert epsilon_from_counts(52, 48, 45, 55, delta=DELTA, method=method).epsilon == 0.0
    assert epsilon_from_counts(70, 30, 30, 70, delta=DELTA, method=method).epsilon > 0.0
    # an attack credibly worse than chance counts as its flip
    flipped = epsilon_from_counts(30, 70, 70, 30, delta=DELTA, method=method).epsilon
    assert flipped == pytest.approx(epsilon_from_counts(70, 30, 30, 70, delta=DELTA, method=method).epsilon)


# ---------------------------------------------------------------- the fast path the bench uses


@pytest.mark.parametrize("method", METHODS)
def test_bound_exceeds_agrees_with_the_bound(method):
    rng = np.random.default_rng(METHODS.index(method))
    delta = 0.0 if method == "katz" else DELTA
    tp, fn, fp, tn = _threshold_counts(rng, 25, 60, 0.7, 0.3)
    tp[:5], fn[:5] = fn[:5], tp[:5]  # a few attacks worse than chance
    for epsilon in (0.0, 0.4, 0.9):
        fast = bound_exceeds(tp, fn, fp, tn, epsilon=epsilon, delta=delta, method=method)
        slow = [epsilon_from_counts(*map(int, c), delta=delta, method=method).epsilon > epsilon
                for c in zip(tp, fn, fp, tn)]
        assert fast.tolist() == slow, (method, epsilon)


# ---------------------------------------------------------------- validity on known mechanisms


@pytest.mark.parametrize("method", METHODS)
def test_step_methods_on_a_gaussian_mechanism_stay_within_budget(method):
    """2,000 trials of in ~ N(1, 1), out ~ N(0, 1), 200 a side, threshold 0.5: a 1-GDP
    mechanism, epsilon 4.38 at delta 1e-5 (katz: pure DP, no finite epsilon, so it cannot
    be exceeded). Allowed: _allowed(2000) = 131 trials above the truth; false failure <= 0.001."""
    rng = np.random.default_rng(20 + METHODS.index(method))
    if method == "katz":
        truth, delta = math.inf, 0.0
    else:
        truth, delta = mu_to_epsilon(1.0, DELTA), DELTA
    counts = _threshold_counts(rng, 2000, 200, norm.sf(-0.5), norm.sf(0.5))
    over = 0 if math.isinf(truth) else int(bound_exceeds(*counts, epsilon=truth, delta=delta, method=method).sum())
    assert over <= _allowed(2000), f"{method}: {over} of 2000 above {truth}"


@pytest.mark.parametrize("method", ["epsdelta-cp", "epsdelta-bayes", "katz"])
def test_epsilon_methods_on_randomized_response_stay_within_budget(method):
    """Randomized response at epsilon 2 sits exactly at the corner of the (epsilon, delta)
    region, where these methods are tight; 2,000 trials, 100 a side. The region's joint
    posterior mass (privacy-estimates' joint-beta) was above the truth in 17-18% of such
    trials. Allowed: _allowed(2000) = 131 (6.6%); false failure <= 0.001."""
    rng = np.random.default_rng(30 + METHODS.index(method))
    p = _rr_p(2.0)
    delta = 0.0 if method == "katz" else DELTA
    truth = math.log((1 - p - delta) / p)
    counts = _threshold_counts(rng, 2000, 100, 1 - p, p)
    over = int(bound_exceeds(*counts, epsilon=truth, delta=delta, method=method).sum())
    assert over <= _allowed(2000), f"{method}: {over} of 2000 above {truth}"


@pytest.mark.parametrize("method", ["gdp-cp", "gdp-bayes"])
def test_gdp_methods_assume_a_gaussian_curve(method):
    """On randomized response the GDP epsilon is the Gaussian curve's, above the true epsilon
    (the documented assumption); against the smallest Gaussian curve above randomized
    response (mu = 2 Phi^-1(1 - p)) the bound is within budget (allowed _allowed(500) = 41;
    false failure <= 0.001). 500 trials, 100 a side."""
    rng = np.random.default_rng(40)
    p = _rr_p(2.0)
    counts = _threshold_counts(rng, 500, 100, 1 - p, p)
    truth = math.log((1 - p - DELTA) / p)
    assert bound_exceeds(*counts, epsilon=truth, delta=DELTA, method=method).mean() > 0.9
    envelope = mu_to_epsilon(2 * norm.isf(p), DELTA)
    assert bound_exceeds(*counts, epsilon=envelope, delta=DELTA, method=method).sum() <= _allowed(500)


def _canaries(rng, m, kind):
    included = rng.random(m) < 0.5
    if kind == "gaussian":  # each canary a 1-GDP mechanism: included N(1, 1), excluded N(0, 1)
        return {"score": rng.normal(size=m) + included}, included
    if kind == "rr":  # randomized response at epsilon 2 per canary
        return {"score": (included ^ (rng.random(m) < _rr_p(2.0))).astype(float)}, included
    return {"score": rng.normal(size=m)}, included


@pytest.mark.parametrize("selection", ["union", "split"])
def test_one_run_bounds_on_gaussian_canaries_stay_within_budget(selection):
    """150 trials of 200 canaries, each a 1-GDP mechanism (truth 4.38 at delta 1e-5), both
    estimators; and null canaries (truth 0). Allowed: _allowed(150) = 17 trials above the
    truth per estimator and data (false failure <= 0.001 each, <= 0.004 for the test)."""
    rng = np.random.default_rng(50 + (selection == "split"))
    truth = {"gaussian": mu_to_epsilon(1.0, DELTA), "null": 0.0}
    over = {(kind, name): 0 for kind in truth for name in ("steinke", "fdp")}
    for _ in range(150):
        for kind, value in truth.items():
            bounds = one_run_bounds(*_canaries(rng, 200, kind), delta=DELTA, selection=selection)
            for name, bound in bounds.items():
                over[kind, name] += bound.epsilon > value
    assert max(over.values()) <= _allowed(150), over


def test_one_run_bounds_on_randomized_response():
    """Randomized response at epsilon 2 per canary, 100 trials of 400 canaries: the
    (epsilon, delta) bound stays within budget (allowed _allowed(100) = 13; false failure
    <= 0.001); the f-DP bound, which assumes a Gaussian curve, exceeds epsilon 2 in most
    trials (bench: 99.7%)."""
    rng = np.random.default_rng(60)
    truth = math.log((1 - _rr_p(2.0) - DELTA) / _rr_p(2.0))
    over = {"steinke": 0, "fdp": 0}
    for _ in range(100):
        for name, bound in one_run_bounds(*_canaries(rng, 400, "rr"), delta=DELTA).items():
            over[name] += bound.epsilon > truth
    assert over["steinke"] <= _allowed(100)
    assert over["fdp"] > 50
    bound = one_run_bounds(*_canaries(rng, 400, "rr"), delta=DELTA)["fdp"]
    assert "Gaussian" in bound.assumes


# ---------------------------------------------------------------- `included`


@pytest.mark.parametrize(
    "included, shown",
    [
        ([0.3, 0.7, 0.5, 0.9], "0.3"),
        ([1.0, math.nan, 0.0, 1.0], "1.0"),
        ([math.nan, 1, 0, 1], "nan"),
        (["yes", "no", "yes", "no"], "'yes'"),
        ([1, 0, 2, 1], "2"),
        ([True, None, False, True], "None"),
    ],
)
def test_included_takes_booleans_or_zero_one_integers_only(included, shown):
    scores = {"loss": [0.1, 0.2, 0.3, 0.4]}
    message = rf"`included`: {re.escape(shown)}[ ;]"
    with pytest.raises(ValueError, match=message):
        one_run_bounds(scores, included, delta=DELTA)
    with pytest.raises(ValueError, match=message):
        audit_final_model(scores, included, delta=DELTA)


def test_included_as_zero_one_integers_equals_booleans():
    rng = np.random.default_rng(70)
    scores, included = _canaries(rng, 200, "gaussian")
    as_bool = one_run_bounds(scores, included, delta=DELTA)
    as_int = one_run_bounds(scores, included.astype(np.int64), delta=DELTA)
    assert {k: b.epsilon for k, b in as_bool.items()} == {k: b.epsilon for k, b in as_int.items()}


# ---------------------------------------------------------------- delta = 0 and labels


def test_final_model_audit_at_delta_zero_gives_the_steinke_bound_and_no_fdp_bound():
    rng = np.random.default_rng(80)
    included = rng.random(500) < 0.5
    scores = {"loss": rng.normal(size=500) + 4.0 * included}
    result = audit_final_model(scores, included, delta=0.0, accountant_epsilon=1.0)
    steinke, fdp = result.bounds["steinke"], result.bounds["fdp"]
    assert steinke.epsilon > 1.0 and result.violation
    r = steinke.guesses_in + steinke.guesses_out
    level = 0.05 / len(guess_rules(["loss"], 500))
    assert steinke.epsilon == pytest.approx(one_run_epsilon(500, r, steinke.correct, delta=0.0, confidence=1 - level))
    assert math.isnan(fdp.epsilon) and fdp.unavailable == FDP_AT_DELTA_ZERO and "delta = 0" in fdp.unavailable
    section = json.loads(json.dumps(result.to_dict()).replace("NaN", "null"))  # as the report writes it
    assert section_problem(section) is None
    lines = "\n".join(summary_lines(section))
    assert "n/a" in lines and FDP_AT_DELTA_ZERO in lines
    for selection in ("union", "split"):
        bounds = one_run_bounds(scores, included, delta=0.0, selection=selection)
        assert bounds["steinke"].epsilon > 0 and math.isnan(bounds["fdp"].epsilon)


def test_the_fdp_bound_is_labelled_with_its_assumption():
    rng = np.random.default_rng(90)
    included = rng.random(300) < 0.5
    result = audit_final_model({"loss": rng.normal(size=300) + 3.0 * included}, included, delta=DELTA)
    section = result.to_dict()
    assert "Gaussian" in section["bounds"]["fdp"]["assumes"] and section["bounds"]["steinke"]["assumes"] == ""
    lines = summary_lines(section)
    fdp_line = next(i for i, line in enumerate(lines) if line.strip().startswith("epsilon if Gaussian"))
    assert "Gaussian trade-off curve" in lines[fdp_line + 1] and "not comparable" in lines[fdp_line + 1]
