"""The auditor's options, validated once at attach: each error names the option, the value and what is allowed."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np

from ..analysis.observations import MAX_WINDOW
from ..analysis.record import FRESHNESS_SHARE, REPEAT_ALPHA
from ..estimators.bounds import METHODS
from .canaries.gradient_canaries import KINDS
from .canaries.input_canaries import INPUT_KINDS, InputCanaries
from .claims.claim_range import check_canary_norms
from .values import flag, integer, one_argument_callable, real  # noqa: F401  (the callback takes them from here)

MODES = ("one-run", "paired")
DEFAULT_GRADIENT_CANARIES = 1024
DEFAULT_INPUT_CANARIES = 32
MAX_INPUT_CANARIES = 4096  # each holds a per-example gradient the size of the model
MAX_CRAFT_STEPS = 10_000  # adversarial and crafted canaries: optimisation steps per build (default 100)
BATCHED_CHECK_EVERY = 8  # check_every="auto" where readings stay on the device between checks (pipeline.py)
# the largest confidence: its false-alarm budget 1 - confidence must leave the pooled test a share after the
# noise-repeat test's REPEAT_ALPHA (1e-6) and the noise-correlation test's FRESHNESS_SHARE (analysis/record.py)
MAX_CONFIDENCE = 0.99999
assert REPEAT_ALPHA + FRESHNESS_SHARE * (1.0 - MAX_CONFIDENCE) < (1.0 - MAX_CONFIDENCE) / 2


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



OPTIONS_DOC = """
    canary: a gradient canary kind ("dirac", "constant", "random"), an input canary kind
    ("mislabeled", "blank", "adversarial", "crafted") or an InputCanaries object.
    canaries_per_step: canaries per noised step (one-run: half in, half out; paired: all
    in the second release, all out in the first); "auto" (default): 1,024 gradient
    canaries (fewer on models under 2,048 coordinates), 32 input canaries.
    canary_scale: canary norm as a multiple of the clipping bound (> 1 audits clipping).
    moving: fresh coordinates each step. support: coordinates per canary for "constant"
    and "random".
    check_every: steps between checks. A violation is recorded at the step it happens and
    raised at the next check (at most check_every - 1 steps later). "auto" (default): 8
    where the readings stay on the device between checks (gradient canaries on one
    process), 1 where a step reads on the host anyway (input canaries, several processes).
    Input canaries: module (the GradSampleModule) is required; canary_inputs /
    canary_labels are in-distribution examples held out from training, loss_fn the
    summed training loss (default cross-entropy), recraft_every the steps between
    rebuilds of adversarial and crafted canaries.
    observe_steps: plant and observe canaries in the first observe_steps noised steps
    only (None: all steps); later steps run un-audited.
    observation_window: how many of the latest raw observations `observations()` keeps
    (the counts, bounds and histograms cover every observation).
    on_violation: called once with the AuditResult when the alarm first fires (default:
    one PrivacyViolationWarning).
    per_sample_check_every: the steps between exact checks of a few real examples'
    per-sample gradients (ghost clipping: norms and clipping coefficients) against plain
    autograd, first at step 1 (checks/exact/per_sample.py; 0 turns them off);
    per_sample_check_examples: the examples compared at each;
    per_sample_check_budget: the largest share of the run's wall time the exact checks may
    take after step 1's: a due step is skipped when checking it would pass that share, at the
    last check's cost (step 1 never is; 1.0: none is).
    checksum_every: under a DistributedDPOptimizer, the steps between checks that every
    replica holds the same parameters (checks/mechanism/replicas.py; 0 turns them off).
    The run beyond the optimizer (checks/run/): data_loader, the loader the loop iterates (`watch_loader`
    for one made later); training_loss(batch), the step's loss, replayed by the independence check;
    other_optimizers, the run's other optimizers (what they hold trains outside DP-SGD).
    checks: the checks to run, replacing the defaults (`default_checks(...)`, built from the options above); add
    your own as `checks=[*default_checks(), MyCheck()]` (checks/base.py: the interface).
