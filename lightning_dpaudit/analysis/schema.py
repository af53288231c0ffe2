"""What saved state and reports may hold: one declarative Section per part, used to write it and to check it.

A Section lists its Fields (name, type, range, finiteness, a rule for shape or length) and
the rules that tie fields together or to the set-up (`ctx`). `dump` is the only way a
part's state_dict writes (a field without a rule cannot be written); `check` refuses a
damaged or foreign value with StateError naming the field (`log.moments[0, 1, 2]`),
before anything is loaded. Torch-free: numbers, lists, dicts and numpy arrays.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np


class AuditStateError(ValueError):
    """A saved audit state that does not belong to this auditor, or is damaged."""


class StateError(ValueError):
    """A value that breaks its Field or Section: `path` names the field, the message says how."""

    def __init__(self, path: str, message: str):
        shown = f"`{path}`" if path and " " not in path else path  # a path with words ("monitor counts for group 0") reads as is
        super().__init__(f"{shown} {message}" if path else message)
        self.path, self.problem = path, message


Rule = Callable[[Any, dict], Optional[str]]  # (value, ctx) -> what is wrong, or None


@dataclass(frozen=True)
class Field:
    """One entry of a Section.

    type     "int", "real", "bool", "str", "map", "list", "array", "any" or a Section
    low/high inclusive range of a number or of every array element (None: unbounded)
    finite   True: no NaN nor infinity; "no-nan": infinities allowed; False: anything
    dtype    array elements: "int", "real" or "bool"
    items    the Field (or Section) each list element or map value satisfies
    rule     (value, ctx) -> what is wrong, for shape, length and the set-up
    null / optional   None allowed / may be absent (states of earlier versions)
    since    with optional: absent only from audit states of a format below this one (ctx["format"]); every
             state of this format or a later one holds it, and one without it is damaged, not older
    most     the most entries a list, map or array may hold: checked before any entry is looked at, so a
             damaged state of any size is refused at once
    batch    (entries, ctx) -> the index of the first list entry that may break `items`, or None when none does:
             one vectorized pass over a long list instead of a check per entry (the entry found is then
             checked by `items`, which names what is wrong)
    label    how a list element or map value is named ({path}, {parent}: the path without its last name, {key})
    """

    name: str
    type: Any
    low: Optional[float] = None
    high: Optional[float] = None
    finite: Any = True
    dtype: Optional[str] = None
    items: Any = None
    rule: Optional[Rule] = None
    null: bool = False
    optional: bool = False
    since: Optional[int] = None
    most: Optional[int] = None
    batch: Optional[Callable] = None
    label: str = "{path}[{key!r}]"


_KINDS = {"int": "a whole number", "real": "a number", "bool": "true or false", "str": "a string",
          "map": "a dict", "list": "a list", "array": "an array"}


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _range(f: Field) -> str:
    parts = [f">= {f.low:g}" if f.low is not None else "", f"<= {f.high:g}" if f.high is not None else ""]
    return " and ".join(p for p in parts if p)


def check_field(f: Field, value, path: str, ctx: dict) -> None:
    """Raise StateError unless `value` satisfies `f` (its path in the state is `path`)."""
    if value is None:
        problem = f.rule(value, ctx) if f.type == "any" and f.rule is not None else None  # the rule says what None means
        if f.null or (f.type == "any" and f.rule is not None and problem is None):
            return
        raise StateError(path, problem or f"is None; expected {_KINDS.get(f.type, 'a value') if isinstance(f.type, str) else 'a dict'}")
    if f.most is not None:
        _check_size(f, value, path)
    if isinstance(f.type, Section):
        f.type.check(value, ctx, path=path)
    elif f.type in ("int", "real"):
        ok = _is_int(value) if f.type == "int" else _is_real(value)
        if not ok:
            raise StateError(path, f"is {_shown(value)}; expected {_KINDS[f.type]}")
        try:
            number = np.asarray(value, dtype=float)
        except OverflowError:
            raise StateError(path, f"is {_shown(value)}, beyond the float range; expected {_KINDS[f.type]} "
                             f"{_range(f) or 'within it'}") from None
        _check_numbers(f, number, path, value)
    elif f.type == "bool" and not isinstance(value, (bool, np.bool_)):
        raise StateError(path, f"is {_shown(value)}; expected true or false")
    elif f.type == "str" and not isinstance(value, str):
        raise StateError(path, f"is {_shown(value)}; expected a string")
    elif f.type == "map":
        if not isinstance(value, Mapping):
            raise StateError(path, f"is {_shown(value)}; expected a dict")
        for key, item in value.items():
            _check_item(f, item, f.label.format(path=path, key=key, parent=path.rpartition(".")[0] or path), ctx)
    elif f.type == "list":
        if not isinstance(value, (list, tuple)):
            raise StateError(path, f"is {_shown(value)}; expected a list")
        _check_list(f, value, path, ctx)
    elif f.type == "array":
        _check_array(f, value, path)
    if f.rule is not None:
        problem = f.rule(value, ctx)
        if problem:
            raise StateError(path, problem)


def _check_size(f: Field, value, path: str) -> None:
    """At most f.most entries, counted without reading them (len, or an array's size)."""
    size = value.size if isinstance(value, np.ndarray) else len(value) if hasattr(value, "__len__") else None
    if size is not None and size > f.most:
        raise StateError(path, f"holds {size:,} entries; at most {f.most:,} fit the format: the state is damaged")


def _check_list(f: Field, value, path: str, ctx: dict) -> None:
    """Each entry against f.items; with f.batch, only the entry it finds (all of them when it finds one that passes)."""
    def label(i):
        return f.label.format(path=path, key=i, parent=path.rpartition(".")[0] or path)

    if f.batch is not None:
        first = f.batch(value, ctx)
        if first is None:
            return
        _check_item(f, value[first], label(first), ctx)
    for i, item in enumerate(value):
        _check_item(f, item, label(i), ctx)


def shown(value) -> str:
    """`value` as a message shows it: its repr, or its type and the start of it when that is long."""
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__} ({text[:40]}...)"


