"""Guesses from canary scores, and one-run bounds that stay valid when the guesses are chosen late.

A guess rule ranks the m canaries by one score (larger = more likely included) and says
"in" for the k_in highest and "out" for the k_out lowest; it makes r = k_in + k_out
guesses, v of them right. Choosing the score and k after seeing the scores would make
the bound optimistic; two corrections keep it valid at `confidence`:

    union   every rule of a grid fixed in advance (each score x GUESS_FRACTIONS of m x
            SIDES) is tested at level (1 - confidence) / H, H the number of rules; the
            largest bound holds with probability >= confidence (Bonferroni).
    split   a random half of the canaries (drawn from `seed`, independent of the
            inclusion) picks the rule with the largest bound; the other half, m/2
            canaries whose inclusion is still independent of that choice, is tested with
            it alone at level 1 - confidence.

Each estimator (one_run.py, one_run_fdp.py) picks its own rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Tuple

import numpy as np

from ._checks import check_confidence, check_delta, check_included, check_scores
from .one_run import MAX_CANARIES, one_run_epsilon
from .one_run_fdp import one_run_fdp_epsilon

GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
SIDES = ("in", "both")  # "in": the k highest only; "both": k/2 highest "in", k/2 lowest "out"
SELECTIONS = ("union", "split")
ESTIMATORS: Dict[str, Callable] = {"steinke": one_run_epsilon, "fdp": one_run_fdp_epsilon}
# What each bound assumes beyond the claim it tests: "fdp" holds only for a Gaussian trade-off curve.
ASSUMES = {"steinke": "", "fdp": "Gaussian trade-off curve (as DP-SGD's noise gives); not a bound on (epsilon, delta)-DP"}
FDP_AT_DELTA_ZERO = "not available at delta = 0: a Gaussian trade-off curve has epsilon = inf there"


@dataclass(frozen=True)
class GuessBound:
    """One estimator's bound and the guess rule behind it.

    epsilon     lower bound on epsilon, holding with probability >= confidence.
    score       the score the rule ranked by; guesses_in / guesses_out: its k_in, k_out.
    correct     right guesses among them; num_canaries: the m the bound was computed for
                (all canaries for "union", the tested half for "split").
    rules       H, the number of rules the level was shared over (1 for "split").
    assumes     what the bound assumes beyond its claim ("" for "steinke"; the Gaussian
                trade-off curve for "fdp", whose bound is no bound for other mechanisms).
    unavailable why epsilon is nan ("fdp" at delta = 0), else "".
    """

    estimator: str
    epsilon: float
    score: str
    guesses_in: int
    guesses_out: int
    correct: int
    num_canaries: int
    rules: int
    selection: str
    confidence: float
    delta: float
    assumes: str = ""
    unavailable: str = ""


def guess_rules(score_names, num_canaries: int) -> list:
    """The fixed grid: (score, k_in, k_out) for each score, fraction of m and side, without repeats."""
    rules = []
    for name in score_names:
        for fraction in GUESS_FRACTIONS:
            k = max(1, int(round(fraction * num_canaries)))
            for side in SIDES:
                rule = (name, k, 0) if side == "in" else (name, (k + 1) // 2, k // 2)
                if rule not in rules:
                    rules.append(rule)
    return rules


def guess_counts(scores: np.ndarray, included: np.ndarray, k_in: int, k_out: int) -> Tuple[int, int]:
    """(r, v): guesses made and right when the k_in highest scores say "in", the k_out lowest "out".

    Ties are broken by canary index, which is independent of the inclusion.
    """
    return _counts(_ranking(scores), included, k_in, k_out)


def _ranking(scores: np.ndarray) -> np.ndarray:
    """Canary indices from the highest score to the lowest, ties in index order."""
    return np.argsort(-scores, kind="stable")


def _counts(order: np.ndarray, included: np.ndarray, k_in: int, k_out: int) -> Tuple[int, int]:
    """guess_counts for canaries already ranked by `order`."""
    k_in, k_out = min(k_in, len(order)), min(k_out, len(order) - min(k_in, len(order)))
    right = int(included[order[:k_in]].sum())
    if k_out:
        right += int((~included[order[len(order) - k_out:]]).sum())
    return k_in + k_out, right


def one_run_bounds(
    scores: Mapping[str, np.ndarray], included, *, delta: float, confidence: float = 0.95,
    selection: str = "union", seed: int = 0,
) -> Dict[str, GuessBound]:
    """Each estimator's lower bound on epsilon from the canaries' scores and their inclusion."""
    confidence = check_confidence(confidence)
    delta = check_delta(delta)  # at delta = 0 only "steinke" is defined; "fdp" is nan with the reason
    if selection not in SELECTIONS:
        raise ValueError(f"Unexpected value for `selection`: {selection!r}; use one of {', '.join(SELECTIONS)}")
    included = check_included(included)
    if len(included) > MAX_CANARIES:
        raise ValueError(
            f"Unexpected value for `included`: {len(included):,} canaries; at most {MAX_CANARIES:,} (10**7) are bounded"
        )
    if not isinstance(scores, Mapping):
        raise ValueError(
            f"Unexpected value for `scores`: a {type(scores).__name__}; pass a dict of score name -> one score per "
            "canary, e.g. {'loss': losses}"
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"Unexpected value for `seed`: {seed!r}; use an integer >= 0")
    if not scores:
        raise ValueError("`scores` is empty: give at least one score per canary")
    table = {name: check_scores(values, f"scores[{name!r}]") for name, values in scores.items()}
    for name, values in table.items():
        if len(values) != len(included):
            raise ValueError(f"`scores[{name!r}]` has {len(values)} values for {len(included)} canaries")
    if len(included) < 2:
        raise ValueError(f"need at least 2 canaries; got {len(included)}")
    if selection == "union":
        return {name: _best(name, estimate, table, included, delta, confidence, "union") if _defined(name, delta)
                else _unavailable(name, len(included), "union", confidence, delta) for name, estimate in ESTIMATORS.items()}
    half = np.random.default_rng(seed).permutation(len(included))
    pick, test = half[: len(half) // 2], half[len(half) // 2:]
    out = {}
    for name, estimate in ESTIMATORS.items():
        if not _defined(name, delta):
            out[name] = _unavailable(name, len(test), "split", confidence, delta)
            continue
        chosen = _best(name, estimate, {k: v[pick] for k, v in table.items()}, included[pick], delta, confidence, "split")
        m = len(test)
        k_in, k_out = _rescale(chosen, len(pick), m)
        r, v = guess_counts(table[chosen.score][test], included[test], k_in, k_out)
        eps = estimate(m, r, v, delta=delta, confidence=confidence)
        out[name] = GuessBound(name, eps, chosen.score, k_in, k_out, v, m, 1, "split", confidence, delta, ASSUMES[name])
    return out


def _defined(estimator: str, delta: float) -> bool:
    """The f-DP bound needs delta > 0; the (epsilon, delta) bound is defined at delta = 0 too."""
    return estimator != "fdp" or delta > 0.0


def _unavailable(estimator, m, selection, confidence, delta) -> GuessBound:
    return GuessBound(estimator, float("nan"), "", 0, 0, 0, m, 0, selection, confidence, delta, ASSUMES[estimator],
                      FDP_AT_DELTA_ZERO)


def _rescale(bound: GuessBound, m_from: int, m_to: int) -> Tuple[int, int]:
    """The chosen rule's k_in, k_out as the same fractions of the tested half."""
    scale = m_to / max(m_from, 1)
    return int(round(bound.guesses_in * scale)), int(round(bound.guesses_out * scale))


def _best(estimator, estimate, table, included, delta, confidence, selection) -> GuessBound:
    """The largest bound over the grid, each rule at level (1 - confidence) / H ("union") or 1 - confidence."""
    m = len(included)
    rules = guess_rules(list(table), m)
    level = (1.0 - confidence) / (len(rules) if selection == "union" else 1)
    rankings = {name: _ranking(values) for name, values in table.items()}
    best = None
    for name, k_in, k_out in rules:
        r, v = _counts(rankings[name], included, k_in, k_out)
        eps = estimate(m, r, v, delta=delta, confidence=1.0 - level) if 2 * v > r else 0.0
        if best is None or eps > best.epsilon:
            best = GuessBound(estimator, eps, name, k_in, k_out, v, m, len(rules) if selection == "union" else 1,
                              selection, confidence, delta, ASSUMES[estimator])
    return best
