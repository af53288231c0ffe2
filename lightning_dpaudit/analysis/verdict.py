"""The verdict's words: the codes and phrases every summary, alert and report of a result shares."""

from __future__ import annotations

from typing import Optional

VERDICT = "DP AUDIT VIOLATION"  # the first words of every violation alert
# findings about the run beyond the optimizer (engine/checks/run/): the accountant's epsilon is not this run's
PIPELINE_CODES = ("sampling", "multiplicity", "coupled_examples", "outside_dp")
DIVERGED = "training_diverged"  # a fault, no violation: the audit observes nothing from the step it names on
DOES_NOT_DESCRIBE = "the accountant's epsilon does not describe this run"


def pipeline_codes(findings) -> list:
    """The codes of the run's pipeline findings, in order, once each (findings as records or dicts)."""
    found = [(f.get("code"), f.get("scope")) if isinstance(f, dict) else (f.code, f.scope) for f in findings or ()]
    return list(dict.fromkeys(c for c, scope in found if c in PIPELINE_CODES or scope == "pipeline"))


def violation_moment(first_step: Optional[int], detected_step: Optional[int]) -> str:
    """When a violation was seen: "found at step 8 (first violating step 1)", or "first violating step 1" while
    no alarm was given (and in reports written before the detection step was recorded); "" without one."""
    if first_step is None:
        return ""
    if detected_step is None:
        return f"first violating step {first_step}"
    return f"found at step {detected_step} (first violating step {first_step})"
