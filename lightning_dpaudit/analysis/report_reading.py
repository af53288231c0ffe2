"""Reading a report back: `load_report` parses audit_report.json and checks it against RESULT (types, ranges,
finiteness, a verdict its own numbers do not contradict), refusing a damaged one with ReportError naming the field."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from .final_model import section_problem
from .formatting import as_number as _num
from .report import JSON_NAME
from .schema import Field, Section, StateError, shown


class ReportError(ValueError):
    """A file that is not a readable audit report."""


_COUNTS = ("steps", "n_in", "n_out")
_NUMBERS = ("epsilon_lower_bound", "epsilon_accountant", "mu_lower_bound", "mu_claimed", "delta", "confidence")
SEGMENT_WIDTH = 0.0101  # the pooled claim of a claim segment is at most 1% above 1 / noise multiplier (claim_segments.py)


def _number(*, null: bool = True, inside: Optional[tuple] = None, positive: bool = False):
    """A report's number: JSON's number, "inf" / "-inf" (infinities), null where `null` (not available: nan).

    inside=(a, b): within the open interval; positive: > 0; otherwise >= 0. NaN (a JSON `NaN`) is refused."""

    def rule(v, ctx) -> Optional[str]:
        if v is None:
            return None if null else "is null; expected a number"
        if isinstance(v, bool) or not isinstance(v, (int, float, str)) or (isinstance(v, str) and v not in ("inf", "-inf")):
            return f"is {shown(v)}; expected a number"
        x = _num(v)
        if math.isnan(x):
            return "is NaN; expected a number (a number that was not available is written as null)"
        if inside is not None and not inside[0] < x < inside[1]:
            return f"is {v!r}; it must lie in ({inside[0]:g}, {inside[1]:g})"
        if x < 0:
            return f"is {v!r}; it cannot be negative"
        if positive and not x > 0:
            return f"is {v!r}; it must be > 0"
        return None

    return rule


_LAYER = Section(
    "layer", Field("name", "str"), Field("mu_lower_bound", "any", rule=_number()),
    Field("mu_lower_bound_anytime", "any", rule=_number()), Field("mu_claimed", "any", rule=_number(positive=True)),
    Field("n_in", "int", low=0), Field("n_out", "int", low=0), Field("violation", "bool"),
)
_FINDING = Section("finding", Field("code", "str"), Field("message", "str"),
                   Field("first_step", "int", low=0, null=True, optional=True),
                   Field("layers", "list", items=Field("name", "str"), optional=True))


def _pair_of_steps(v, ctx) -> Optional[str]:
    return None if len(v) == 2 else f"is {v!r}; expected [step, the earlier step it repeats]"


def _verdict_rule(r, ctx):
    """The verdict agrees with the numbers it comes from (each holds for every report write_report writes).

    violation is true exactly when some group's alarm fired (violating_layers) and a first violation step is
    recorded; every tensor flagged is among violating_layers and the other way round; a repeated noise is an
    alarm; without one, the pooled anytime bound is at most the claim (the alarm fires the moment it exceeds
    it; the claim of a segment may lie 1% above 1 / noise multiplier).
    """
    violation, groups = r["violation"], list(r["violating_layers"])
    verdict = "true" if violation else "false"
    if violation != bool(groups):
        return "violation", (f"is {verdict}, but `violating_layers` is {groups}: the verdict contradicts the groups "
                             "whose alarm fired")
    if "first_violation_step" in r and violation != (r["first_violation_step"] is not None):
        return "violation", (f"is {verdict}, but `first_violation_step` is {r['first_violation_step']!r}: a violation "
                             "has the step it was first recorded at, and only a violation has one")
    for layer in r.get("layers") or []:
        if layer["violation"] != (layer["name"] in groups):
            return "layers", (f"flag tensor {layer['name']!r} {'violating' if layer['violation'] else 'not violating'} "
                              f"but `violating_layers` is {groups}")
    if (r.get("noise_repeats") or 0) > 0 and not violation:
        return "violation", f"is false, but {r['noise_repeats']} step(s) repeated earlier noise, which is a violation"
    anytime, claim = r.get("mu_lower_bound_anytime"), r.get("mu_claimed")
    if not violation and anytime is not None and claim is not None and _num(anytime) > _num(claim) * (1 + SEGMENT_WIDTH):
        return "violation", (f"is false, but the anytime mu lower bound {_num(anytime):.4g} exceeds the claimed "
                             f"{_num(claim):.4g}: the alarm fires when it does")
    return None


# The report's result record (what `dpaudit report` reads), checked at load (check_report).
RESULT = Section(
    "result",
    Field("violation", "bool"),
    Field("violating_layers", "list", items=Field("name", "str")),
    *(Field(key, "int", low=0) for key in _COUNTS),
    Field("first_violation_step", "int", low=0, null=True, optional=True),
    Field("audit_failed", "str", null=True, optional=True),
    Field("epsilon_lower_bound", "any", rule=_number()),
    Field("epsilon_accountant", "any", rule=_number()),
    Field("mu_lower_bound", "any", rule=_number()),
    Field("mu_claimed", "any", rule=_number(null=False, positive=True)),
    Field("delta", "any", rule=_number(null=False, inside=(0, 1))),
    Field("confidence", "any", rule=_number(null=False, inside=(0, 1))),
    *(Field(key, "any", rule=_number(), optional=True)
      for key in ("mu_lower_bound_anytime", "epsilon_step_lower_bound", "epsilon_step_claimed")),
    Field("noise_repeats", "int", low=0, optional=True),
    Field("first_noise_repeat", "list", items=Field("step", "int", low=1), rule=_pair_of_steps, null=True,
          optional=True),
    Field("layers", "list", items=_LAYER, optional=True),
    Field("findings", "list", items=_FINDING, optional=True),
    *(Field(key, "str", optional=True) for key in ("estimator", "mode", "canary", "data_path", "pipeline")),
    Field("notes", "list", items=Field("note", "str"), optional=True),
    Field("epsilon_sampling", "any", rule=_number(), optional=True),
    rules=(_verdict_rule,),
)


def _bins(h, ctx) -> Optional[tuple]:
    """One count of each kind per bin: a bin between each two edges."""
    bins = len(h["edges"]) - 1
    for key in ("included", "excluded"):
        if len(h[key]) != bins:
            return key, f"holds {len(h[key])} counts for {len(h['edges'])} edges; expected {bins}, one per bin"
    return None


_COUNTS_OF = Field("count", "int", low=0)
_HISTOGRAM = Section("histogram", Field("edges", "list", items=Field("edge", "real")),
                     Field("included", "list", items=_COUNTS_OF), Field("excluded", "list", items=_COUNTS_OF),
                     rules=(_bins,))

# The final-model section's fields beside its bounds (final_model.section_problem checks those), each as
# FinalModelResult.to_dict writes it; the summary prints them and the histograms' counts draw its figure.
FINAL_MODEL = Section(
    "final_model",
    Field("accountant_epsilon", "any", rule=_number(), optional=True),
    *(Field(key, "int", low=0, optional=True) for key in ("num_canaries", "num_included")),
    *(Field(key, "int", low=0, null=True, optional=True) for key in ("epoch", "step")),
    Field("kind", "str", null=True, optional=True),
    Field("selection", "str", optional=True),
    Field("confidence", "any", rule=_number(inside=(0, 1)), optional=True),
    Field("violation", "bool", optional=True),
    Field("histograms", "map", items=_HISTOGRAM, label="{path}[{key!r}]", optional=True),
)


def _json_infinity(report) -> Optional[str]:
    """Where `report` (as json.loads read it) holds JSON's Infinity or -Infinity, which write_report never writes
    (strict JSON: an infinite number is "inf" or "-inf"); None if nowhere. Iterative: as deep as the parser went."""
    stack = [("", report)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and math.isinf(value):
            return where or "the report"
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        stack.extend((f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key), item)
                     for key, item in reversed(list(items)))
    return None


def load_report(directory) -> dict:
    """Read directory/audit_report.json back as a dict; ReportError (one line naming the file and
    what is wrong) for a damaged or foreign file, or one whose numbers contradict its verdict."""
    path = Path(directory) / JSON_NAME
    if not path.exists():
        raise FileNotFoundError(f"no audit report at {path} (write one with write_report)")
    if not path.is_file():
        raise ReportError(f"{path} is not a file")
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ReportError(f"{path} is not a text file: not an audit report") from None
    except json.JSONDecodeError as error:
        raise ReportError(f"{path} is not valid JSON ({error.msg} at line {error.lineno}): damaged or truncated") from None
    except RecursionError:
        raise ReportError(f"{path} is nested too deeply to read (deeper than any audit report): damaged or not an audit report") from None
    except ValueError as error:  # an integer beyond Python's digit limit for int() (4300 digits by default)
        raise ReportError(f"{path} holds a number too long to read ({error}): damaged or not an audit report") from None
    infinite = _json_infinity(report)
    if infinite is not None:
        raise ReportError(f'{path}: `{infinite}` is JSON\'s Infinity, which write_report never writes (an infinite number is '
                          '"inf" or "-inf"): damaged or not an audit report')
    check_report(report, path)
    return report


def check_report(report, path) -> None:
    """The result record against RESULT (types, ranges, NaN, the verdict against its numbers) and the final-model section."""
    if not isinstance(report, dict) or not isinstance(report.get("result"), dict):
        raise ReportError(f"{path} has no `result` record: not an audit report of lightning_dpaudit")
    r = report["result"]
    missing = [k for k in ("violation", "violating_layers", *_COUNTS, *_NUMBERS) if k not in r]
    if missing:
        raise ReportError(f"{path}: the result lacks {', '.join(missing)}: not an audit report, or a damaged one")
    try:
        RESULT.check(r)
    except StateError as error:
        raise ReportError(f"{path}: {error}") from None
    if "final_model" in report and section_problem(report["final_model"]):
        raise ReportError(f"{path}: the final-model section {section_problem(report['final_model'])}")
    if "final_model" in report:
        try:
            FINAL_MODEL.check(report["final_model"])
        except StateError as error:
            raise ReportError(f"{path}: the final-model section's {error}") from None
