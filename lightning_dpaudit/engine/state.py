"""An audit's saved state: what it holds, and the checks that it belongs where it is loaded.

A state records the set-up it was taken on (parameter shapes, clipping, noise multiplier,
canary kind, count and mode). Loading it into an auditor on another set-up, or loading a
damaged state, raises AuditStateError naming what differs, before any step runs, and
leaves the auditor as it was. A state written by version 0.1.0 (no `format`, no set-up
recorded) is checked against what it implies: one pool per tensor within the tensors'
sizes, the canary kind, and observation groups within the tensor count.

What each part holds is declared once (analysis/schema.py): HEADER here, the canary kind's
GRADIENT_STATE or INPUT_STATE (canaries/) and RECORD (analysis/record.py). Each part's
state_dict writes through its Section and check_state checks the whole state against
the same Sections, with the set-up (tensor sizes, canaries per step, claims) as context.
"""

from __future__ import annotations

import numbers
import operator
from typing import Mapping, Optional

import numpy as np

from ..analysis.record import RECORD, SENTINELS
from ..analysis.schema import AuditStateError, Field, Section, StateError, check_field, is_whole, missing
from .canaries.gradient import GRADIENT_STATE
from .canaries.input import INPUT_STATE
from .step.divergence import diverged_step

FORMAT = 2
REQUIRED = ("steps", "sampler", "pool", "fingerprints", "log", "monitor")
WHAT_TO_DO = "resume with the model and audit settings the state was saved with, or start a new audit (do not load this state)"

# The auditor's own fields; the rest of its state is its canary kind's and its record's.
HEADER = Section("audit", Field("format", "int", optional=True), Field("setup", "map", optional=True), Field("steps", "int", low=0))
KIND_LABEL = "`sampler` or `pool`"  # how errors in the kind's part are named (as when loading it fails)
# What the gradient canaries' sampler of a state of this format always holds (a 0.1.0 sampler has none of them).
SAMPLER_SINCE_2 = ("pool", "order", "block", "block_all_in")


def dump_state(setup: dict, steps: int, kind_state: dict, record_state: dict) -> dict:
    """The auditor's state: HEADER's fields, then the kind's and the record's (each written by its Section)."""
    return {**HEADER.dump({"format": FORMAT, "setup": setup, "steps": steps}), **kind_state, **record_state}


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


def composed_steps(history) -> Optional[int]:
    """The steps an accountant's history composes (the sum of its (noise multiplier, sample rate, steps)
    entries' steps: a noise schedule has several); None when the history is empty or not of that form."""
    if not isinstance(history, (list, tuple)) or not history:
        return None
    if not (set(map(type, history)) <= {list, tuple} and set(map(len, history)) == {3}):
        return None
    steps = list(map(operator.itemgetter(2), history))
    kinds = set(map(type, steps))
    if kinds <= {int, float}:  # the usual history, summed at once
        try:
            column = np.asarray(steps, dtype=float)
        except OverflowError:  # an integer beyond the float range: no accountant composes that many steps
            return None
        if not (np.isfinite(column).all() and (column == np.round(column)).all() and (column >= 0).all()):
            return None
        return sum(steps) if kinds == {int} else sum(map(int, steps))
    total = 0
    for v in steps:
        if not is_whole(v) or v < 0:
            return None
        total += int(v)
    return total


def check_state(state, setup: dict, claims: Optional[dict] = None, composed: Optional[int] = None) -> None:
    """Raise AuditStateError unless `state` is a whole state of this format or an earlier one, taken on `setup`.

    claims: the claimed mu per observation group the auditor starts with (its monitor's `opening`):
    the state's first claim segment must hold them. composed: the steps the accountant's history
    composes (composed_steps), when known: the state's `steps` are at most those (every noised step the
    audit counts, the accountant composes; it composes more when the audit stopped on a fault of its own or
    was attached after the first steps).
    """
    version = _checked_header(state)
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
    _check_parts(state, setup, claims, version=version)
    _check_steps(state, composed)  # a whole state of this set-up: does the accounting back its steps?



def _checked_header(state) -> int:
    """The state's format, once it is a dict holding every required part and its header passes HEADER."""
    if not isinstance(state, Mapping):
        raise AuditStateError(f"an audit state is a dict (from PrivacyAuditor.state_dict()); got {type(state).__name__}")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise AuditStateError(f"the audit state lacks {', '.join(map(repr, missing))}: it is damaged or not an audit state; {WHAT_TO_DO}")
    version = _version(state)
    try:
        HEADER.check(state)
    except StateError as error:
        raise AuditStateError(f"the audit state's {error}; it is damaged, {WHAT_TO_DO}") from None
    return version

def check_state_alone(state, composed: Optional[int] = None) -> None:
    """What check_state checks without an auditor's set-up (AuditStateError naming the field): the header, and the
    kind's and the record's fields against the set-up the state records (format 2) or implies (0.1.0). A state
    loaded before its auditor exists (DPAuditCallback before fit start) is checked so; check_state at fit start
    checks it against the set-up there."""
    version = _checked_header(state)
    saved = state.get("setup")
    if version >= 2:
        try:
            SETUP_RECORD.check(saved, path="setup")
        except StateError as error:
            raise AuditStateError(f"the audit state's {error}; it is damaged, {WHAT_TO_DO}") from None
        _check_parts(state, saved, None, version=version)
    else:
        saved_input = bool(state.get("input_canaries")) or "pool" not in (state["sampler"] or {})
        _check_parts(state, None, None, input_kind=saved_input, version=version)
    _check_steps(state, composed)


