"""What DPAuditCallback saves in a Lightning checkpoint and restores from one.

The auditor's state, the accountant's history (Opacus accountants are not part of a
Lightning checkpoint), the logged epsilon history, whether the alert fired, the
final-model audit's secret seed and start losses and, when asked for, the optimizer's
noise generator: CALLBACK, written and checked by the same Section (analysis/schema.py).
A state loaded before the auditor exists waits until fit start. A damaged or foreign
state is refused (AuditStateError naming the field) before anything is restored.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Optional

import numpy as np
import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_warn

from ..analysis.monitor import POOLED
from ..analysis.schema import Field, Section, StateError
from ..engine.state import AuditStateError, check_state_alone, composed_steps
from .final_model_audit import FINAL_MODEL_TRACKER
from .logged_values import _to_checkpoint

# Entries of the accountant's history and of the logged epsilons a state may hold. An Opacus accountant merges
# a step into its last entry when the noise multiplier and sample rate are the same, so it holds an entry per
# change of them; the callback logs the epsilons at most once per logging step. 10**6 entries is a change at
# every step of a million-step run (`dpaudit demo`'s most steps, about a day), and what a resume checks in a
# fraction of a second; an Opacus accountant composing more entries would take minutes for each epsilon.
MAX_HISTORY = 10**6

HISTORY_ENTRY = Section(
    "history entry", Field("step", "int", low=0),
    Field("eps_lower_bound", "real", low=0.0, finite=False), Field("eps_accountant", "real", low=0.0, finite=False),
)
_REAL = (int, float, np.integer, np.floating)


def _first_bad_history_entry(entries, ctx) -> Optional[int]:
    """HISTORY_ENTRY's checks on every entry at once: the index of the first entry that may break it, or None."""
    if not entries:
        return None
    keys = ("step", "eps_lower_bound", "eps_accountant")
    try:
        rows = list(map(operator.itemgetter(*keys), entries)) if set(map(type, entries)) == {dict} else None
    except (KeyError, TypeError):
        rows = None
    if rows is not None and not set(map(type, itertools.chain.from_iterable(rows))) <= {int, float}:
        return _first_not_a_number(rows)
    if rows is None:
        return next((i for i, entry in enumerate(entries)  # an entry of another shape: found one by one
                     if type(entry) is not dict or any(type(entry.get(k)) not in (int, float) for k in keys)), 0)
    try:
        table = np.array(rows, dtype=float)
    except OverflowError:  # an integer beyond the float range: found one by one
        return _first_overflow(rows)
    with np.errstate(invalid="ignore"):
        bad = (table[:, 0] < 0) | (table[:, 0] != np.round(table[:, 0])) | (table[:, 1:] < 0).any(axis=1)  # NaN: not known
    hits = np.flatnonzero(bad)
    return int(hits[0]) if hits.size else None


def _first_not_a_number(rows) -> int:
    """The first of `rows` (each of 3 values) holding a value that is not an int or a float (a bool, a string)."""
    types = list(map(type, itertools.chain.from_iterable(rows)))
    return next(i for i, t in enumerate(types) if t is not int and t is not float) // 3


def _first_overflow(rows) -> int:
    """The first row holding a number beyond the float range."""
    def fits(v):
        try:
            float(v)
            return True
        except OverflowError:
            return False

    return next(i for i, row in enumerate(rows) if not all(map(fits, row)))


def _accountant_entry(entry, ctx) -> Optional[str]:
    """(noise multiplier, sample rate, steps), as Opacus accountants keep them."""
    try:
        ok = (isinstance(entry, (list, tuple)) and len(entry) == 3 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
              for v in entry) and math.isfinite(entry[0]) and entry[0] >= 0 and 0 < entry[1] <= 1
              and float(entry[2]).is_integer() and entry[2] >= 0)
    except OverflowError:  # an integer beyond the float range
        ok = False
    return None if ok else f"is {entry!r}; expected [noise multiplier >= 0, sample rate in (0, 1], steps >= 0]"


