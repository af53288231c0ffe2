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


def empirical_tradeoff(in_values, out_values, max_thresholds: int = MAX_THRESHOLDS):
    """(FPR, FNR) of the attack "in if score >= t" for t swept over the pooled observations.

    At most `max_thresholds` thresholds (evenly spaced quantiles of the pooled sorted
    scores), plus the two trivial attacks (everything in: (1, 0); nothing in: (0, 1)).
    FPR is increasing along the returned arrays.
    """
    ins = np.sort(np.asarray(in_values, dtype=float).ravel())
    outs = np.sort(np.asarray(out_values, dtype=float).ravel())
    if ins.size == 0 or outs.size == 0:
        raise ValueError("need at least one in- and one out-observation")
    pooled = np.unique(np.concatenate([ins, outs]))
    if pooled.size > max_thresholds:
        pooled = pooled[np.unique(np.linspace(0, pooled.size - 1, max_thresholds).round().astype(int))]
    t = np.concatenate([[np.inf], pooled[::-1], [-np.inf]])
    fpr = 1.0 - np.searchsorted(outs, t, side="left") / outs.size  # P(out >= t)
    fnr = np.searchsorted(ins, t, side="left") / ins.size  # P(in < t)
    return fpr, fnr


def tradeoff_figure(in_values, out_values, *, mu_claimed: float, mu_lower: Optional[float] = None, ax=None):
    """Draw the threshold attack's empirical FPR-FNR trade-off against the GDP curves.

    Lines: the empirical curve, the mu_claimed-GDP curve (the least FNR a correct step
    allows at each FPR) and, if given, the mu_lower-GDP curve. The empirical curve below
    the claimed one is leakage beyond the claim. Returns the Figure.
    """
    fig, ax = _new_axes(ax)
    fpr, fnr = empirical_tradeoff(in_values, out_values)
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


def report_figure(in_values, out_values, history, *, mu_claimed: float, mu_lower: Optional[float] = None):
    """Two panels side by side: the trade-off (left) and the running epsilon curves (right)."""
    fig = _figure((11.5, 5.0))
    left, right = fig.subplots(1, 2)
    tradeoff_figure(in_values, out_values, mu_claimed=mu_claimed, mu_lower=mu_lower, ax=left)
    curves_figure(history, ax=right)
    fig.tight_layout()
    return fig


def _num(x) -> float:
    """A JSON-loaded number back to float: None -> nan, "inf"/"-inf"/"nan" strings -> floats."""
    if x is None:
        return math.nan
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return math.nan
    return float(x)


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


def write_report(directory, result, *, settings: dict, versions: dict, history: list, in_values, out_values):
    """Write directory/audit_report.json (result, settings, versions, history) and audit_report.png.

    The JSON is strict (nan -> null, infinities -> "inf"/"-inf"). Returns (json_path, png_path).
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "result": result.to_dict(),
        "settings": dict(settings or {}),
        "versions": dict(versions or {}),
        "history": list(history or []),
    }
    json_path, png_path = out / JSON_NAME, out / PNG_NAME
    json_path.write_text(json.dumps(_jsonable(record), indent=2, allow_nan=False) + "\n")
    fig = report_figure(in_values, out_values, history, mu_claimed=result.mu_claimed, mu_lower=result.mu_lower_bound)
    fig.savefig(png_path, dpi=110)
    return json_path, png_path


def load_report(directory) -> dict:
    """Read directory/audit_report.json back as a dict."""
    path = Path(directory) / JSON_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no audit report at {path} (write one with write_report)")
    return json.loads(path.read_text())


def _f(x, digits: int = 3) -> str:
    x = _num(x)
    return "n/a" if math.isnan(x) else f"{x:.{digits}g}" if math.isinf(x) else f"{x:.{digits}f}"


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
    lines = [verdict, ""]
    lines += [f"  {a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows]
    facts = [
        ("observations", f"in {r.get('n_in')} / out {r.get('n_out')}"),
        ("steps", f"{r.get('steps')}   noise repeats: {r.get('noise_repeats')}"),
        ("estimator", f"{r.get('estimator')} at {conf:.0%} confidence" if not math.isnan(conf) else str(r.get("estimator"))),
        ("mode / canary", f"{r.get('mode')} / {r.get('canary')}"),
    ]
    lines += [f"  {a:<{w0}}  {b}" for a, b in facts]
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
    return "\n".join(lines)
