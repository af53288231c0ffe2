"""Audit reports: trade-off and running-epsilon figures, a JSON + PNG record, a terminal table.

Plain numpy/scipy/matplotlib; figures are drawn on Agg canvases without pyplot, so importing
this module never changes the matplotlib backend. Never imports torch or Lightning.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np
from scipy.stats import norm

from .final_model import histogram_panel, section_problem
from .formatting import as_number as _num
from .formatting import fixed as _f
from .final_model import summary_lines as final_model_lines

JSON_NAME = "audit_report.json"
PNG_NAME = "audit_report.png"
MAX_THRESHOLDS = 2000


def _figure(figsize):
    """A Figure on an Agg canvas, outside pyplot: no global backend change, nothing to close."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def _new_axes(ax):
    if ax is not None:
        return ax.figure, ax
    fig = _figure((5.5, 5.2))
    return fig, fig.add_subplot()


def gdp_fnr(fpr, mu: float) -> np.ndarray:
    """FNR of the best test against mu-GDP at the given FPR: Phi(Phi^-1(1 - FPR) - mu)."""
    return norm.cdf(norm.ppf(1.0 - np.asarray(fpr, dtype=float)) - mu)


def empirical_tradeoff(in_values, out_values, max_thresholds: int = MAX_THRESHOLDS, thresholds=None):
    """(FPR, FNR) of the attack "in if score >= t" from raw observations.

    Without `thresholds`, t sweeps the pooled observations: at most `max_thresholds` of
    them (evenly spaced quantiles of the pooled sorted scores), plus the two trivial
    attacks (everything in: (1, 0); nothing in: (0, 1)). With `thresholds`, t takes
    exactly those values, largest first. FPR is increasing along the returned arrays.
    """
    ins = np.sort(np.asarray(in_values, dtype=float).ravel())
    outs = np.sort(np.asarray(out_values, dtype=float).ravel())
    if ins.size == 0 or outs.size == 0:
        raise ValueError("need at least one in- and one out-observation")
    if thresholds is not None:
        t = np.sort(np.asarray(thresholds, dtype=float).ravel())[::-1]
    else:
        pooled = np.unique(np.concatenate([ins, outs]))
        if pooled.size > max_thresholds:
            pooled = pooled[np.unique(np.linspace(0, pooled.size - 1, max_thresholds).round().astype(int))]
        t = np.concatenate([[np.inf], pooled[::-1], [-np.inf]])
    fpr = (outs.size - np.searchsorted(outs, t, side="left")) / outs.size  # P(out >= t)
    fnr = np.searchsorted(ins, t, side="left") / ins.size  # P(in < t)
    return fpr, fnr


def tradeoff_from_histograms(edges, in_counts, out_counts):
    """(FPR, FNR) of the attack "in if score >= t" at every bin edge t, largest first.

    counts[i] is the number of observations in [edges[i], edges[i + 1]), so
    len(counts) == len(edges) - 1, and the counts must hold every observation: use -inf
    and +inf as the outer edges for the underflow and overflow (as
    `ObservationLog.histogram` does). At an edge t the false positives are the
    out-counts from t up and the false negatives the in-counts below t, so the result
    equals `empirical_tradeoff(ins, outs, thresholds=edges)` on the raw values, exactly.
    With infinite outer edges it starts at (0, 1) (nothing in) and ends at (1, 0)
    (everything in). FPR is increasing along the returned arrays.
    """
    edges = np.asarray(edges, dtype=float).ravel()
    ins = np.asarray(in_counts).ravel()
    outs = np.asarray(out_counts).ravel()
    if ins.size != edges.size - 1 or outs.size != edges.size - 1:
        raise ValueError(
            f"need one count per bin: {edges.size} edges make {edges.size - 1} bins, "
            f"got {ins.size} in-counts and {outs.size} out-counts"
        )
    if np.any(np.diff(edges) < 0):
        raise ValueError("`edges` must be non-decreasing")
    if np.any(ins < 0) or np.any(outs < 0):
        raise ValueError("counts must be >= 0")
    n_in, n_out = int(ins.sum()), int(outs.sum())
    if n_in == 0 or n_out == 0:
        raise ValueError("need at least one in- and one out-observation")
    out_at_or_above = np.concatenate([np.cumsum(outs[::-1])[::-1], [0]])  # at edge k: sum(outs[k:])
    in_below = np.concatenate([[0], np.cumsum(ins)])  # at edge k: sum(ins[:k])
    return out_at_or_above[::-1] / n_out, in_below[::-1] / n_in


