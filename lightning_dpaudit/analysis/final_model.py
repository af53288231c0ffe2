"""The final-model audit: the trained model's scores of its canaries -> epsilon lower bounds.

Threat model: an adversary who sees only the released model, and knows the m canaries
but not which of them (each with probability 1/2) were trained on. The bounds
(estimators/one_run_guesses.py) hold at `confidence`:

    steinke   (epsilon, delta)-DP, Steinke, Nasr and Jagielski (2023); defined at any delta
    fdp       the Gaussian trade-off curve through (epsilon, delta), Mahloujifar et al. (2024):
              valid only for a mechanism with a Gaussian trade-off curve (DP-SGD's noise), so
              labelled "if Gaussian" wherever shown; not a bound on (epsilon, delta)-DP and not
              comparable with "steinke"; nan at delta = 0 (the curve has epsilon = inf there)

The result is compared with the accountant's epsilon for the whole run; only the bound
of the end of training is tested against it, once (`violation`); bounds taken during
training draw a curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional

import numpy as np

from ..estimators._checks import check_included
from ..estimators.one_run_guesses import GuessBound, one_run_bounds
from .formatting import as_number, fixed
from .schema import shown

SCORE_LABELS = {"loss": "minus the canary's loss", "loss_change": "drop of the loss since the start",
                "logit_margin": "logit margin of the canary's label"}
HEADLINE = "steinke"  # the estimator whose claim is the accountant's: (epsilon, delta)-DP
LABELS = {"steinke": "epsilon, (eps, delta)-DP", "fdp": "epsilon if Gaussian (f-DP)"}
FDP_NOTE = "assumes a Gaussian trade-off curve (DP-SGD's noise): not comparable with the (eps, delta)-DP bound"
BINS = 30


@dataclass(frozen=True)
class FinalModelResult:
    """One final-model audit of the model at `epoch` / `step`.

    bounds: estimator name -> GuessBound. histograms: score name -> (edges, counts of
    included canaries, counts of excluded ones). epsilon_lower_bound: the "steinke" bound.
    """

    epoch: Optional[int]
    step: Optional[int]
    kind: Optional[str]
    num_canaries: int
    num_included: int
    confidence: float
    delta: float
    selection: str
    accountant_epsilon: Optional[float]
    bounds: Dict[str, GuessBound]
    histograms: Dict[str, tuple] = field(repr=False)

    @property
    def epsilon_lower_bound(self) -> float:
        return self.bounds[HEADLINE].epsilon

    @property
    def violation(self) -> bool:
        """The (epsilon, delta) bound exceeds the accountant's epsilon for the run."""
        claim = self.accountant_epsilon
        return claim is not None and math.isfinite(claim) and self.epsilon_lower_bound > claim

    def violation_message(self) -> str:
        return (f"final-model audit: epsilon >= {self.epsilon_lower_bound:.3g} from {self.num_canaries} canaries "
                f"exceeds the accountant's {self.accountant_epsilon:.3g} (delta={self.delta:g})")

    def to_dict(self) -> dict:
        return {
            "epoch": self.epoch, "step": self.step, "kind": self.kind,
            "num_canaries": self.num_canaries, "num_included": self.num_included,
            "confidence": self.confidence, "delta": self.delta, "selection": self.selection,
            "accountant_epsilon": self.accountant_epsilon,
            "epsilon_lower_bound": self.epsilon_lower_bound, "violation": self.violation,
            "bounds": {name: dict(b.__dict__) for name, b in self.bounds.items()},
            "histograms": {
                name: {"edges": list(map(float, e)), "included": list(map(int, a)), "excluded": list(map(int, b))}
                for name, (e, a, b) in self.histograms.items()
            },
        }

    def __str__(self) -> str:
        """The final-model section of the summary `dpaudit report` prints: the verdict, each
        bound with the guesses it counts, the accountant's epsilon."""
        return "\n".join(summary_lines(self.to_dict()))


def audit_final_model(
    scores: Mapping[str, np.ndarray], included, *, delta: float, confidence: float = 0.95,
    accountant_epsilon: Optional[float] = None, epoch: Optional[int] = None, step: Optional[int] = None,
    selection: str = "union", kind: Optional[str] = None, seed: int = 0,
) -> FinalModelResult:
    """Guess membership from `scores` (name -> one value per canary, larger = more likely
    included; booleans or 0/1 integers) and bound epsilon with each one-run estimator. At
    delta = 0 the "steinke" bound is pure epsilon-DP's and the "fdp" bound is nan (its
    `unavailable` says why)."""
    included = check_included(included)
    bounds = one_run_bounds(scores, included, delta=delta, confidence=confidence, selection=selection, seed=seed)
    return FinalModelResult(
        epoch=epoch, step=step, kind=kind, num_canaries=len(included), num_included=int(included.sum()),
        confidence=float(confidence), delta=float(delta), selection=selection,
        accountant_epsilon=None if accountant_epsilon is None else float(accountant_epsilon),
        bounds=bounds, histograms={name: _histogram(np.asarray(v, float), included) for name, v in scores.items()},
    )


