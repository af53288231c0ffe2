"""Append-only log of normalized canary observations.

One row per canary per noised step: the step, the parameter tensor ("layer") the canary
sat in, its kind, whether it entered the step (in) or not (out), and the normalized
observation. For a correct implementation an out-observation is N(0, s^2) and an
in-observation N(1, s^2), s being the noise multiplier in the canary's units.
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np

COLUMNS = ("step", "layer", "kind", "is_in", "value")
_DTYPES = {"step": np.int64, "layer": np.int32, "kind": np.int16, "is_in": bool, "value": np.float64}


class ObservationLog:
    def __init__(self, kinds: List[str]):
        self.kinds = list(kinds)
        self._chunks: Dict[str, list] = {c: [] for c in COLUMNS}
        self._cache = None

    def append(self, *, step: int, layer, kind: str, is_in, value) -> None:
        n = len(value)
        self._chunks["step"].append(np.full(n, step, dtype=_DTYPES["step"]))
        self._chunks["layer"].append(np.asarray(layer, dtype=_DTYPES["layer"]))
        self._chunks["kind"].append(np.full(n, self.kinds.index(kind), dtype=_DTYPES["kind"]))
        self._chunks["is_in"].append(np.asarray(is_in, dtype=bool))
        self._chunks["value"].append(np.asarray(value, dtype=_DTYPES["value"]))
        self._cache = None

    def __len__(self) -> int:
        return int(sum(len(c) for c in self._chunks["value"]))

    def arrays(self) -> Dict[str, np.ndarray]:
        """Columns as numpy arrays; `kind` as strings."""
        if self._cache is None:
            merged = {c: np.concatenate(v) if v else np.zeros(0, _DTYPES[c]) for c, v in self._chunks.items()}
            self._chunks = {c: [merged[c]] if len(merged[c]) else [] for c in COLUMNS}
            self._cache = merged
        out = dict(self._cache)
        out["kind"] = np.asarray(self.kinds, dtype=object)[out["kind"]] if len(out["kind"]) else np.zeros(0, object)
        return out

    def scores(self, *, layer: int | None = None, first_steps: int | None = None):
        """(in_values, out_values), optionally for one layer or the first steps only."""
        a = self.arrays()
        keep = np.ones(len(a["value"]), dtype=bool)
        if layer is not None:
            keep &= a["layer"] == layer
        if first_steps is not None:
            keep &= a["step"] < first_steps
        return a["value"][keep & a["is_in"]], a["value"][keep & ~a["is_in"]]

    def state_dict(self) -> dict:
        a = self.arrays()
        a["kind"] = self._cache["kind"]
        return {"kinds": list(self.kinds), **{c: a[c].copy() for c in COLUMNS}}

    def load_state_dict(self, state: dict) -> None:
        self.kinds = list(state.get("kinds", self.kinds))
        self._chunks = {c: [np.asarray(state[c], dtype=_DTYPES[c])] for c in COLUMNS}
        self._cache = None