_shown = shown


def _check_item(f: Field, item, path: str, ctx: dict) -> None:
    if isinstance(f.items, Section):
        f.items.check(item, ctx, path=path)
    elif f.items is not None:
        check_field(f.items, item, path, ctx)


def _check_array(f: Field, value, path: str) -> None:
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as error:
        raise StateError(path, f"is not an array ({error})") from None
    kind = array.dtype.kind
    fits = {"int": kind in "iu", "real": kind in "iuf",
            "bool": kind == "b" or (kind in "iu" and bool(np.isin(array, (0, 1)).all()))}
    if f.dtype is not None and not fits[f.dtype]:
        raise StateError(path, f"holds {array.dtype} values; expected {f.dtype} values")
    if array.size and kind in "iuf":
        _check_numbers(f, array.astype(float), path, array)


def _check_numbers(f: Field, array: np.ndarray, path: str, shown) -> None:
    """Finiteness and range of a number or of every element of an array (the first offender is named)."""
    bad = np.zeros(array.shape, dtype=bool)
    if f.finite is not False:
        bad |= np.isnan(array)
    if f.finite is True:
        bad |= np.isinf(array)
    with np.errstate(invalid="ignore"):
        if f.low is not None:
            bad |= array < f.low
        if f.high is not None:
            bad |= array > f.high
    if not bad.any():
        return
    what = {True: "finite", "no-nan": "not NaN"}.get(f.finite, "")
    if not array.ndim:
        noun = _KINDS[f.type]
        wanted = " ".join(w for w in (noun.replace("a ", "a finite ", 1) if what == "finite" and f.type == "real" else noun,
                                      _range(f), "(not NaN)" if what == "not NaN" else "") if w)
        raise StateError(path, f"is {shown!r}; expected {wanted}")
    where = tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(bad)[0]), array.shape))
    wanted = " ".join(w for w in ("finite numbers" if what == "finite" else "numbers", _range(f),
                                  "(not NaN)" if what == "not NaN" else "") if w)
    at = list(where) if len(where) > 1 else where[0]
    raise StateError(path, f"holds {np.asarray(shown)[where].item()!r} at {at}; expected {wanted}")


class Section:
    """A dict-shaped part of a state: its Fields and the rules between them ((state, ctx) -> (field, problem))."""

    def __init__(self, name: str, *fields: Field, rules: Sequence[Callable] = ()):
        self.name, self.fields, self.rules = name, fields, tuple(rules)
        self.names = tuple(f.name for f in fields)

    def dump(self, values: dict) -> dict:
        """`values` as the state to save: this Section's fields only, every required one (else a bug: KeyError)."""
        unknown = sorted(set(values) - set(self.names))
        missing = sorted(f.name for f in self.fields if f.name not in values and not f.optional)
        if unknown or missing:
            raise KeyError(f"{self.name} state: fields without a rule {unknown}, fields not written {missing}")
        return {name: values[name] for name in self.names if name in values}

    def check(self, state, ctx: Optional[dict] = None, *, path: str = "") -> None:
        """Raise StateError naming the first field of `state` that breaks this Section (unknown keys are left alone)."""
        ctx = {} if ctx is None else ctx
        if not isinstance(state, Mapping):
            raise StateError(path or self.name, f"is {_shown(state)}; expected a dict")
        for f in self.fields:
            where = f"{path}.{f.name}" if path else f.name
            if f.name not in state:
                problem = missing(f, ctx)
                if problem is None:
                    continue
                raise StateError(where, problem)
            check_field(f, state[f.name], where, ctx)
        for rule in self.rules:
            found = rule(state, ctx)
            if found:
                name, problem = found  # name None: the problem names the field itself
                raise StateError("" if name is None else f"{path}.{name}" if path else name, problem)


def missing(f: Field, ctx: dict) -> Optional[str]:
    """What an absent field means: None when a state may lack it (optional, and for `since`, an audit format
    below it), else the problem ("is missing ...")."""
    if not f.optional:
        return "is missing"
    if f.since is not None and ctx.get("format", 0) >= f.since:
        return f"is missing; every audit state of format {f.since} or later holds it"
    return None


def is_int(x) -> bool:
    """An integer, not a bool (numpy's too)."""
    return _is_int(x)


def is_whole(x) -> bool:
    """A whole number (an int, or a float without a fraction)."""
    return _is_int(x) or (_is_real(x) and math.isfinite(x) and float(x).is_integer())