"""  # PrivacyAuditor's options, appended to its docstring

SETTINGS = (
    "delta", "confidence", "canary", "canaries_per_step", "mode", "estimator", "seed", "canary_scale", "moving",
    "support", "check_every", "module", "on_violation", "canary_inputs", "canary_labels", "loss_fn", "recraft_every",
    "observe_steps", "observation_window", "checksum_every", "per_sample_check_every", "per_sample_check_examples",
    "per_sample_check_budget",
)  # PrivacyAuditor's options that check_settings validates; the callback checks what it passes by these names
ESTIMATORS = tuple(m for m in METHODS if m != "katz")
INPUT_ONLY = ("canary_inputs", "canary_labels", "loss_fn", "recraft_every")  # options of input canaries alone


def check_settings(
    *, delta, confidence, canary, canaries_per_step, mode, estimator, seed, canary_scale, moving, support, check_every,
    module, on_violation, canary_inputs, canary_labels, loss_fn, recraft_every, observe_steps, observation_window,
    checksum_every, per_sample_check_every, per_sample_check_examples, per_sample_check_budget,
) -> dict:
    """The options that do not depend on the optimizer, validated: a dict of AuditOptions' fields (`canary` an
    InputCanaries for input kinds, `canaries_per_step` still "auto" if so given), or a ValueError naming the
    first bad one. per_sample_check_every / _examples / _budget are checked and not returned.

    PrivacyAuditor calls it through `validate` at attach, DPAuditCallback when it is built.
    """
    if estimator == "katz":
        raise ValueError(
            "estimator 'katz' bounds pure epsilon-DP, which no Gaussian mechanism has; use gdp-cp, gdp-bayes, "
            "epsdelta-cp or epsdelta-bayes"
        )
    delta = real("delta", delta, low=0.0, high=1.0)
    confidence = real("confidence", confidence, low=0.0, high=1.0)
    if confidence > MAX_CONFIDENCE:
        raise ValueError(
            f"Unexpected value for `confidence`: {confidence}; use a number in (0.0, {MAX_CONFIDENCE}] (above it the "
            f"false-alarm budget 1 - confidence leaves nothing after the {REPEAT_ALPHA:g} of the noise-repeat test)"
        )
    if not isinstance(estimator, str) or estimator not in ESTIMATORS:
        raise ValueError(f"Unexpected value for `estimator`: {estimator!r}; valid estimators are {', '.join(ESTIMATORS)}")
    if mode not in MODES:
        raise ValueError(f"Unexpected value for `mode`: {mode!r}; valid modes are {', '.join(MODES)}")
    if seed is not None:
        seed = integer("seed", seed, 0)
    canary_scale = real("canary_scale", canary_scale, low=0.0, high=1e4, high_open=False)  # canary norms stay finite in float32
    moving = flag("moving", moving)
    support = integer("support", support, 1)
    check_every = "auto" if check_every == "auto" else integer("check_every", check_every, 1)
    observe_steps = None if observe_steps is None else integer("observe_steps", observe_steps, 1)
    observation_window = integer(
        "observation_window", observation_window, 1, MAX_WINDOW, " (2**26: the window's rows are allocated at once, "
        "23 bytes each)",
    )
    checksum_every = integer("checksum_every", checksum_every, 0)
    integer("per_sample_check_every", per_sample_check_every, 0)
    integer("per_sample_check_examples", per_sample_check_examples, 1)
    real("per_sample_check_budget", per_sample_check_budget, low=0.0, high=1.0, high_open=False)
    on_violation = one_argument_callable("on_violation", on_violation)
    if module is not None and not callable(getattr(module, "parameters", None)):
        raise ValueError(f"Unexpected value for `module`: {type(module).__name__}; pass the torch.nn.Module being trained")
    input_options = {"canary_inputs": canary_inputs, "canary_labels": canary_labels, "loss_fn": loss_fn,
                     "recraft_every": recraft_every}
    if isinstance(canary, str) and canary in INPUT_KINDS:
        canary = InputCanaries(canary, inputs=canary_inputs, labels=canary_labels, loss_fn=loss_fn, recraft_every=recraft_every)
    elif isinstance(canary, InputCanaries):
        _refuse_inapplicable(input_options, f"an InputCanaries object ({canary.kind!r})",
                             "pass them to the InputCanaries instead")
    elif isinstance(canary, str) and canary in KINDS:
        _refuse_inapplicable(input_options, f"gradient canaries ({canary!r})",
                             f"they apply to input canaries ({', '.join(INPUT_KINDS)}) only")
    else:
        raise ValueError(
            f"Unexpected value for `canary`: {canary!r}; valid kinds are {', '.join(KINDS + INPUT_KINDS)} "
            "or an InputCanaries object"
        )
    if isinstance(canary, InputCanaries):
        _check_input_sample(canary)
    if canaries_per_step != "auto":
        canaries_per_step = integer("canaries_per_step", canaries_per_step, 2 if mode == "one-run" else 1)
        if isinstance(canary, InputCanaries) and canaries_per_step > MAX_INPUT_CANARIES:
            raise ValueError(
                f"Unexpected value for `canaries_per_step`: {canaries_per_step}; input canaries are at most "
                f"{MAX_INPUT_CANARIES} per step (each holds a per-example gradient the size of the model)"
            )
    return dict(
        delta=delta, confidence=confidence, canary=canary, canaries_per_step=canaries_per_step, mode=mode,
        estimator=estimator, seed=seed, canary_scale=canary_scale, moving=moving, support=support,
        check_every=check_every, observe_steps=observe_steps, observation_window=observation_window,
        checksum_every=checksum_every, on_violation=on_violation,
    )


def _check_input_sample(canaries: InputCanaries) -> None:
    """Input canaries' sample and loss, before anything runs on them: finite inputs (a nan or inf input makes
    every canary's gradient nan, which no later check names), a loss that takes (outputs, labels)."""
    if canaries.kind in ("adversarial", "crafted") and canaries.options["steps"] > MAX_CRAFT_STEPS:
        raise ValueError(
            f"Unexpected value for `craft_steps`: {canaries.options['steps']}; use an integer in [0, {MAX_CRAFT_STEPS}] "
            "(each is a forward and backward pass over the canaries, at every rebuild)"
        )
    x = canaries.inputs
    if getattr(x, "is_floating_point", lambda: False)():
        finite = x.isfinite()
        if not bool(finite.all()):
            bad = float(x[~finite].reshape(-1)[0])
            raise ValueError(
                f"Unexpected value for `canary_inputs`: {int((~finite).sum())} of its {x.numel()} values are not finite "
                f"(the first is {bad}); use finite examples held out from training"
            )
    try:
        inspect.signature(canaries.loss_fn).bind(object(), object())
    except TypeError as error:
        raise ValueError(
            f"`loss_fn` must take two arguments (outputs, labels) and return the loss summed over the batch: {error}"
        ) from None
    except ValueError:  # no signature to read (some builtins): accept
        pass