def _tradeoff_points(in_values, out_values, histogram):
    """The empirical curve from raw values or from (edges, in_counts, out_counts)."""
    if histogram is None:
        if in_values is None or out_values is None:
            raise ValueError("pass the observations (in_values and out_values) or `histogram`")
        return empirical_tradeoff(in_values, out_values)
    if in_values is not None or out_values is not None:
        raise ValueError("pass the observations (in_values and out_values) or `histogram`, not both")
    fpr, fnr = tradeoff_from_histograms(*histogram)
    changed = np.concatenate([[True], (np.diff(fpr) != 0) | (np.diff(fnr) != 0)])
    return fpr[changed], fnr[changed]  # empty bins repeat a point: the same line with fewer points


def tradeoff_figure(
    in_values=None, out_values=None, *, mu_claimed: float, mu_lower: Optional[float] = None, ax=None, histogram=None
):
    """Draw the threshold attack's empirical FPR-FNR trade-off against the GDP curves.

    The empirical curve comes from the raw observations (in_values, out_values) or from
    histogram = (edges, in_counts, out_counts) (see tradeoff_from_histograms), which is
    exact at every bin edge. Lines: the empirical curve, the mu_claimed-GDP curve (the
    least FNR a correct step allows at each FPR) and, if given, the mu_lower-GDP curve.
    The empirical curve below the claimed one is leakage beyond the claim. Returns the
    Figure.
    """
    fig, ax = _new_axes(ax)
    fpr, fnr = _tradeoff_points(in_values, out_values, histogram)
    grid = np.linspace(0.0, 1.0, 501)
    ax.plot([0, 1], [1, 0], color="0.75", lw=0.8, ls=":", label="random guess")
    ax.plot(fpr, fnr, color="C0", lw=1.8, label="empirical (threshold attack)")
    ax.plot(grid, gdp_fnr(grid, mu_claimed), color="C3", lw=1.5, ls="--", label=f"claimed GDP, μ = {mu_claimed:.3g}")
    if mu_lower is not None and np.isfinite(mu_lower):
        ax.plot(grid, gdp_fnr(grid, mu_lower), color="C2", lw=1.5, ls="-.", label=f"lower-bound GDP, μ = {mu_lower:.3g}")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_aspect("equal")
    ax.set_xlabel("false positive rate (FPR)")
    ax.set_ylabel("false negative rate (FNR)")
    ax.set_title("Trade-off: empirical vs claimed")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    return fig


def curves_figure(history, ax=None):
    """Draw the running epsilon lower bound and the accountant's epsilon against optimizer step."""
    fig, ax = _new_axes(ax)
    hist = list(history or [])

    def column(key):
        vals = np.array([_num(h.get(key)) for h in hist], dtype=float)
        vals[~np.isfinite(vals)] = np.nan
        return vals

    steps = column("step")
    ax.plot(steps, column("eps_lower_bound"), color="C0", marker=".", ms=3, lw=1.6, label="empirical lower bound")
    ax.plot(steps, column("eps_accountant"), color="C3", ls="--", lw=1.6, label="accountant")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("epsilon")
    ax.set_title("Running epsilon")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8, framealpha=0.9)
    return fig


