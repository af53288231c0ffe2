"""Values the callback writes: TensorBoard histograms, finite metrics, plain settings, versions,
and checkpoint state in a form torch.load(weights_only=True) reads."""

from __future__ import annotations

import math

import numpy as np
import torch

EPSILON_STEPS_TAG = "dpaudit/epsilon_steps"  # TensorBoard text: which log steps have an epsilon point, and why


def chart_layout(log_every_n_steps: int, logging_budget: float) -> dict:
    """TensorBoard's Custom Scalars: both epsilons on one chart, both mus on another. The epsilon
    chart's title says which steps have a point."""
    if logging_budget >= 1.0:
        covers = f"a point every {log_every_n_steps} steps"
    else:
        covers = (f"points only at log steps where computing them stays within {logging_budget * 100:g}% of wall time; "
                  f"steps listed in text {EPSILON_STEPS_TAG}")
    return {
        "dpaudit": {
            f"epsilon: empirical lower bound vs accountant ({covers})":
                ["Multiline", ["dpaudit/eps_lower_bound", "dpaudit/eps_accountant", "dpaudit/eps_sampling"]],
            f"per-step mu: lower bound vs claimed (a point every {log_every_n_steps} steps)":
                ["Multiline", ["dpaudit/mu_lower_bound", "dpaudit/mu_claimed"]],
        }
    }


def epsilon_steps_text(steps: list, log_every_n_steps: int, last_step: int, logging_budget: float) -> str:
    """One paragraph for TensorBoard: the steps that have an epsilon point, out of how many log
    steps, and why the others have none."""
    log_steps = last_step // log_every_n_steps + (last_step % log_every_n_steps != 0)
    shown = [str(s) for s in steps] if len(steps) <= 40 else [*map(str, steps[:30]), "...", *map(str, steps[-5:])]
    text = (f"Epsilon points at steps {', '.join(shown) or 'none'}: {len(steps)} of {log_steps} log steps "
            f"(every {log_every_n_steps} steps, and the last).")
    if len(steps) < log_steps:
        text += (f" The other log steps have no epsilon point: computing both epsilons there would have taken more "
                 f"than logging_budget={logging_budget:g} of the wall time. The per-step mu curves have every log "
                 f"step; logging_budget=1.0 gives an epsilon point at every log step.")
    return text


def _add_histogram(writer, tag: str, edges: np.ndarray, counts: np.ndarray, step: int) -> None:
    """A fixed-bin histogram (edges -inf, finite edges, +inf) to TensorBoard, without the raw values.

    Only the span from the first to the last non-empty bin is written; the underflow and
    overflow bins are drawn one bin wide beyond the finite edges. min, max, sum and
    sum_squares are those of the bins (midpoints), not of the values.
    """
    counts = np.asarray(counts)
    filled = np.flatnonzero(counts)
    if filled.size == 0:
        return
    finite = np.asarray(edges, dtype=float)[1:-1]
    width = finite[1] - finite[0]
    lower = np.concatenate([[finite[0] - width], finite])
    upper = np.concatenate([finite, [finite[-1] + width]])
    span = slice(int(filled[0]), int(filled[-1]) + 1)
    kept, middle = counts[span], (lower[span] + upper[span]) / 2
    writer.add_histogram_raw(
        tag,
        min=float(lower[span][0]),
        max=float(upper[span][-1]),
        num=int(kept.sum()),
        sum=float(kept @ middle),
        sum_squares=float(kept @ middle**2),
        bucket_limits=upper[span].tolist(),
        bucket_counts=kept.tolist(),
        global_step=step,
    )


def _finite(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(v)}


def _plain(options: dict) -> dict:
    def plain(v):
        if isinstance(v, (str, int, float, bool, type(None))):
            return v
        if torch.is_tensor(v):
            return f"tensor of shape {tuple(v.shape)}"
        return getattr(v, "kind", None) or repr(v)

    return {k: plain(v) for k, v in options.items()}


def _versions() -> dict:
    """The installed versions of the package and of what it audits with (as the package metadata states them)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:  # run from a source tree that was never installed
            return "unknown"

    return {name: installed(name) for name in ("lightning_dpaudit", "torch", "opacus", "pytorch_lightning")}


def _to_checkpoint(value):
    """numpy arrays as torch tensors, so the state loads with torch.load(weights_only=True)."""
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return [_to_checkpoint(v) for v in value]
        return {"__ndarray__": torch.from_numpy(np.ascontiguousarray(value)), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {k: _to_checkpoint(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_checkpoint(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _from_checkpoint(value):
    if isinstance(value, dict) and "__ndarray__" in value:
        return value["__ndarray__"].numpy().astype(value["dtype"])
    if isinstance(value, dict):
        return {k: _from_checkpoint(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_checkpoint(v) for v in value]
    return value