def _refuse_inapplicable(options: dict, kind: str, advice: str) -> None:
    """Refuse the input-canary options given (not at their defaults) with a canary kind that does not read them."""
    given = [name for name in INPUT_ONLY if not _at_default(name, options[name])]
    if given:
        shown = ", ".join(f"`{name}`={_short(options[name])}" for name in given)
        raise ValueError(f"Unexpected option(s) {shown} with {kind}: {advice}")


def _at_default(name: str, value) -> bool:
    """PrivacyAuditor's default for an input-canary option: None, and "auto" for recraft_every."""
    return value is None or (name == "recraft_every" and isinstance(value, str) and value == "auto")


def _short(value) -> str:
    """A value for a message: a tensor by its shape, anything else by a repr cut to 40 characters."""
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"<{type(value).__name__} of shape {tuple(shape)}>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def validate(optimizer, **options) -> AuditOptions:
    """AuditOptions from the constructor's keywords (check_settings), with the canaries per step resolved for the
    optimizer's size, or a ValueError naming the first bad one."""
    settings = check_settings(**options)
    check_canary_norms(optimizer, settings["canary_scale"])
    if settings["canaries_per_step"] == "auto":
        parameters = sum(p.numel() for p in optimizer.params)
        settings["canaries_per_step"] = auto_canaries(settings["canary"], parameters, settings["support"])
    return AuditOptions(**settings)


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


def check_module(module, params) -> None:
    """`module`, when given, must hold at least one of the optimizer's parameters (it may hold others: a
    LightningModule around the model); another model's GradSampleModule would be read as the one trained."""
    if module is None:
        return
    ids = {id(p) for p in params}
    if not any(id(p) in ids for p in module.parameters()):
        raise ValueError(
            f"Unexpected value for `module`: {type(module).__name__}, none of its parameters are the optimizer's; "
            "pass the model the optimizer trains (the GradSampleModule from make_private, or a module holding it)"
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


OPTIMIZER_WRAPPERS = ("LightningOptimizer", "_FabricOptimizer")  # Lightning's and Fabric's step wrappers


def unwrapped_optimizer(optimizer):
    """The optimizer inside Lightning's LightningOptimizer (what `LightningModule.optimizers()` returns, in
    manual optimization) or Fabric's wrapper; any other optimizer itself.

    The wrapper passes isinstance checks for the optimizer's class but holds none of its state: a hook
    put on it never sees the optimizer's steps. Lightning is not imported: the wrapper is known by its class.
    """
    while any(cls.__name__ in OPTIMIZER_WRAPPERS for cls in type(optimizer).__mro__):
        inner = vars(optimizer).get("_optimizer")
        if inner is None:
            break
        optimizer = inner
    return optimizer


def find_accountant(optimizer):
    """The Opacus accountant whose hook make_private attached, if any."""
    from opacus.accountants.accountant import IAccountant

    for cell in getattr(optimizer.step_hook, "__closure__", None) or ():
        if isinstance(cell.cell_contents, IAccountant):
            return cell.cell_contents
    return None