def report_figure(
    in_values=None, out_values=None, history=None, *, mu_claimed: float, mu_lower: Optional[float] = None, histogram=None,
    final_model: Optional[dict] = None,
):
    """Panels side by side: the trade-off, the running epsilon curves and, with a final-model
    audit (its to_dict()), the trained model's scores of included and excluded canaries.

    The trade-off comes from the raw observations or from `histogram` (see tradeoff_figure).
    """
    fig = _figure((16.5 if final_model else 11.5, 5.0))
    axes = fig.subplots(1, 3 if final_model else 2)
    tradeoff_figure(in_values, out_values, mu_claimed=mu_claimed, mu_lower=mu_lower, ax=axes[0], histogram=histogram)
    curves_figure(history, ax=axes[1])
    if final_model:
        histogram_panel(final_model, axes[2])
    fig.tight_layout()
    return fig


def _jsonable(obj: Any) -> Any:
    """Strict-JSON version of obj: tuples/arrays to lists, numpy scalars to Python, nan -> null, +-inf -> "inf"/"-inf"."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, np.ndarray)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        x = float(obj)
        if math.isnan(x):
            return None
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if obj is None or isinstance(obj, str):
        return obj
    return str(obj)


def write_report(
    directory, result, *, settings: dict, versions: dict, history: list, in_values=None, out_values=None, histogram=None,
    final_model: Optional[dict] = None,
):
    """Write directory/audit_report.json (result, settings, versions, history) and audit_report.png.

    The PNG's trade-off comes from the raw observations (in_values, out_values) or from
    histogram = (edges, in_counts, out_counts). The JSON is strict (nan -> null,
    infinities -> "inf"/"-inf"). final_model: the final-model audit's section (its result's
    to_dict(), with "history": the bounds during training). Returns (json_path, png_path).
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "result": result.to_dict(),
        "settings": dict(settings or {}),
        "versions": dict(versions or {}),
        "history": list(history or []),
    }
    if final_model:
        record["final_model"] = final_model
    json_path, png_path = out / JSON_NAME, out / PNG_NAME
    json_path.write_text(json.dumps(_jsonable(record), indent=2, allow_nan=False) + "\n")
    fig = report_figure(
        in_values, out_values, history, mu_claimed=result.mu_claimed, mu_lower=result.mu_lower_bound, histogram=histogram,
        final_model=final_model,
    )
    fig.savefig(png_path, dpi=110)
    return json_path, png_path


class ReportError(ValueError):
    """A file that is not a readable audit report."""


_COUNTS = ("steps", "n_in", "n_out")
_NUMBERS = ("epsilon_lower_bound", "epsilon_accountant", "mu_lower_bound", "mu_claimed", "delta", "confidence")


def load_report(directory) -> dict:
    """Read directory/audit_report.json back as a dict; ReportError (one line naming the file and
    what is wrong) for a damaged or foreign file."""
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
    check_report(report, path)
    return report