def _first_bad_accountant_entry(entries, ctx) -> Optional[int]:
    """_accountant_entry on every entry at once: the index of the first entry that may break it, or None."""
    if not entries:
        return None
    shaped = set(map(type, entries)) <= {list, tuple} and set(map(len, entries)) == {3}
    if shaped and not set(map(type, itertools.chain.from_iterable(entries))) <= {int, float}:
        return _first_not_a_number(entries)
    if not shaped:
        return next((i for i, entry in enumerate(entries)  # an entry of another shape: found one by one
                     if type(entry) not in (list, tuple) or len(entry) != 3 or not all(type(v) in (int, float) for v in entry)), 0)
    try:
        table = np.array(entries, dtype=float)
    except OverflowError:  # an integer beyond the float range: found one by one
        return _first_overflow(entries)
    with np.errstate(invalid="ignore"):
        bad = (~np.isfinite(table[:, 0]) | (table[:, 0] < 0) | ~(table[:, 1] > 0) | ~(table[:, 1] <= 1)
               | ~np.isfinite(table[:, 2]) | (table[:, 2] != np.round(table[:, 2])) | (table[:, 2] < 0))
    hits = np.flatnonzero(bad)
    return int(hits[0]) if hits.size else None


def _generator_state(value, ctx) -> Optional[str]:
    """A torch.Generator's state, as Generator.get_state() returns it: a 1-d uint8 tensor on the CPU."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1 and value.device.type == "cpu":
        return None
    shown = (f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
             else f"a {type(value).__name__}")
    return f"is {shown}; expected a torch.Generator's state (a 1-d torch.uint8 tensor, from Generator.get_state())"



def _auditor_present(state, ctx):
    """The auditor's state is written with the rest (null before an audit started): a state without it that holds
    anything of an audit (logged bounds, an alert, the accountant's history, the noise generator) would restart
    the audit at step 0 under the saved accounting. One that holds nothing of one is a callback's before fit
    (version 0.1.0 wrote no `auditor` then)."""
    if "auditor" in state:
        return None
    held = [key for key in ("history", "alerted", "accountant_history", "noise_generator") if state.get(key)]
    if held:
        return "auditor", (f"is missing, but the state holds {', '.join(f'`{k}`' for k in held)} of an audit: resuming "
                           "would restart the audit at step 0")
    return None


CALLBACK = Section(
    "callback",
    Field("history", "list", items=HISTORY_ENTRY, most=MAX_HISTORY, batch=_first_bad_history_entry),
    Field("alerted", "bool"),
    Field("final_model", FINAL_MODEL_TRACKER, optional=True),
    Field("auditor", "map", null=True, optional=True),  # the auditor's own state: checked by the auditor (engine/state.py)
    Field("accountant_history", "list", items=Field("entry", "any", rule=_accountant_entry), optional=True,
          most=MAX_HISTORY, batch=_first_bad_accountant_entry),
    Field("noise_generator", "any", optional=True, rule=_generator_state),  # torch checks the rest when it is set
    rules=(_auditor_present,),
)
LEGACY_KEY = "DPAuditCallback{"  # version 0.1.0 keyed the callback's state by its options


class AuditCheckpointing:
    """Checkpoint methods of DPAuditCallback (which holds auditor, history, alerted, final_model,
    checkpoint_noise_generator, _pending_state and _warned_generator)."""

    def state_dict(self) -> dict:
        """CALLBACK's fields (the auditor's state converted for torch.load(weights_only=True))."""
        state = {"history": list(self.history), "alerted": self.alerted, "auditor": None}
        if self.final_model is not None:
            state["final_model"] = self.final_model.state_dict()
        if self.auditor is not None:
            state["auditor"] = _to_checkpoint(self.auditor.state_dict())
            if self.auditor.accountant is not None:
                state["accountant_history"] = [list(entry) for entry in self.auditor.accountant.history]
            if self.checkpoint_noise_generator:
                generator = self._noise_generator()
                if generator is not None:
                    state["noise_generator"] = generator.get_state()
        elif self._pending_state is not None:
            state["auditor"] = self._pending_state.get("auditor")
            if self._pending_state.get("noise_generator") is not None:
                state["noise_generator"] = self._pending_state["noise_generator"]
        return CALLBACK.dump(state)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """Pick up the state of a checkpoint written under version 0.1.0's option-dependent key; a checkpoint
        holding several such states is refused (which one is this run's cannot be told)."""
        states = checkpoint.get("callbacks", {})
        if self.state_key in states:
            return
        legacy = [key for key in states if isinstance(key, str) and key.startswith(LEGACY_KEY)]
        if len(legacy) > 1:
            raise AuditStateError(
                f"the checkpoint holds {len(legacy)} audit states of version 0.1.0 ({', '.join(map(repr, legacy))}): "
                "which one is this run's cannot be told, and resuming without one would restart the audit; "
                "keep one of them in checkpoint['callbacks'] under its key, or start a new audit"
            )
        if legacy:
            self.load_state_dict(states[legacy[0]])

    def _noise_generator(self) -> Optional[torch.Generator]:
        """The optimizer's own noise generator when its state can be saved and restored; else None, warned once."""
        optimizer = self.auditor.optimizer
        generator = getattr(optimizer, "generator", None)
        if isinstance(generator, torch.Generator) and not getattr(optimizer, "secure_mode", False):
            return generator
        if not self._warned_generator:
            self._warned_generator = True
            source = "the operating system (secure mode)" if getattr(optimizer, "secure_mode", False) else (
                "torch's global generator" if generator is None else f"a {type(generator).__name__}"
            )
            rank_zero_warn(
                f"checkpoint_noise_generator: the optimizer draws its noise from {source}, whose state the callback "
                "does not save; give make_private a noise_generator=torch.Generator() to have it saved",
                category=UserWarning,
            )
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        check_callback_state(state_dict)
        if self.auditor is None and state_dict.get("auditor") is not None:
            # what can be checked before the auditor exists (the rest at fit start, against its set-up)
            check_state_alone(audit_state_of(state_dict["auditor"]), composed_steps(state_dict.get("accountant_history")))
        if self.final_model is not None and state_dict.get("final_model") is not None:
            self.final_model.load_state_dict(state_dict["final_model"])  # before the data loader first reads the canaries
        self._pending_state = dict(state_dict)
        if self.auditor is not None:
            try:
                self._restore(self._pending_state, checked=True)
            finally:
                self._pending_state = None

    def _restore(self, state: dict, *, checked: bool = False) -> None:
        """Check the whole state against this run (the auditor's against its set-up, the accountant's history
        against the optimizer's noise multiplier), then restore it; nothing changes when it is refused.
        checked: the state just passed check_callback_state (one pass over it is enough)."""
        if not checked:
            check_callback_state(state)
        saved = None if state.get("auditor") is None else audit_state_of(state["auditor"])
        generator = self._noise_generator() if self.checkpoint_noise_generator and state.get("noise_generator") is not None else None
        if generator is not None:
            _check_generator_state(state["noise_generator"], generator)
        accountant = self.auditor.accountant
        live = getattr(accountant, "history", None)
        # the accountant's history as the audit goes on with it: its own, or the saved one restored below
        composed = composed_steps(live if live or accountant is None else state.get("accountant_history"))
        if saved is not None:
            self.auditor.check_state(saved, composed=composed)
        check_accounting(saved, state.get("accountant_history"), self.auditor)
        if saved is not None:
            self.auditor.load_state_dict(saved, checked=True)  # unchanged on error
        self.history = list(state.get("history", []))
        self.alerted = bool(state.get("alerted", False))
        accountant = self.auditor.accountant
        if accountant is not None and not accountant.history and state.get("accountant_history"):
            # Opacus accountants are not part of Lightning checkpoints; without this the
            # resumed run would account only for the steps after the resume.
            accountant.history = [tuple(entry) for entry in state["accountant_history"]]
        if generator is not None:
            generator.set_state(state["noise_generator"])


def check_callback_state(state) -> None:
    """AuditStateError naming the field unless `state` is a DPAuditCallback state (CALLBACK), before anything is restored."""
    try:
        CALLBACK.check(state)
    except StateError as error:
        raise AuditStateError(f"the callback state's {error}. The state is damaged or not a DPAuditCallback state") from None


def audit_state_of(checkpointed):
    """The auditor's state from its checkpoint form (numpy arrays as {"__ndarray__": tensor, "dtype": name}, as
    _to_checkpoint writes them); AuditStateError naming the entry for an array that is not one of those.
    Iterative: as deep as the state goes."""
    top: list = [None]
    stack = [("auditor", checkpointed, top, 0)]
    while stack:
        where, value, parent, key = stack.pop()
        if isinstance(value, dict) and "__ndarray__" in value:
            parent[key] = _array_of(value, where)
        elif isinstance(value, dict):
            parent[key] = converted = {}
            stack.extend((f"{where}.{k}", v, converted, k) for k, v in value.items())
        elif isinstance(value, list):
            parent[key] = converted = [None] * len(value)
            stack.extend((f"{where}[{i}]", v, converted, i) for i, v in enumerate(value))
        elif isinstance(value, np.ndarray) and value.dtype.kind not in _DTYPE_KINDS:
            raise AuditStateError(
                f"the callback state's `{where}` is a numpy array of {value.dtype}; the audit state's arrays hold "
                "bools, integers or floats: the state is damaged or was not written by DPAuditCallback")
        else:
            parent[key] = value
    return top[0]


def _check_generator_state(saved, generator: torch.Generator) -> None:
    """The saved noise generator's state fits the optimizer's generator (tried on a fresh one of its device, before
    anything is restored); AuditStateError otherwise."""
    try:
        torch.Generator(device=generator.device).set_state(saved)
    except (RuntimeError, TypeError, ValueError) as error:
        raise AuditStateError(
            f"the callback state's `noise_generator` is not a state of the optimizer's {generator.device} generator "
            f"({str(error).splitlines()[0]}): the state is damaged or another run's") from None


_DTYPE_KINDS = "biuf"  # the arrays an audit state holds: bools, integers, floats


def _array_of(entry: dict, where: str) -> np.ndarray:
    tensor, name = entry.get("__ndarray__"), entry.get("dtype")
    if not isinstance(tensor, torch.Tensor):
        raise AuditStateError(
            f"the callback state's `{where}.__ndarray__` is a {type(tensor).__name__}; expected a tensor (an array "
            "saved by the callback): the state is damaged")
    try:
        dtype = np.dtype(name) if isinstance(name, str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in _DTYPE_KINDS:
        raise AuditStateError(
            f"the callback state's `{where}.dtype` is {name!r}; expected the name of a numpy bool, integer or float "
            "dtype (e.g. 'int64', 'float64', 'bool'): the state is damaged")
    try:
        return tensor.detach().cpu().numpy().astype(dtype)
    except (TypeError, RuntimeError) as error:
        raise AuditStateError(f"the callback state's `{where}` cannot be read as a {dtype} array ({error}): the state "
                              "is damaged") from None


def check_accounting(saved: Optional[dict], history, auditor) -> None:
    """The saved accountant history backs the saved audit: it composes the optimizer's noise multiplier (the
    set-up's, which the audit's first steps used), and each claim segment holding observations claims 1 / sigma
    for a sigma it composes (a segment's claim is its largest step's). Skipped without a history or audited
    steps, and when the audit found the accountant composing other noise (`claim_unaccounted`); the segments'
    claims also under adaptive clipping (the claim is the gradient's own noise, not the optimizer's)."""
    if not history or saved is None or not saved["steps"]:
        return
    if any(problem[0] == "claim_unaccounted" for problem in saved.get("problems", [])):
        return
    sigmas = sorted({float(entry[0]) for entry in history})
    sigma = float(auditor.optimizer.noise_multiplier)
    if not any(math.isclose(s, sigma, rel_tol=1e-9) for s in sigmas):
        raise AuditStateError(
            f"the callback state's `accountant_history` composes noise multipliers {sigmas}, never the optimizer's "
            f"{sigma:g}: the saved accounting is another run's (its epsilon would be wrong). Resume with the "
            "optimizer the checkpoint was written with, or start a new audit"
        )
    if auditor.setup["noise_multiplier"] != sigma:
        return
    monitor = saved["monitor"]
    segments = [("monitor", monitor)] if "claims" in monitor else []
    segments += [(f"monitor.segments[{i}]", segment) for i, segment in enumerate(monitor.get("segments", []))]
    for where, segment in segments:
        claim = float(segment["claims"][POOLED])
        if sum(segment["counts"].get(POOLED, [0])) and not any(s > 0 and math.isclose(claim, 1.0 / s, rel_tol=1e-9) for s in sigmas):
            raise AuditStateError(
                f"the callback state's `auditor.{where}.claims[{POOLED}]` is {claim:g} (noise multiplier {1 / claim:g}), "
                f"but the saved accountant history composes noise multipliers {sigmas}: a claim the accounting does "
                "not back. The state is damaged or another run's"
            )