def _histogram(values: np.ndarray, included: np.ndarray) -> tuple:
    """Common bin edges over all canaries; counts of the included and of the excluded ones."""
    low, high = (float(values.min()), float(values.max())) if len(values) else (0.0, 1.0)
    edges = np.linspace(low, high if high > low else low + 1.0, BINS + 1)
    return edges, np.histogram(values[included], edges)[0], np.histogram(values[~included], edges)[0]


def section_problem(section) -> Optional[str]:
    """What is wrong with a report's final-model section (None when the summary can read it)."""
    if not isinstance(section, dict) or not isinstance(section.get("bounds"), dict) or HEADLINE not in section["bounds"]:
        return f"has no `bounds` record with a {HEADLINE!r} bound"
    for name, bound in section["bounds"].items():
        if not isinstance(bound, dict) or not isinstance(bound.get("score"), str):
            return f"bound {name!r} names no score"
        for key in ("correct", "guesses_in", "guesses_out"):
            value = bound.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                return f"bound {name!r}: `{key}` is {shown(value)}; expected a whole number >= 0"
        epsilon = bound.get("epsilon")
        if epsilon is None and isinstance(bound.get("unavailable"), str) and bound["unavailable"]:
            continue  # not available at these settings (nan, written as null), with the reason
        if not (isinstance(epsilon, (int, float)) and not isinstance(epsilon, bool) and epsilon >= 0) and epsilon != "inf":
            return f"bound {name!r}: `epsilon` is {shown(epsilon)}; expected a number >= 0"
    return None


def histogram_panel(final_model: dict, ax) -> None:
    """Draw the included and excluded canaries' histograms of the score the bound ranked by."""
    bound = final_model["bounds"][HEADLINE]
    score = bound["score"]
    hist = final_model["histograms"][score]
    edges = np.asarray(hist["edges"], float)
    width = np.diff(edges)
    ax.bar(edges[:-1], hist["excluded"], width=width, align="edge", alpha=0.55, color="C0", label="not trained on")
    ax.bar(edges[:-1], hist["included"], width=width, align="edge", alpha=0.55, color="C3", label="trained on")
    label = SCORE_LABELS.get(score, score)
    guesses = (f"{bound['correct']} of {bound['guesses_in'] + bound['guesses_out']} guesses right"
               if bound["epsilon"] > 0 else "no guess rule did better than chance")
    claim = final_model.get("accountant_epsilon")
    versus = f" (accountant {fixed(claim, 2)})" if claim is not None else ""
    ax.set_title(f"Final model: epsilon >= {fixed(bound['epsilon'], 2)}{versus}\n{guesses}", fontsize=10)
    ax.set_xlabel(f"{label} (larger: more likely trained on)")
    ax.set_ylabel("canaries")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8, framealpha=0.9)


def summary_lines(final_model: dict) -> list:
    """The final-model section of the printed summary."""
    fm = final_model
    claim = fm.get("accountant_epsilon")
    verdict = "VIOLATION: the released model leaks beyond the claim" if fm.get("violation") else "OK: within the claim"
    when = ", ".join(f"{key} {fm[key]}" for key in ("epoch", "step") if fm.get(key) is not None)  # those the audit was given
    lines = [f"Final model ({fm.get('num_canaries')} {fm.get('kind') or ''} canaries, {fm.get('num_included')} trained on"
             f"{'; ' + when if when else ''}): {verdict}"]
    for name, label in LABELS.items():
        b = (fm.get("bounds") or {}).get(name)
        if not b:
            continue
        epsilon = as_number(b.get("epsilon"))
        if math.isnan(epsilon):
            rule = b.get("unavailable") or "not available"
        elif epsilon > 0:
            rule = (f"{b['score']}: {b['correct']}/{b['guesses_in'] + b['guesses_out']} right ({b['guesses_in']} in, "
                    f"{b['guesses_out']} out)")
        else:
            rule = "no guess rule did better than chance"
        lines.append(f"  {label:<26} {fixed(epsilon, 2):>6}   {rule}")
        if name == "fdp":
            lines.append(f"  {'':<26} {'':>6}   {FDP_NOTE}")
    lines.append(f"  {'accountant epsilon':<26} {fixed(claim, 2):>6}   {fm.get('selection')} guess selection, "
                 f"{fixed(fm.get('confidence'), 2)} confidence")
    return lines
