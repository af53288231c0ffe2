"""The auditor's options, validated once at attach: each error names the option, the value and what is allowed."""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np

from .. import estimators as est
from .kinds.canaries import KINDS
from .kinds.input_canaries import INPUT_KINDS, InputCanaries

MODES = ("one-run", "paired")
DEFAULT_GRADIENT_CANARIES = 1024
DEFAULT_INPUT_CANARIES = 32
MAX_INPUT_CANARIES = 4096  # each holds a per-example gradient the size of the model
BATCHED_CHECK_EVERY = 8  # check_every="auto" where readings stay on the device between checks (pipeline.py)


@dataclass(frozen=True)
class AuditOptions:
    """Validated options of a PrivacyAuditor (see its docstring for their meaning)."""

    delta: float
    confidence: float
    canary: Union[str, InputCanaries]
    canaries_per_step: int
    mode: str
    estimator: str
    seed: Optional[int]
    canary_scale: float
    moving: bool
    support: int
    check_every: Union[int, str]  # "auto": resolved by the auditor from its kind and path
    observe_steps: Optional[int]
    observation_window: int
    checksum_every: int
    on_violation: Optional[Callable]

    @property
    def input(self) -> bool:
        return isinstance(self.canary, InputCanaries)

    @property
    def kind(self) -> str:
        return self.canary.kind if self.input else self.canary


def integer(name: str, value, minimum: int) -> int:
    """`value` as an int >= minimum; bools and non-integral numbers are refused, not truncated."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"Unexpected value for `{name}`: {value!r}; use an integer >= {minimum}")
    if value < minimum:
        raise ValueError(f"Unexpected value for `{name}`: {value}; use an integer >= {minimum}")
    return int(value)


def real(name: str, value, *, low: float, high: float = math.inf, low_open: bool = True, high_open: bool = True) -> float:
    """`value` as a finite float in the interval (low, high) (ends open or closed as asked)."""
    interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Unexpected value for `{name}`: {value!r}; use a number in {interval}")
    v = float(value)
    inside = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if math.isnan(v) or not inside or (math.isinf(v) and math.isinf(high) and high_open):
        raise ValueError(f"Unexpected value for `{name}`: {value}; use a finite number in {interval}")
    return v


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"Unexpected value for `{name}`: {value!r}; use True or False")
    return value


def one_argument_callable(name: str, value) -> Optional[Callable]:
    """None, or a callable that accepts one positional argument (checked now, not at the first alarm)."""
    if value is None:
        return None
    if not callable(value):
        raise ValueError(f"Unexpected value for `{name}`: {value!r}; use a callable taking the AuditResult, or None")
    try:
        inspect.signature(value).bind(object())
    except TypeError as error:
        raise ValueError(f"`{name}` must accept one argument (the AuditResult): {error}") from None
    except ValueError:  # no signature to read (some builtins): accept
        pass
    return value


def validate(
    optimizer, *, delta, confidence, canary, canaries_per_step, mode, estimator, seed, canary_scale, moving, support,
    check_every, module, on_violation, canary_inputs, canary_labels, loss_fn, recraft_every, observe_steps,
    observation_window, checksum_every,
) -> AuditOptions:
    """AuditOptions from the constructor's keywords, or a ValueError naming the first bad one."""
    if estimator == "katz":
        raise ValueError(
            "estimator 'katz' bounds pure epsilon-DP, which no Gaussian mechanism has; use gdp-cp, gdp-bayes, "
            "epsdelta-cp or epsdelta-bayes"
        )
    delta = real("delta", delta, low=0.0, high=1.0)
    confidence = real("confidence", confidence, low=0.0, high=1.0)
    est.epsilon_lower_bound([], [], delta=delta, method=estimator, confidence=confidence)  # the estimator's name
    if mode not in MODES:
        raise ValueError(f"Unexpected value for `mode`: {mode!r}; valid modes are {', '.join(MODES)}")
    if seed is not None:
        seed = integer("seed", seed, 0)
    canary_scale = real("canary_scale", canary_scale, low=0.0, high=1e4, high_open=False)  # canary norms stay finite in float32
    moving = flag("moving", moving)
    support = integer("support", support, 1)
    check_every = "auto" if check_every == "auto" else integer("check_every", check_every, 1)
    observe_steps = None if observe_steps is None else integer("observe_steps", observe_steps, 1)
    observation_window = integer("observation_window", observation_window, 1)
    checksum_every = integer("checksum_every", checksum_every, 0)
    on_violation = one_argument_callable("on_violation", on_violation)
    if module is not None and not callable(getattr(module, "parameters", None)):
        raise ValueError(f"Unexpected value for `module`: {type(module).__name__}; pass the torch.nn.Module being trained")
    if isinstance(canary, str) and canary in INPUT_KINDS:
        canary = InputCanaries(canary, inputs=canary_inputs, labels=canary_labels, loss_fn=loss_fn, recraft_every=recraft_every)
    elif not isinstance(canary, InputCanaries) and canary not in KINDS:
        raise ValueError(
            f"Unexpected value for `canary`: {canary!r}; valid kinds are {', '.join(KINDS + INPUT_KINDS)} "
            "or an InputCanaries object"
        )
    parameters = sum(p.numel() for p in optimizer.params)
    if canaries_per_step == "auto":
        canaries_per_step = auto_canaries(canary, parameters, support)
    minimum = 2 if mode == "one-run" else 1
    canaries_per_step = integer("canaries_per_step", canaries_per_step, minimum)
    if isinstance(canary, InputCanaries) and canaries_per_step > MAX_INPUT_CANARIES:
        raise ValueError(
            f"Unexpected value for `canaries_per_step`: {canaries_per_step}; input canaries are at most "
            f"{MAX_INPUT_CANARIES} per step (each holds a gradient of {parameters:,} values)"
        )
    return AuditOptions(
        delta=delta, confidence=confidence, canary=canary, canaries_per_step=canaries_per_step, mode=mode,
        estimator=estimator, seed=seed, canary_scale=canary_scale, moving=moving, support=support,
        check_every=check_every, observe_steps=observe_steps, observation_window=observation_window,
        checksum_every=checksum_every, on_violation=on_violation,
    )


