"""Practitioner recipes (tests/recipes.py), one seed each: the correct recipe is quiet with every check having
compared something, its buggy twin is flagged with the finding the recipe expects. bench/validity/recipes.py runs the
same recipes over many seeds and long runs.

Deterministic (seed 0, one torch thread); the canaries' alarm has a 5% false-alarm budget per correct run, met or
not by these fixed seeds once and for all.
"""

from __future__ import annotations

import pytest
from recipe_runs import flagged, quiet, uncompared
from recipes import RECIPES

SEED = 0
STEPS = 30  # the correct recipes: step 1's exact check, the outside-DP comparisons at steps 1 and 2, the canaries' checks
TWIN_STEPS = 100  # at most: a twin stops at its first alarm (the un-noised layer is seen at step 23 here)

CORRECT = [name for name, recipe in RECIPES.items() if recipe.known_failure is None]
KNOWN_FAILURES = [name for name, recipe in RECIPES.items() if recipe.known_failure is not None]


def test_there_are_at_least_twelve_recipes_each_with_a_twin():
    assert len(RECIPES) >= 12
    assert all(recipe.expected and recipe.twin_summary for recipe in RECIPES.values())


@pytest.mark.parametrize("name", CORRECT)
def test_the_correct_recipe_is_quiet_and_every_check_compared(name):
    result = RECIPES[name].correct(SEED, STEPS)
    assert quiet(result) == [], quiet(result)
    failures, declined = uncompared(result)
    assert failures == []
    declines = RECIPES[name].declines  # declined by design, said why; nothing else
    assert sorted(d for d in declines if any(d in status for status in declined)) == sorted(declines), declined
    assert all(any(d in status for d in declines) for status in declined), declined
    assert result.steps == STEPS
    assert result.data_path.startswith("1 step(s) compared") or any(d in result.data_path for d in declines)


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_twin_is_flagged_with_its_finding(name):
    result = RECIPES[name].twin(SEED, TWIN_STEPS)
    assert flagged(result, RECIPES[name].expected) == [], [(f.code, f.message) for f in result.findings]


def test_no_recipe_is_a_known_failure():
    assert KNOWN_FAILURES == []


def test_the_dp_gan_generator_is_post_processing_and_its_twin_is_trained_on_the_data():
    """The generator's Adam trains it through the DP discriminator's output alone: a note, no finding. The twin's
    generator loss also reads the private batch: outside_dp at step 2, the first comparison after its first update
    (step 1's comparison comes at the discriminator's noised step, before the generator's)."""
    result = RECIPES["dp-gan"].correct(SEED, STEPS)
    assert not result.violation and result.findings == ()
    assert any("`generator.0.bias`" in n and "never started from the private batch" in n for n in result.notes)
    twin = RECIPES["dp-gan"].twin(SEED, TWIN_STEPS)
    assert [(f.code, f.first_step) for f in twin.findings] == [("outside_dp", 2)]
    assert "`generator.0.bias`" in twin.findings[0].message


def test_a_result_that_compared_nothing_without_saying_why_fails_the_recipe():
    from types import SimpleNamespace

    result = SimpleNamespace(
        findings=(), violation=False, audit_failed=None, checks_stopped=(("faulty", "stopped at step 3: boom"),),
        data_path="nothing compared yet (no step due yet)",
        pipeline="sampling (loader: poisson; 3 batches fingerprinted); rows per record (0 steps compared); "
                 "tensors outside the DP optimizer (2 watched, 0 comparisons)")
    failures, declined = uncompared(result)
    assert failures == ["faulty stopped: stopped at step 3: boom", "compared nothing: rows per record (0 steps compared)",
                        "compared nothing: tensors outside the DP optimizer (2 watched, 0 comparisons)"]
    assert declined == ["nothing compared yet (no step due yet)"]
    assert quiet(result) == failures
