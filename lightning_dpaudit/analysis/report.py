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

from .final_model import histogram_panel
from .formatting import as_number as _num
from .summary import summary_table  # noqa: F401  (its home is summary.py; imported from here too)
from .verdict import DOES_NOT_DESCRIBE, pipeline_codes, violation_moment

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
    The empirical curve below the claimed one is leakage beyond the claim. Without an in- and an
    out-observation (no step audited: every one released without noise) the panel says so instead
    of the empirical curve. Returns the Figure.
    """
    fig, ax = _new_axes(ax)
    observed = _observed(in_values, out_values, histogram)
    fpr, fnr = _tradeoff_points(in_values, out_values, histogram) if observed else ([0, 1], [1, 0])
    grid = np.linspace(0.0, 1.0, 501)
    # distinct colours, line styles and markers (at different points): curves that coincide stay told apart
    ax.plot([0, 1], [1, 0], color="0.75", lw=0.8, ls=":", label="random guess")
    # clip_on=False: a curve along an axis (a leak that separates in from out) is drawn over the frame, not under it
    if observed:
        ax.plot(fpr, fnr, color="C0", lw=2.4, marker="o", ms=4, markevery=_marks(len(fpr), 9), zorder=3,
                clip_on=False, label="empirical (threshold attack)")
    else:
        ax.text(0.6, 0.8, "no observations:\nno step was audited", ha="center", fontsize=9, color="C0")
    if np.isfinite(mu_claimed):  # inf: noise multiplier 0, no claim to draw
        ax.plot(grid, gdp_fnr(grid, mu_claimed), color="C3", lw=1.5, ls="--", marker="s", ms=4, markevery=(25, 50),
                zorder=4, clip_on=False, label=f"claimed GDP, μ = {mu_claimed:.3g}")
    if mu_lower is not None and np.isfinite(mu_lower):
        ax.plot(grid, gdp_fnr(grid, mu_lower), color="C2", lw=1.5, ls="-.", marker="^", ms=4, markevery=(0, 50), zorder=5,
                clip_on=False, label=f"lower-bound GDP, μ = {mu_lower:.3g}")
    if _area(fpr, fnr) < 0.02:  # the empirical curve runs along the axes: say so, it is easy to miss there
        ax.annotate(
            "empirical curve along the axes:\nthe attack tells in- from out-canaries\nalmost without error",
            xy=(0.0, 0.0), xytext=(0.12, 0.22), fontsize=8, color="C0",
            arrowprops={"arrowstyle": "->", "color": "C0"}, bbox={"boxstyle": "round", "fc": "white", "ec": "C0"},
        )
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_aspect("equal")
    ax.set_xlabel("false positive rate (FPR)")
    ax.set_ylabel("false negative rate (FNR)")
    ax.set_title("Trade-off: empirical vs claimed")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    return fig


def _observed(in_values, out_values, histogram) -> bool:
    """Whether there is an in- and an out-observation to draw (what is missing altogether is _tradeoff_points's error)."""
    if histogram is not None:
        return bool(np.sum(histogram[1]) > 0 and np.sum(histogram[2]) > 0)
    if in_values is None or out_values is None:
        return True
    return bool(np.size(in_values) > 0 and np.size(out_values) > 0)


def _area(fpr, fnr) -> float:
    """The area under the trade-off curve (FPR increasing): near 0 for an attack that makes almost no error."""
    x, y = np.asarray(fpr, dtype=float), np.asarray(fnr, dtype=float)
    return float(np.sum(np.diff(x) * (y[1:] + y[:-1]) / 2))


def _marks(points: int, count: int):
    """markevery for about `count` markers along a line of `points` points."""
    return max(1, points // count)


LOG_SCALE_RATIO = 20.0  # a lower bound this many times the accountant's epsilon puts the epsilon axis on a log scale


def curves_figure(history, ax=None):
    """Draw the running epsilon lower bound and the accountant's epsilon against optimizer step.

    Where the lower bound reaches LOG_SCALE_RATIO x the accountant's epsilon (a broken run: often
    1,000x), the epsilon axis is logarithmic so that the accountant's line does not flatten onto zero;
    an infinite lower bound is named in the legend.
    """
    fig, ax = _new_axes(ax)
    hist = list(history or [])

    def column(key):
        vals = np.array([_num(h.get(key)) for h in hist], dtype=float)
        infinite = bool(np.any(np.isposinf(vals)))
        vals[~np.isfinite(vals)] = np.nan
        return vals, infinite

    steps, _ = column("step")
    lower, lower_inf = column("eps_lower_bound")
    accountant, _ = column("eps_accountant")
    ax.plot(steps, lower, color="C0", marker="o", ms=3.5, lw=1.8, label="empirical lower bound")
    ax.plot(steps, accountant, color="C3", ls="--", marker="s", ms=3.5, markevery=_marks(len(steps), 12), lw=1.6,
            label="accountant")
    if lower_inf:
        ax.plot([], [], ls="none", label="lower bound = inf at some steps (not drawn)")
    top_lower, top_accountant = _top(lower), _top(accountant)
    logarithmic = top_lower > 0 and top_accountant > 0 and top_lower >= LOG_SCALE_RATIO * top_accountant
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("epsilon (log scale)" if logarithmic else "epsilon")
    ax.set_title("Running epsilon")
    if logarithmic:  # steps where an epsilon is 0 are not drawn on a log axis
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, which="both" if logarithmic else "major")
    ax.legend(loc="best", fontsize=8, framealpha=0.9)
    return fig


def _top(values) -> float:
    finite = np.asarray(values, dtype=float)
    finite = finite[np.isfinite(finite)]
    return float(finite.max()) if finite.size else 0.0


def verdict_title(result) -> str:
    """The figure's title: the verdict, when it was found, then both epsilons at delta ("VIOLATION found at step 8
    (first violating step 1): epsilon >= 12.3 (empirical lower bound) vs 2.1 (accountant) at delta = 1e-05").
    `result` is an AuditResult or its dict."""
    r = result.to_dict() if hasattr(result, "to_dict") else dict(result.get("result", result))
    verdict = "VIOLATION" if r.get("violation") else "OK"
    first, detected = r.get("first_violation_step"), r.get("detected_step")
    where = "" if verdict == "OK" or first is None else f" ({violation_moment(first, None)})" if detected is None else \
        f" {violation_moment(first, detected)}"
    pipeline = pipeline_codes(r.get("findings"))
    if pipeline:
        return f"VIOLATION{where}: {DOES_NOT_DESCRIBE} ({', '.join(pipeline)})"
    return (
        f"{verdict}{where}: epsilon >= {_short(r.get('epsilon_lower_bound'))} (empirical lower bound) vs "
        f"{_short(r.get('epsilon_accountant'))} (accountant) at delta = {_num(r.get('delta')):g}"
    )


def _short(x) -> str:
    """3 significant digits, whole numbers from 1,000 up; "n/a" for a missing number, "inf" for an infinite one."""
    x = _num(x)
    return "n/a" if math.isnan(x) else "inf" if math.isinf(x) else f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def report_figure(
    in_values=None, out_values=None, history=None, *, mu_claimed: float, mu_lower: Optional[float] = None, histogram=None,
    final_model: Optional[dict] = None, result=None,
):
    """Panels side by side: the trade-off, the running epsilon curves and, with a final-model
    audit (its to_dict()), the trained model's scores of included and excluded canaries.

    The trade-off comes from the raw observations or from `histogram` (see tradeoff_figure).
    With `result` (an AuditResult or its dict) the title gives the verdict, OK or VIOLATION (red),
    both epsilons and delta (verdict_title).
    """
    fig = _figure((16.5 if final_model else 11.5, 5.4 if result is not None else 5.0))
    axes = fig.subplots(1, 3 if final_model else 2)
    tradeoff_figure(in_values, out_values, mu_claimed=mu_claimed, mu_lower=mu_lower, ax=axes[0], histogram=histogram)
    curves_figure(history, ax=axes[1])
    if final_model:
        histogram_panel(final_model, axes[2])
    if result is not None:
        title = verdict_title(result)
        fig.suptitle(title, fontsize=13, fontweight="bold", color="C3" if title.startswith("VIOLATION") else "C2")
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
        final_model=final_model, result=result,
    )
    fig.savefig(png_path, dpi=110)
    return json_path, png_path