def check_report(report, path) -> None:
    """The fields the summary reads, with their types and ranges."""
    if not isinstance(report, dict) or not isinstance(report.get("result"), dict):
        raise ReportError(f"{path} has no `result` record: not an audit report of lightning_dpaudit")
    r = report["result"]
    missing = [k for k in ("violation", "violating_layers", *_COUNTS, *_NUMBERS) if k not in r]
    if missing:
        raise ReportError(f"{path}: the result lacks {', '.join(missing)}: not an audit report, or a damaged one")
    if not isinstance(r["violation"], bool):
        raise ReportError(f"{path}: `violation` is {r['violation']!r}; expected true or false")
    layers = r["violating_layers"]
    if not isinstance(layers, list) or not all(isinstance(x, str) for x in layers):
        raise ReportError(f"{path}: `violating_layers` is {layers!r}; expected a list of names")
    for key in _COUNTS:
        v = r[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ReportError(f"{path}: `{key}` is {v!r}; expected a whole number >= 0")
    first = r.get("first_violation_step")
    if first is not None and (isinstance(first, bool) or not isinstance(first, int) or first < 0):
        raise ReportError(f"{path}: `first_violation_step` is {first!r}; expected a step number or null")
    failed = r.get("audit_failed")
    if failed is not None and not isinstance(failed, str):
        raise ReportError(f"{path}: `audit_failed` is {failed!r}; expected the cause (a string) or null")
    if "final_model" in report and section_problem(report["final_model"]):
        raise ReportError(f"{path}: the final-model section {section_problem(report['final_model'])}")
    for key in _NUMBERS:
        v = r[key]
        if v is None:  # a number that was not available (nan is written as null)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float, str)) or (isinstance(v, str) and v not in ("inf", "-inf", "nan")):
            raise ReportError(f"{path}: `{key}` is {v!r}; expected a number")
        if _num(v) < 0:
            raise ReportError(f"{path}: `{key}` is {v!r}; it cannot be negative")


def summary_table(report: dict) -> str:
    """A short aligned plain-text summary of a loaded report (or {"result": result.to_dict()})."""
    r = report.get("result", report)
    bad = list(r.get("violating_layers") or [])
    if r.get("violation"):
        first = r.get("first_violation_step")
        where = f"; first at step {first}" if first is not None else ""
        names = ", ".join(bad) if bad else "unknown"
        verdict = f"VIOLATION: leak beyond the claim in {len(bad)} layer{'s' * (len(bad) != 1)} ({names}){where}"
    else:
        verdict = "OK: no leak beyond the claim detected"
    conf = _num(r.get("confidence"))
    rows = [
        ("", "lower bound", "claimed"),
        (f"epsilon (delta={_num(r.get('delta')):.3g})", _f(r.get("epsilon_lower_bound"), 2), _f(r.get("epsilon_accountant"), 2) + " (accountant)"),
        ("epsilon per step", _f(r.get("epsilon_step_lower_bound"), 2), _f(r.get("epsilon_step_claimed"), 2)),
        ("mu per step", _f(r.get("mu_lower_bound")), _f(r.get("mu_claimed"))),
        ("mu per step, anytime", _f(r.get("mu_lower_bound_anytime")), ""),
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
    ]
    lines += [f"  {a:<{w0}}  {b}" for a, b in facts]
    lines += [f"  note: {note}" for note in r.get("notes") or []]
    layers = list(r.get("layers") or [])
    if layers:
        wn = max(5, max(len(str(layer.get("name"))) for layer in layers))
        lines += ["", f"  {'layer':<{wn}}  {'mu lower':>8}  {'mu claimed':>10}  {'n in/out':>13}  flag"]
        for layer in layers:
            n = f"{layer.get('n_in')}/{layer.get('n_out')}"
            flag = "VIOLATION" if layer.get("violation") else ""
            lines.append(
                f"  {str(layer.get('name')):<{wn}}  {_f(layer.get('mu_lower_bound')):>8}  "
                f"{_f(layer.get('mu_claimed')):>10}  {n:>13}  {flag}".rstrip()
            )
    if isinstance(report.get("final_model"), dict):
        lines += ["", *final_model_lines(report["final_model"])]
    return "\n".join(lines)


def _failure_line(r: dict) -> list:
    """The first error of the audit's own code, when there was one (training went on)."""
    failed = r.get("audit_failed")
    return [f"AUDIT FAILED: {failed} (training went on; what the audit saw stops there or is incomplete)"] if failed else []


def _finding_lines(r: dict) -> list:
    """One line per finding (a report written before findings existed has none)."""
    return [f"  - {f.get('code')}: {f.get('message')}" for f in r.get("findings") or []]


def _first_repeat(r: dict) -> str:
    first = r.get("first_noise_repeat")
    return f" (first: step {first[0]} repeats step {first[1]})" if first else ""
