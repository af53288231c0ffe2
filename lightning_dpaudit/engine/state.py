"""An audit's saved state: what it holds, and the checks that it belongs where it is loaded.

A state records the set-up it was taken on (parameter shapes, clipping, noise multiplier,
canary kind, count and mode). Loading it into an auditor on another set-up, or loading a
damaged state, raises AuditStateError naming what differs, before any step runs, and
leaves the auditor as it was. A state written by version 0.1.0 (no set-up recorded) is
checked against what it implies: one pool per tensor within the tensors' sizes, the
canary kind, and observation groups within the tensor count.
"""

from __future__ import annotations

import numbers
from typing import Mapping

import numpy as np

FORMAT = 2
REQUIRED = ("steps", "sampler", "pool", "fingerprints", "log", "monitor")
WHAT_TO_DO = "resume with the model and audit settings the state was saved with, or start a new audit (do not load this state)"


class AuditStateError(ValueError):
    """A saved audit state that does not belong to this auditor, or is damaged."""


def setup_of(mechanism, options) -> dict:
    """The set-up a state is taken on (an options.Mechanism and AuditOptions), in plain values."""
    return {
        "shapes": [list(p.shape) for p in mechanism.params],
        "clipping": "per_layer" if mechanism.per_layer else "flat",
        "max_grad_norms": [float(c) for c in mechanism.clip_bounds],
        "noise_multiplier": float(mechanism.noise_multiplier),
        "canary": options.kind,
        "input": bool(options.input),
        "canaries_per_step": int(options.canaries_per_step),
        "mode": options.mode,
    }


def check_state(state, setup: dict) -> None:
    """Raise AuditStateError unless `state` is a whole state of this format or an earlier one, taken on `setup`."""
    if not isinstance(state, Mapping):
        raise AuditStateError(f"an audit state is a dict (from PrivacyAuditor.state_dict()); got {type(state).__name__}")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise AuditStateError(f"the audit state lacks {', '.join(map(repr, missing))}: it is damaged or not an audit state; {WHAT_TO_DO}")
    version = state.get("format", 1)
    if not isinstance(version, numbers.Integral) or not 1 <= version <= FORMAT:
        raise AuditStateError(f"audit state format {version!r} is not one this version reads (1 to {FORMAT}); {WHAT_TO_DO}")
    steps = state["steps"]
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise AuditStateError(f"the audit state's `steps` is {steps!r}; it must be an integer >= 0")
    saved = state.get("setup")
    if version >= 2:
        if not isinstance(saved, Mapping):
            raise AuditStateError(f"the audit state lacks its set-up record; {WHAT_TO_DO}")
        differences = [f"{key} (saved {saved.get(key)!r}, here {value!r})" for key, value in setup.items() if saved.get(key) != value]
    else:
        differences = _implied_differences(state, setup)
    if differences:
        raise AuditStateError(
            "the audit state was saved on another set-up: " + "; ".join(differences) + f". To go on, {WHAT_TO_DO}."
        )
    _check_counts(state)


def _implied_differences(state, setup: dict) -> list:
    """What a state without a set-up record (version 0.1.0) shows of its set-up, against this one."""
    sizes = [int(np.prod(s)) for s in setup["shapes"]]
    out = []
    pool = state["pool"]
    if not isinstance(pool, (list, tuple)) or len(pool) != len(sizes):
        count = len(pool) if isinstance(pool, (list, tuple)) else type(pool).__name__
        out.append(f"parameter tensors (saved {count}, here {len(sizes)})")
    else:
        for i, (idx, size) in enumerate(zip(pool, sizes)):
            idx = np.asarray(idx)
            if idx.size and (idx.min() < 0 or idx.max() >= size):
                out.append(f"tensor {i} size (saved coordinates up to {int(idx.max())}, here {size} values)")
                break
    saved_input = bool(state.get("input_canaries")) or "pool" not in (state["sampler"] or {})
    if saved_input != setup["input"]:
        out.append(f"canary kind (saved {'input' if saved_input else 'gradient'} canaries, here {setup['canary']!r})")
    return out


def _check_counts(state) -> None:
    """Counts must be whole numbers >= 0, and observation groups within the tensors."""
    counts = state["monitor"].get("counts", {}) if isinstance(state["monitor"], Mapping) else None
    if counts is None:
        raise AuditStateError("the audit state's `monitor` is not a dict; the state is damaged")
    for group, row in counts.items():
        row = np.asarray(row)
        if row.shape != (4,) or not np.issubdtype(row.dtype, np.number) or (row < 0).any() or (row != np.round(row)).any():
            raise AuditStateError(f"the audit state's monitor counts for group {group} are {row.tolist()}; counts are 4 whole numbers >= 0")
