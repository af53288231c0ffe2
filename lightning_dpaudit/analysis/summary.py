"""The summary table of an audit: the verdict first (the accountant's epsilon not describing the run before any
leak beyond the claim), findings, both epsilons and the mu rows, the run's facts and one row per tensor."""

from __future__ import annotations

import math

from .final_model import summary_lines as final_model_lines
from .formatting import as_number as _num, fixed as _f
from .verdict import DIVERGED, DOES_NOT_DESCRIBE, pipeline_codes, violation_moment


def summary_table(report: dict) -> str:
    """A short aligned plain-text summary of a loaded report (or {"result": result.to_dict()})."""
    r = report.get("result", report)
    bad = list(r.get("violating_layers") or [])
    pipeline = pipeline_codes(r.get("findings"))
    if r.get("violation"):
        moment = violation_moment(r.get("first_violation_step"), r.get("detected_step"))
        where = f"; {moment}" if moment else ""
        verdict = f"VIOLATION: leak beyond the claim {_violating(bad)}{where}"
        if pipeline:
            verdict = f"VIOLATION: {DOES_NOT_DESCRIBE} ({', '.join(pipeline)}){where}"
    else:
        verdict = "OK: no leak beyond the claim detected"
        diverged = next((f for f in r.get("findings") or [] if f.get("code") == DIVERGED), None)
        if diverged is not None:
            verdict += f" before step {diverged.get('first_step')}, where training diverged (nothing after is audited)"
        if str(r.get("data_path") or "").startswith("nothing compared"):  # say what the OK rests on
            verdict += "; the exact checks compared nothing (see below)"
    stopped = [f"{name} ({why})" for name, why in r.get("checks_stopped") or []]
    if stopped:  # what the verdict does not rest on
        verdict += f"; check(s) stopped: {', '.join(stopped)}"
    conf = _num(r.get("confidence"))
    rows = [
        ("", "lower bound", "claimed"),
        (f"epsilon (delta={_num(r.get('delta')):.3g})", _f(r.get("epsilon_lower_bound"), 2), _f(r.get("epsilon_accountant"), 2) + " (accountant)"),
        ("epsilon per step", _f(r.get("epsilon_step_lower_bound"), 2), _f(r.get("epsilon_step_claimed"), 2)),
        ("mu per step", _f(r.get("mu_lower_bound")), _f(r.get("mu_claimed"))),
        ("mu per step, anytime", _f(r.get("mu_lower_bound_anytime")), ""),
        *_sampling_row(r),
    ]
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len(b) for _, b, _ in rows)
    lines = [verdict, *_failure_line(r), *_finding_lines(r), ""]
    lines += [f"  {a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows]
    facts = [
        ("observations", f"in {r.get('n_in')} / out {r.get('n_out')}"),
        ("steps", f"{r.get('steps')}   noise repeats: {r.get('noise_repeats')}{_first_repeat(r)}"),
        ("estimator", f"{r.get('estimator')} at {conf:.0%} confidence" if not math.isnan(conf) else str(r.get("estimator"))),
        ("mode / canary", f"{r.get('mode')} / {r.get('canary')}"),
        *([("exact checks", r["data_path"])] if r.get("data_path") else []),
        *([("run checks", r["pipeline"])] if r.get("pipeline") else []),
    ]
    lines += [f"  {a:<{w0}}  {b}" for a, b in facts]
    lines += [f"  note: {_note(note)}" for note in r.get("notes") or []]
    layers = list(r.get("layers") or [])
    if layers:
        wn = max(5, max(len(str(layer.get("name"))) for layer in layers))
        lines += ["", f"  {'layer':<{wn}}  {'mu lower':>8}  {'mu claimed':>10}  {'n in/out':>13}  flag"]
        for layer in layers:
            n = f"{layer.get('n_in')}/{layer.get('n_out')}"
            flag = _layer_flag(layer)
            lines.append(
                f"  {str(layer.get('name')):<{wn}}  {_f(layer.get('mu_lower_bound')):>8}  "
                f"{_f(layer.get('mu_claimed')):>10}  {n:>13}  {flag}".rstrip()
            )
    if isinstance(report.get("final_model"), dict):
        lines += ["", *final_model_lines(report["final_model"])]
    return "\n".join(lines)


def _layer_flag(layer: dict) -> str:
    """VIOLATION where the tensor's alarm fired; where its one-look bound is above its claim without that, why not."""
    if layer.get("violation"):
        return "VIOLATION"
    lower, claimed = _num(layer.get("mu_lower_bound")), _num(layer.get("mu_claimed"))
    if lower > claimed:
        return (f"above its claim at one look; no alarm: the anytime bound the alarm uses is "
                f"{_f(layer.get('mu_lower_bound_anytime'))}, within it")
    return ""


GROUPS = ("pooled", "noise repeats", "noise correlated", "exact checks")  # violating groups that are not layers


def _violating(names: list) -> str:
    """Where the alarm fired: "in 2 layers (a, b)", with the groups named as such ("in pooled, noise repeats
    and 1 layer (a)"); only tensors are counted as layers."""
    if not names:
        return "(where: unknown)"
    groups = [name for name in names if name in GROUPS]
    layers = [name for name in names if name not in GROUPS]
    parts = groups + ([f"{len(layers)} layer{'s' * (len(layers) != 1)} ({', '.join(layers)})"] if layers else [])
    return "in " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0])


def _sampling_row(r: dict) -> list:
    """Epsilon under the sampling the run used, where it is not the accountant's (inf: no valid bound)."""
    value = r.get("epsilon_sampling")
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return []
    return [("epsilon, sampling used", "", (_f(value, 2) if value not in ("inf", math.inf) else "no valid bound")
             + " (batches as drawn)")]


def _failure_line(r: dict) -> list:
    """The first error of the audit's own code, when there was one (training went on)."""
    failed = r.get("audit_failed")
    return [f"AUDIT FAILED: {failed} (training went on; what the audit saw stops there or is incomplete)"] if failed else []


def _finding_lines(r: dict) -> list:
    """One line per finding (a report written before findings existed has none)."""
    return [f"  - {f.get('code')}: {f.get('message')}" for f in r.get("findings") or []]


# notes the summary shortens to one line: their code -> the page that explains them (the result keeps the full text)
NOTE_PAGES = {"normalisation": "docs/guide/data-path.md (Normalisation)"}


def _note(note: str) -> str:
    """A note as one line: one with a page of its own keeps its code and what was found, up to the first colon,
    then names the page ("normalisation: the update is divided by expected_batch_size = 61, derived from the
    dataset's size; see docs/guide/data-path.md (Normalisation)")."""
    code, _, message = str(note).partition(": ")
    if code not in NOTE_PAGES:
        return str(note)
    return f"{code}: {message.split(':')[0]}; see {NOTE_PAGES[code]}"


def _first_repeat(r: dict) -> str:
    first = r.get("first_noise_repeat")
    return f" (first: step {first[0]} repeats step {first[1]})" if first else ""