# The set-up record's fields that check_state_alone reads as context
SETUP_RECORD = Section(
    "setup", Field("shapes", "list", items=Field("shape", "list", items=Field("size", "int", low=0))),
    Field("canaries_per_step", "int", low=1), Field("input", "bool"),
)


def _check_steps(state, composed: Optional[int]) -> None:
    if composed is not None and state["steps"] > composed:
        raise AuditStateError(
            f"the audit state's `steps` is {state['steps']}; expected a whole number from 0 to {composed}, the steps the "
            f"accountant's history composes (the audit counts no step the accountant does not): the state is damaged "
            f"or another run's; {WHAT_TO_DO}"
        )


def _check_parts(state, setup: Optional[dict], claims: Optional[dict], input_kind: Optional[bool] = None, *,
                 version: int = FORMAT) -> None:
    """The kind's and the record's Sections, with the set-up (None: unknown, what needs it unchecked) and the
    state's format (a field written by every state of its format must be there) as context."""
    if not isinstance(state["monitor"], Mapping):
        raise AuditStateError("the audit state's `monitor` is not a dict; the state is damaged")
    if setup is None:
        ctx = {"sentinels": SENTINELS, "claims": claims, "format": version}
        input_kind = bool(input_kind)
    else:
        ctx = {
            "sizes": [int(np.prod(s)) for s in setup["shapes"]], "per_step": int(setup["canaries_per_step"]),
            "groups": 1 if setup["input"] else len(setup["shapes"]), "sentinels": SENTINELS, "claims": claims,
            "format": version,
        }
        input_kind = setup["input"]
    kind = INPUT_STATE if input_kind else GRADIENT_STATE
    if version >= 2 and not input_kind and isinstance(state["sampler"], Mapping):
        absent = [name for name in SAMPLER_SINCE_2 if name not in state["sampler"]]
        if absent:
            raise AuditStateError(
                f"the audit state is damaged (`sampler.{absent[0]}` is missing; every audit state of format 2 or later "
                f"holds it); start a new audit")
    for part, section in ((KIND_LABEL, kind), (None, RECORD)):
        name = None
        try:
            for f in section.fields:  # the fields this state holds (REQUIRED above; others are optional in earlier formats)
                name = f"`{f.name}`"
                if f.name in state:
                    check_field(f, state[f.name], f.name, ctx)
                else:
                    problem = missing(f, ctx)
                    if problem is not None:
                        raise StateError(f.name, problem)
            name = None
            for rule in section.rules:
                found = rule(state, ctx)
                if found:
                    raise StateError(found[0], found[1])
        except StateError as error:
            label = part or name or f"`{section.name}`"
            raise AuditStateError(f"the audit state is damaged ({label}: ValueError: {error}); start a new audit") from None


def _version(state) -> int:
    """The state's format: 1 for a 0.1.0 state (no `format`, no set-up record); refused when it is not a format."""
    if "format" not in state:
        if "setup" in state:
            raise AuditStateError(
                "the audit state's `format` is missing, but it holds a set-up record (format 2): it is damaged; "
                + WHAT_TO_DO
            )
        return 1
    version = state["format"]
    if isinstance(version, (bool, np.bool_)) or not isinstance(version, numbers.Integral) or not 1 <= version <= FORMAT:
        raise AuditStateError(f"audit state format {version!r} is not one this version reads (1 to {FORMAT}); {WHAT_TO_DO}")
    if version >= 2 and not isinstance(state.get("setup"), Mapping):
        raise AuditStateError(f"the audit state lacks its set-up record; {WHAT_TO_DO}")
    if version == 1 and "setup" in state:
        raise AuditStateError(f"the audit state's `format` is 1 (0.1.0), but it holds a set-up record (format 2): it is damaged; {WHAT_TO_DO}")
    return int(version)


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


def load_parts(state: dict, kind, record, pipeline) -> None:
    """Resume the kind, the record and the step pipeline from a state `check_state` passed: all of it, or (on a
    damaged part) none of it, AuditStateError (a ValueError) then."""
    pipeline.record_pending()
    saved = dump_state({}, pipeline.steps, kind.state_dict(), record.state_dict())
    try:
        _load_parts(state, kind, record, pipeline)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        _load_parts(saved, kind, record, pipeline)
        raise AuditStateError(f"the audit state is damaged ({error}); start a new audit") from None


def _load_parts(state: dict, kind, record, pipeline) -> None:
    try:
        kind.load_state_dict(state)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        raise ValueError(f"{KIND_LABEL}: {type(error).__name__}: {error}") from error
    record.load_state_dict(state)
    pipeline.steps = int(state["steps"])
    pipeline.diverged = diverged_step(record.problems)  # a run that diverged stays unobserved
    pipeline.follow_claim(pipeline.claims.mechanism)  # the steps from here claim what the optimizer holds now
