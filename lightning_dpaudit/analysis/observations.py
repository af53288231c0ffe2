"""Normalized canary observations, kept in memory and state that do not grow with the run.

One observation per canary per noised step: the step, the parameter tensor ("layer")
the canary sat in, its kind, whether it entered the step (in) or not (out), and the
normalized value. For a correct implementation an out-observation is N(0, s^2) and an
in-observation N(1, s^2), s being the noise multiplier in the canary's units.

The bounds on epsilon come from the monitor's exact counts, not from here. This log
keeps what the figures, the TensorBoard histograms and `PrivacyAuditor.observations()`
need, in two bounded parts:

* **Histograms of every observation**, in and out, per layer (the pool is their sum),
  on fixed bins of width 1/64 (0.0156) over [-20, 21] in normalized units (2,624
  bins), plus an underflow count (values below -20, and NaN, which no threshold attack
  calls "in") and an overflow count (21 and above). Bin i covers [edge_i, edge_i+1)
  and, the width being a power of two, a value's bin is computed exactly (one multiply
  and a floor, no rounding). The counts therefore give the threshold attack "in when
  value >= t" exactly at every edge t: its false positives are the out-counts from t
  up, its false negatives the in-counts below t; 0, 0.5 (the monitor's fixed
  threshold) and 1 are edges. Between two edges the trade-off curve moves by at most
  the width times the largest density, 0.0063 / s in FPR or FNR (0.0125 at s = 0.5,
  a noise multiplier far below any practical one), and the figure draws straight
  lines between exact points. The range holds 20 standard deviations at s = 1 and
  4.4 at s = 4.5 (epsilon 1 over 1,000 steps); values beyond it are still counted, in
  the end bins, so the curve stays exact at every edge and only its extreme tails are
  not resolved. Every observation of the run is in the histograms, whose size is
  2,626 x layers x 2 counts (8 bytes each), 336 kB for 8 tensors.
* **A window of the most recent raw observations** (`window` rows, 65,536 by
  default: 23 bytes a row, 1.5 MB; at most MAX_WINDOW = 2**26 rows, 1.5 GB, allocated
  at once), a ring buffer that `arrays()` and `scores()` return in append order.
  Once more than `window` observations have been appended, the oldest are dropped
  from it (they stay in the histograms); `total` counts all of them.

* **Running moments**, per layer and in/out: the count, sum and sum of squares of the
  finite observations (`moments()`), from which the findings take exact means and
  variances. 48 bytes per layer and side.

`state_dict()` holds the bins, the counts, the moments and the window's rows: its size
is set by the number of layers and the window, never by the number of steps. A state in
the earlier format (every row: step, layer, kind, is_in, value, kinds) still loads, its
moments computed from the rows; a state of this format saved without moments gets them
from the histograms (see `_moments_from_histogram`).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np

from .schema import Field, Section

COLUMNS = ("step", "layer", "kind", "is_in", "value")
_DTYPES = {"step": np.int64, "layer": np.int32, "kind": np.int16, "is_in": bool, "value": np.float64}

BINS_PER_UNIT = 64  # bin width 1/64 = 0.015625 in normalized units: a power of two, so binning is exact
LOW = -20.0  # first finite edge
HIGH = 21.0  # last finite edge: the range is symmetric about the midpoint 0.5 of the two means
DEFAULT_WINDOW = 65_536
MAX_WINDOW = 2**26  # rows of the window, preallocated: 23 bytes each, 1.5 GB at most
STATE_FORMAT = 2


def _bins_rule(bins, ctx):
    per_unit = bins["per_unit"]
    return None if per_unit & (per_unit - 1) == 0 else f"has per_unit {per_unit}; the bin width must be 1/2^k"


def _log_rule(state, ctx):
    """Columns of one length; histograms of the saved bins, counting every observation; moments within them."""
    lengths = {c: np.size(state[c]) for c in COLUMNS}
    if len(set(lengths.values())) != 1:
        return COLUMNS[0], f"and the other columns have different lengths {lengths}: the rows are cut"
    kinds = state.get("kinds")
    if kinds is not None and lengths["kind"] and int(np.max(state["kind"])) >= len(kinds):
        return "kind", f"names kind {int(np.max(state['kind']))}; the state has {len(kinds)} kinds"
    if "counts" not in state:  # the earlier format: the rows are the whole log
        return None
    for name in ("bins", "total"):
        if name not in state:
            return name, "is missing (a state with histograms has its bins and total)"
    counts = np.asarray(state["counts"])
    if counts.ndim != 3 or counts.shape[0] != state["bins"]["count"] + 2 or counts.shape[2] != 2:
        return None, (f"observation counts of shape {counts.shape} do not match {state['bins']['count']} bins: "
                      "`log.counts` is not the histograms of the saved bins")
    if (counts != np.round(counts)).any():
        return "counts", "holds a fraction; counts are whole numbers"
    if int(counts.sum()) != state["total"]:
        return "total", f"is {state['total']}, but the histograms count {int(counts.sum())} observations"
    if lengths["value"] > state["total"]:
        return "value", f"holds {lengths['value']} rows, but the log counts only {state['total']} observations"
    if "moments" in state:
        moments = np.asarray(state["moments"], dtype=float)
        if moments.shape != (counts.shape[1], 2, 3):
            return "moments", f"has shape {moments.shape}; the histograms have {counts.shape[1]} layers: expected ({counts.shape[1]}, 2, 3)"
        n = moments[..., 0]
        if (n != np.round(n)).any() or (n > counts.sum(axis=0)).any():
            return "moments", "counts more finite observations than the histograms hold, or a fraction of one"
        if (moments[..., 2] < 0).any():
            return "moments", "holds a negative sum of squares"
    return None


# The observation log's state (`load_state_dict` reads a state LOG.check passed). An audit state of format 2
# holds every field (since=2); the optional ones are absent only from a 0.1.0 audit's log (every row, no histograms).
# A state's rows are at most the window's, and a window at most MAX_WINDOW rows (rows of a 0.1.0 state, which
# kept every observation, beyond that are refused too: no 0.1.0 audit held 1.5 GB of rows in its checkpoint).
_ROWS = MAX_WINDOW
LOG = Section(
    "log",
    Field("format", "int", low=STATE_FORMAT, high=STATE_FORMAT, optional=True, since=2),
    Field("kinds", "list", items=Field("kind", "str"), optional=True, since=2, most=2**15),  # kind codes are int16
    Field("bins", Section("bins", Field("first", "int"), Field("count", "int", low=1), Field("per_unit", "int", low=1)),
          rule=_bins_rule, optional=True, since=2),
    Field("counts", "array", dtype="real", low=0, optional=True, since=2),  # whole numbers, checked with the shape
    Field("moments", "array", dtype="real", finite="no-nan", optional=True, since=2),  # a square beyond the float range is inf
    Field("total", "int", low=0, optional=True, since=2),
    Field("step", "array", dtype="int", low=0, most=_ROWS),
    Field("layer", "array", dtype="int", low=0, most=_ROWS, rule=lambda v, ctx: (
        f"names layer {int(np.max(v))}; the set-up has {ctx['groups']}" if np.size(v) and ctx.get("groups") is not None
        and int(np.max(v)) >= ctx["groups"] else None)),
    Field("kind", "array", dtype="int", low=0, most=_ROWS),
    Field("is_in", "array", dtype="bool", most=_ROWS),
    Field("value", "array", dtype="real", finite=False, most=_ROWS),  # NaN observations are part of the log (underflow)
    rules=(_log_rule,),
)


class ObservationLog:
    """Histograms of all observations and a window of the most recent ones (see the module doc).

    kinds: the canary kinds the log may see (stored as small integer codes).
    window: how many of the most recent raw observations to keep (1 to MAX_WINDOW).
    """

    def __init__(self, kinds: List[str], *, window: int = DEFAULT_WINDOW):
        if not 1 <= int(window) <= MAX_WINDOW:
            raise ValueError(
                f"Unexpected value for `window`: {window}; it must lie in [1, {MAX_WINDOW}] (2**26 rows of 23 bytes, "
                "allocated at once: 1.5 GB)"
            )
        self.kinds = list(kinds)
        self.window = int(window)
        self.total = 0
        self._set_bins(round(LOW * BINS_PER_UNIT), round((HIGH - LOW) * BINS_PER_UNIT), BINS_PER_UNIT)
        self._counts = np.zeros((self._bins + 2, 0, 2), dtype=np.int64)  # (bin, layer, is_in)
        self._moments = np.zeros((0, 2, 3), dtype=np.float64)  # (layer, is_in, (count, sum, sum of squares))
        self._ring = {c: np.zeros(self.window, dtype=_DTYPES[c]) for c in COLUMNS}
        self._next = 0  # ring position of the next row
        self._filled = 0  # rows in the ring; they start at 0 until it is full

    # ------------------------------------------------------------------ bins

    def _set_bins(self, first: int, bins: int, per_unit: int) -> None:
        """Edges (first + k) / per_unit for k = 0..bins, per_unit a power of two."""
        first, bins, per_unit = int(first), int(bins), int(per_unit)
        if bins < 1 or per_unit < 1 or per_unit & (per_unit - 1):
            raise ValueError(f"bins of width 1/{per_unit} ({bins} of them) are not supported: the width must be 1/2^k")
        self._first, self._bins, self._per_unit = first, bins, per_unit
        finite = (np.arange(bins + 1, dtype=np.float64) + first) / per_unit
        self.edges = np.concatenate([[-np.inf], finite, [np.inf]])
        self.edges.flags.writeable = False
        self._scale = np.float64(per_unit)
        self._clip_low = np.float64(first - 1)
        self._clip_high = np.float64(first + bins)

    def _bin_index(self, values: np.ndarray) -> np.ndarray:
        """Bin of each value in 0..bins + 1 (0: underflow and NaN, bins + 1: overflow).

        With a power-of-two scale, value * scale and its floor are exact, so a value lands
        in bin j exactly when edges[j] <= value < edges[j + 1].
        """
        x = np.multiply(values, self._scale)
        np.fmax(x, self._clip_low, out=x)  # NaN -> underflow
        np.fmin(x, self._clip_high, out=x)
        np.floor(x, out=x)
        j = x.astype(np.intp)
        j -= self._first - 1
        return j

    # ------------------------------------------------------------------ appending

    def append(self, *, step, layer, kind: str, is_in, value) -> None:
        """Add observations: per-canary layer, is_in and value arrays of one length, and the step of
        each (an array of that length, or one step for all)."""
        value = np.asarray(value, dtype=np.float64).ravel()
        n = value.size
        if n == 0:
            return
        layer = np.asarray(layer).ravel()
        is_in = np.asarray(is_in, dtype=bool).ravel()
        step = np.broadcast_to(np.asarray(step, dtype=np.int64), (n,)) if np.ndim(step) == 0 else np.asarray(step).ravel()
        if layer.size != n or is_in.size != n or step.size != n:
            raise ValueError(
                f"`step` ({step.size}), `layer` ({layer.size}), `is_in` ({is_in.size}) and `value` ({n}) must have one length"
            )
        if kind not in self.kinds:
            raise ValueError(f"unknown canary kind {kind!r}; this log knows {', '.join(self.kinds)}")
        code = self.kinds.index(kind)
        top = int(layer.max())
        if int(layer.min()) < 0:
            raise ValueError(f"layer indices must be >= 0; got {int(layer.min())}")
        if top >= self._counts.shape[1]:
            self._grow(top + 1)
        self._count(self._bin_index(value), layer, is_in)
        self._accumulate(layer, is_in, value)
        self._remember(step, layer, code, is_in, value)
        self.total += n

    def _grow(self, layers: int) -> None:
        grown = np.zeros((self._bins + 2, layers, 2), dtype=np.int64)
        grown[:, : self._counts.shape[1]] = self._counts
        self._counts = grown
        moments = np.zeros((layers, 2, 3), dtype=np.float64)
        moments[: len(self._moments)] = self._moments
        self._moments = moments

    def _accumulate(self, layer: np.ndarray, is_in: np.ndarray, value: np.ndarray) -> None:
        """Add the finite values to the running count, sum and sum of squares of their (layer, is_in).

        A square beyond the float range makes that sum of squares inf: a variance beyond measure.
        """
        finite = np.isfinite(value)
        group = (2 * layer + is_in)[finite]
        v = value[finite]
        size = 2 * self._moments.shape[0]
        with np.errstate(over="ignore"):
            for column, weights in ((0, None), (1, v), (2, v * v)):
                self._moments[:, :, column] += np.bincount(group, weights=weights, minlength=size).reshape(-1, 2)

    def _count(self, bins: np.ndarray, layer: np.ndarray, is_in: np.ndarray) -> None:
        index = bins * (2 * self._counts.shape[1])  # (bin, layer, is_in) in C order
        index += 2 * layer
        index += is_in
        np.add.at(self._counts.reshape(-1), index, 1)

    def _remember(self, step: int, layer, code: int, is_in, value) -> None:
        n, size = value.size, self.window
        if n >= size:
            rows = slice(n - size, n)
            self._ring["step"][:] = step[rows]
            self._ring["layer"][:] = layer[rows]
            self._ring["kind"][:] = code
            self._ring["is_in"][:] = is_in[rows]
            self._ring["value"][:] = value[rows]
            self._next, self._filled = 0, size
            return
        start = self._next
        first = min(n, size - start)  # rows before the ring wraps
        for column, data in (("step", step), ("layer", layer), ("is_in", is_in), ("value", value)):
            ring = self._ring[column]
            ring[start : start + first] = data[:first]
            if first < n:
                ring[: n - first] = data[first:]
        ring = self._ring["kind"]
        ring[start : start + first] = code
        if first < n:
            ring[: n - first] = code
        self._next = (start + n) % size
        self._filled = min(self._filled + n, size)

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        """Observations appended so far (all of them, not only the window's)."""
        return self.total

    @property
    def dropped(self) -> int:
        """Observations no longer in the window (still in the histograms)."""
        return self.total - self._filled

    def _window_rows(self, column: str) -> np.ndarray:
        ring = self._ring[column]
        if self._filled < self.window:
            return ring[: self._filled].copy()
        return np.concatenate([ring[self._next :], ring[: self._next]])

    def arrays(self) -> Dict[str, np.ndarray]:
        """The window's observations in append order: columns step, layer, kind (strings), is_in, value."""
        out = {c: self._window_rows(c) for c in COLUMNS}
        out["kind"] = np.asarray(self.kinds, dtype=object)[out["kind"]] if len(out["kind"]) else np.zeros(0, object)
        return out

    def scores(self, *, layer: int | None = None, first_steps: int | None = None):
        """(in_values, out_values) of the window, optionally for one layer or steps < first_steps."""
        a = self.arrays()
        keep = np.ones(len(a["value"]), dtype=bool)
        if layer is not None:
            keep &= a["layer"] == layer
        if first_steps is not None:
            keep &= a["step"] < first_steps
        return a["value"][keep & a["is_in"]], a["value"][keep & ~a["is_in"]]

    def histogram(self, layer: Optional[int] = None):
        """(edges, in_counts, out_counts) of every observation so far, pooled or of one layer.

        edges has bins + 3 entries: -inf, the finite edges, +inf; counts[i] is the number of
        values in [edges[i], edges[i + 1]), so counts[0] is the underflow (and NaN) and
        counts[-1] the overflow. The arrays are copies.
        """
        if layer is None:
            both = self._counts.sum(axis=1)
        elif 0 <= int(layer) < self._counts.shape[1]:
            both = self._counts[:, int(layer)].copy()
        else:
            both = np.zeros((self._bins + 2, 2), dtype=np.int64)
        return self.edges.copy(), both[:, 1].copy(), both[:, 0].copy()

    def moments(self) -> np.ndarray:
        """(layers, 2, 3) copy: [layer, is_in] -> (count, sum, sum of squares) of its finite observations."""
        return self._moments.copy()

    @property
    def layers(self) -> int:
        """Number of layer indices the histograms hold (1 + the largest seen)."""
        return int(self._counts.shape[1])

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict:
        """Plain values and numpy arrays; the size is set by the bins, the layers and the window."""
        rows = {c: self._window_rows(c) for c in COLUMNS}
        return LOG.dump({
            "format": STATE_FORMAT,
            "kinds": list(self.kinds),
            "bins": {"first": self._first, "count": self._bins, "per_unit": self._per_unit},
            "counts": self._counts.copy(),
            "moments": self._moments.copy(),
            "total": int(self.total),
            **rows,
        })

    def load_state_dict(self, state: dict) -> None:
        """Restore a state of this format, or rebuild histograms and window from the earlier full columns.

        The saved bins are kept; the window keeps this log's size (the last `window` rows of
        the saved ones).
        """
        self.kinds = list(state.get("kinds", self.kinds))
        columns = {c: np.asarray(state[c], dtype=_DTYPES[c]).ravel() for c in COLUMNS}
        if "counts" in state:
            bins = state["bins"]
            self._set_bins(bins["first"], bins["count"], bins["per_unit"])
            counts = np.asarray(state["counts"], dtype=np.int64)
            if counts.ndim != 3 or counts.shape[0] != self._bins + 2 or counts.shape[2] != 2:
                raise ValueError(f"observation counts of shape {counts.shape} do not match {self._bins} bins")
            self._counts = counts.copy()
            self.total = int(state["total"])
            if "moments" in state:
                self._moments = np.asarray(state["moments"], dtype=np.float64).reshape(-1, 2, 3).copy()
            else:
                self._moments = _moments_from_histogram(self._counts, self.edges)
        else:  # the earlier format: every observation as a row
            self._counts = np.zeros((self._bins + 2, 0, 2), dtype=np.int64)
            self._moments = np.zeros((0, 2, 3), dtype=np.float64)
            value = columns["value"]
            if value.size:
                layer = columns["layer"].astype(np.intp)
                if layer.min() < 0:
                    raise ValueError(f"layer indices must be >= 0; got {int(layer.min())}")
                self._grow(int(layer.max()) + 1)
                self._count(self._bin_index(value), layer, columns["is_in"])
                self._accumulate(layer, columns["is_in"], value)
            self.total = int(value.size)
        kept = min(columns["value"].size, self.window)
        if self.total < kept:
            raise ValueError(f"the state holds {kept} rows but counts only {self.total} observations")
        self._ring = {c: np.zeros(self.window, dtype=_DTYPES[c]) for c in COLUMNS}
        for c in COLUMNS:
            self._ring[c][:kept] = columns[c][columns[c].size - kept :]
        self._filled = kept
        self._next = kept % self.window



def _moments_from_histogram(counts: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """(layers, 2, 3) count, sum and sum of squares estimated from the binned counts.

    A value is taken at its bin's midpoint, the underflow and overflow at the outermost
    finite edges. Rounding to the midpoint adds about width^2 / 12 to each square for a
    density smooth on the bin's scale (Sheppard's correction), which is subtracted. With
    width 1/64 the mean is off by at most 1/128 and the variance by far less for values
    within the range.
    """
    finite = edges[1:-1]
    width = float(finite[1] - finite[0])
    centers = np.concatenate([[finite[0]], (finite[:-1] + finite[1:]) / 2, [finite[-1]]])
    c = counts.astype(np.float64)  # (bin, layer, is_in)
    n = c.sum(axis=0)
    total = np.einsum("b,bli->li", centers, c)
    squares = np.einsum("b,bli->li", centers**2, c) - n * width**2 / 12
    return np.stack([n, total, squares], axis=-1)