@dataclass(frozen=True)
class Mechanism:
    """The audited optimizer's parameters, clipping bounds (one per tensor) and noise multiplier.

    The noise on each coordinate has standard deviation noise_multiplier * max_grad_norm;
    a canary in tensor l, clipped to C_l, is therefore C_l / (sigma C)-GDP per step.
    """

    params: list
    clip_bounds: np.ndarray
    per_layer: bool
    noise_multiplier: float
    max_grad_norm: float

    @classmethod
    def of(cls, optimizer) -> "Mechanism":
        params = list(optimizer.params)
        per_layer = hasattr(optimizer, "max_grad_norms")
        bounds = optimizer.max_grad_norms if per_layer else [optimizer.max_grad_norm] * len(params)
        return cls(params, np.array(bounds, dtype=float), per_layer, float(optimizer.noise_multiplier),
                   float(optimizer.max_grad_norm))


OLDEST_OPACUS = (1, 6, 0)


def check_opacus_version(version: str) -> None:
    """Refuse an Opacus older than 1.6.0: 1.5.x lacks the ghost-clipping module classes the audit reads
    (FSDP's among them) and shipped the ghost-clipping privacy bugs fixed in 1.5.3, 1.5.4 and 1.6.0."""
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())
    if parts < OLDEST_OPACUS:
        raise RuntimeError(
            f"lightning_dpaudit needs Opacus >= 1.6.0; this is Opacus {version}, whose ghost clipping is not the "
            "module code the audit reads and shipped privacy bugs fixed since (opacus-664, opacus-751, the 1.5.3 "
            "accumulation fix, opacus-807). Upgrade: pip install 'opacus>=1.6.0'"
        )


def check_claim(optimizer) -> None:
    """The optimizer's noise multiplier and clipping bound(s) must make a privacy claim to audit."""
    sigma = optimizer.noise_multiplier
    if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real) or not math.isfinite(sigma) or sigma <= 0:
        raise ValueError(
            f"Unexpected value for the optimizer's noise_multiplier: {sigma}; "
            "with no noise there is no privacy claim to audit (it must be a finite number > 0)"
        )
    bounds = getattr(optimizer, "max_grad_norms", None) or [optimizer.max_grad_norm]
    for bound in bounds:
        if isinstance(bound, bool) or not isinstance(bound, numbers.Real) or not math.isfinite(bound) or bound <= 0:
            raise ValueError(
                f"Unexpected value for the optimizer's max_grad_norm: {bound}; clipping needs a finite bound > 0"
            )


def check_accountant(accountant) -> None:
    if accountant is not None and not (hasattr(accountant, "history") and callable(getattr(accountant, "mechanism", None))):
        raise ValueError(
            f"Unexpected value for `accountant`: {accountant!r}; pass an Opacus accountant (RDPAccountant, "
            "PRVAccountant, GaussianAccountant) or None to use the one make_private attached"
        )


def auto_canaries(canary, parameters: int, support: int) -> int:
    """The default canaries per step.

    Gradient canaries: 1,024 (their rows are compressed, so they cost little, and 1,000
    steps of 1,024 reach about 0.95 of the accountant's epsilon or more), but never more
    than half the model's coordinates / support, so that moving canaries still move on
    small models. Input canaries: 32 (each costs a forward and backward pass).
    """
    if canary in INPUT_KINDS or isinstance(canary, InputCanaries):
        return DEFAULT_INPUT_CANARIES
    width = 1 if canary == "dirac" else int(support)
    return max(2, min(DEFAULT_GRADIENT_CANARIES, parameters // (2 * width)) // 2 * 2)


def find_accountant(optimizer):
    """The Opacus accountant whose hook make_private attached, if any."""
    from opacus.accountants.accountant import IAccountant

    for cell in getattr(optimizer.step_hook, "__closure__", None) or ():
        if isinstance(cell.cell_contents, IAccountant):
            return cell.cell_contents
    return None
