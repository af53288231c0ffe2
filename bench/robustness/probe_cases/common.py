"""What the probe's cases share: the Case, its expected classes, the clear-refusal test, and the digits runs judged
against plain Opacus."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Tuple

CLASSES = ("refused", "handled", "late", "raw", "silent-wrong", "runaway")
STEPS = 3  # training steps of a run that is expected to work
TOL = 1e-5  # the audited model vs plain Opacus's (the canaries are added and taken out: float rounding)
NAN, INF = float("nan"), float("inf")
REFUSED, HANDLED = "refused", "handled"


@dataclass
class Case:
    name: str
    group: str
    expect: str
    run: Callable[[], Tuple[str, str]]


# ------------------------------------------------------------------ classification helpers

CLEAR_TYPES = (ValueError, TypeError, RuntimeError)


def describe(error: BaseException) -> str:
    text = str(error).replace("\n", " ")
    return f"{type(error).__name__}: {text[:160]}"


def is_clear(error: BaseException, names) -> bool:
    """A clear refusal: a ValueError/TypeError/RuntimeError whose message names one of `names`."""
    if not isinstance(error, CLEAR_TYPES):
        return False
    if type(error).__module__.startswith(("torch", "numpy", "scipy")):
        return False
    text = str(error).lower()
    return any(name.lower() in text for name in names)


def staged(setup, use, check, names):
    """setup() takes the bad input (refused there: `refused`), use(ctx) runs it (refused there: `late`),
    check(ctx, info) -> (class, detail) judges what came out."""
    try:
        ctx = setup()
    except MemoryError as error:
        return "runaway", describe(error)
    except BaseException as error:  # noqa: BLE001
        return ("refused" if is_clear(error, names) else "raw"), describe(error)
    try:
        info = use(ctx)
    except MemoryError as error:
        return "runaway", describe(error)
    except BaseException as error:  # noqa: BLE001
        return ("late" if is_clear(error, names) else "raw"), describe(error)
    return check(ctx, info)


def refusal(call, names, valid=None):
    """A single call: refused if it raises clearly at once; else `valid(value)` -> (ok, how)."""
    def check(ctx, _):
        if valid is None:
            return "silent-wrong", f"accepted: {ctx!r}"[:200]
        ok, how = valid(ctx)
        return ("handled" if ok else "silent-wrong"), how
    return staged(call, lambda ctx: None, check, names)


# ------------------------------------------------------------------ training runs

def quiet():
    warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")
    warnings.filterwarnings("ignore", message=".*Full backward hook.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*Optimizer.step.*")


def private(**options):
    from lightning_dpaudit.integrations.digits import make_private_digits

    return make_private_digits(seed=0, **options)


def plain_params(private_options, steps, during=None, prepare=None):
    """Plain Opacus's model after `steps` steps (during(optimizer, step) and prepare(model, optimizer) as in the
    audited run)."""
    model, optimizer, loader, _ = private(**private_options)
    if prepare is not None:
        prepare(model, optimizer)
    run_steps(model, optimizer, loader, steps, during)
    return [p.detach().clone() for p in model.parameters()]


def digits_made_private(*, freeze_features=False, **options):
    """The digits CNN (seed 0), SGD on its trained tensors and a seeded loader, through Opacus's make_private with
    noise 1, C = 1, its own noise generator, and `options` (ghost clipping, adaptive clipping, ...)."""
    import torch
    from opacus import PrivacyEngine

    from lightning_dpaudit.integrations.digits import DigitsCNN, digits_dataset

    torch.manual_seed(0)
    model = DigitsCNN()
    for p in model.features.parameters() if freeze_features else ():
        p.requires_grad_(False)
    loader = torch.utils.data.DataLoader(digits_dataset(), batch_size=64, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    return PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, noise_generator=torch.Generator().manual_seed(1),
        **options)


def run_steps(model, optimizer, loader, steps, during=None, loss=None):
    import torch

    loss = loss or torch.nn.functional.cross_entropy
    done = 0
    while done < steps:
        for images, labels in loader:
            if during is not None:
                during(optimizer, done)
            optimizer.zero_grad()
            loss(model(images), labels).backward()
            optimizer.step()
            done += 1
            if done >= steps:
                return


def model_difference(model, reference) -> float:
    import torch

    diffs = [float((p.detach() - r).abs().max()) if p.shape == r.shape else INF for p, r in zip(model.parameters(), reference)]
    value = max(diffs)
    if not math.isfinite(value):
        same_nan = all(torch.equal(p.detach().isnan(), r.isnan()) for p, r in zip(model.parameters(), reference))
        return 0.0 if same_nan and all(torch.allclose(p.detach().nan_to_num(), r.nan_to_num(), atol=TOL)
                                       for p, r in zip(model.parameters(), reference)) else value
    return value


def judge_run(auditor, model, reference, steps, names, *, observed=True, violation_ok=False, failure_expected=None,
              codes=()):
    """A finished audited run: the model equals plain Opacus's, the result is a valid account of it (a violation
    naming each of `codes`, when given)."""
    diff = model_difference(model, reference)
    scale = max([1.0] + [float(r.abs().max()) for r in reference if r.numel() and r.isfinite().all()])
    diff = diff / scale  # float32 rounding of the canaries' add-and-remove grows with the parameters' size
    result = auditor.result()
    text = str(result)
    if diff > TOL:
        return "silent-wrong", f"model differs from plain Opacus's by {diff:.3g}"
    if failure_expected is not None:
        if result.audit_failed is None:
            return "silent-wrong", f"the fault left no trace: {text.splitlines()[0][:80]}"
        if text.startswith("OK") and "fail" not in text.lower():
            return "silent-wrong", f"summary says OK despite the failure {result.audit_failed[:60]}"
        return "handled", f"audit_failed={result.audit_failed[:70]!r}; model == plain"
    if result.audit_failed is not None:
        cls = "late" if any(n.lower() in result.audit_failed.lower() for n in names) else "raw"
        return cls, f"audit_failed: {result.audit_failed[:150]}"
    if result.steps != steps:
        return "silent-wrong", f"result.steps {result.steps} after {steps} steps"
    n = result.n_in + result.n_out
    if observed and n == 0:
        return "silent-wrong", f"no observation; summary: {text.splitlines()[0][:80]}"
    if not observed and n == 0 and text.startswith("OK"):
        return "silent-wrong", f"nothing observed and summary says {text.splitlines()[0][:60]}"
    found = {f.code for f in result.findings}
    if codes and not (result.violation and set(codes) <= found):
        return "silent-wrong", f"expected a violation naming {sorted(codes)}; findings {sorted(found)}"
    if result.violation and not violation_ok and not codes:
        return "silent-wrong", f"violation on a correct optimizer: {text.splitlines()[0][:80]}"
    for name in ("epsilon_lower_bound", "mu_lower_bound"):
        value = getattr(result, name, None)
        if value is not None and (isinstance(value, float) and (math.isnan(value) and n > 0 or value < 0)):
            return "silent-wrong", f"{name} = {value}"
    named = f" naming {', '.join(sorted(codes))}" if codes else ""
    return "handled", f"{steps} steps, {n} obs, violation={result.violation}{named}, model == plain (<= {diff:.1g})"


def auditor_case(options, *, names, private_options=None, steps=STEPS, observed=True, inputs=0, prepare=None,
                 during=None, violation_ok=False, codes=()):
    """PrivacyAuditor(optimizer, **options) on the digits CNN; then `steps` steps; judged against plain Opacus (made
    the same way, `prepare` included, when `codes` names the violation the run must show)."""
    private_options = dict(private_options or {})

    def run():
        quiet()
        from lightning_dpaudit import PrivacyAuditor
        from lightning_dpaudit.integrations.digits import digits_holdout

        reference = plain_params({**private_options, **({"holdout": inputs} if inputs else {})}, steps, during,
                                 prepare if codes else None)

        def setup():
            model, optimizer, loader, _ = private(**private_options, **({"holdout": inputs} if inputs else {}))
            opts = dict(options)
            if inputs:
                x, y = digits_holdout(inputs)
                opts = {"canary_inputs": x, "canary_labels": y, "module": model, **opts}
            opts = {k: (v(model) if callable(v) and getattr(v, "_needs_model", False) else v) for k, v in opts.items()}
            if prepare is not None:
                prepare(model, optimizer)
            return model, optimizer, loader, PrivacyAuditor(optimizer, **{"seed": 1, **opts})

        def use(ctx):
            model, optimizer, loader, auditor = ctx
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run_steps(model, optimizer, loader, steps, during)
            return None

        return staged(setup, use, lambda ctx, _: judge_run(ctx[3], ctx[0], reference, steps, names, observed=observed,
                                                            violation_ok=violation_ok, codes=codes), names)

    return run


def needs_model(fn):
    fn._needs_model = True
    return fn


# ------------------------------------------------------------------ labels

def show(value) -> str:
    if callable(value) and getattr(value, "__name__", "") == "<lambda>":
        return "lambda" + str(value.__code__.co_argcount)
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."
