"""Bad and unusual input across the public surface: each case runs in its own process and is classified.

    OMP_NUM_THREADS=1 .venv/bin/python bench/robustness/probe.py [--only SUBSTRING] [--list]

Classes (each case states the one it expects):
  refused       a clear ValueError/TypeError/RuntimeError (AuditStateError, ReportError, a CLI usage error)
                naming the option, raised by the call that took the bad input
  handled       ran and gave a valid result (how it was checked is printed beside it)
  late          refused clearly, but only later (at the first step, at fit, or as the audit's own failure)
  raw           an unhelpful internal exception (AttributeError, IndexError, a numpy/torch message)
  silent-wrong  accepted and gave a wrong or misleading result ("OK" with nothing audited, a violation
                from noise, a model that differs from plain Opacus's)
  runaway       over the time limit (60 s) or the memory cap (4 GiB of address space)

Cases run one at a time, each in a process forked from a server that has imported torch, Opacus and
Lightning (multiprocessing's "forkserver"), so a case cannot disturb the next. A progress line is printed
every 25 cases, then the table and the totals per class.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Callable, Tuple

from _path import harness

os.environ.setdefault("OMP_NUM_THREADS", "1")
harness.on_path(".")  # this checkout's lightning_dpaudit, whatever PYTHONPATH says

CLASSES = ("refused", "handled", "late", "raw", "silent-wrong", "runaway")
TIMEOUT = 60.0
MEMORY = 4 * 2**30
STEPS = 3  # training steps of a run that is expected to work
TOL = 1e-5  # the audited model vs plain Opacus's (the canaries are added and taken out: float rounding)
NAN, INF = float("nan"), float("inf")


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


def plain_params(private_options, steps, during=None):
    """Plain Opacus's model after `steps` steps (during(optimizer, step) as in the audited run)."""
    model, optimizer, loader, _ = private(**private_options)
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


def judge_run(auditor, model, reference, steps, names, *, observed=True, violation_ok=False, failure_expected=None):
    """A finished audited run: the model equals plain Opacus's, the result is a valid account of it."""
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
    if result.violation and not violation_ok:
        return "silent-wrong", f"violation on a correct optimizer: {text.splitlines()[0][:80]}"
    for name in ("epsilon_lower_bound", "mu_lower_bound"):
        value = getattr(result, name, None)
        if value is not None and (isinstance(value, float) and (math.isnan(value) and n > 0 or value < 0)):
            return "silent-wrong", f"{name} = {value}"
    return "handled", f"{steps} steps, {n} obs, violation={result.violation}, model == plain (<= {diff:.1g})"


def auditor_case(options, *, names, private_options=None, steps=STEPS, observed=True, inputs=0, prepare=None,
                 during=None, violation_ok=False):
    """PrivacyAuditor(optimizer, **options) on the digits CNN; then `steps` steps; judged against plain Opacus."""
    private_options = dict(private_options or {})

    def run():
        quiet()
        from lightning_dpaudit import PrivacyAuditor
        from lightning_dpaudit.integrations.digits import digits_holdout

        reference = plain_params({**private_options, **({"holdout": inputs} if inputs else {})}, steps, during)

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
                                                            violation_ok=violation_ok), names)

    return run


def needs_model(fn):
    fn._needs_model = True
    return fn


# ------------------------------------------------------------------ PrivacyAuditor's options

REFUSED, HANDLED = "refused", "handled"


def option_values():
    """(option, value, expected, extra auditor options, input canaries?) for every option of PrivacyAuditor."""
    import numpy as np

    out = []
    generic_bad = [("str", "x"), ("none", None), ("list", [1]), ("nan", NAN), ("inf", INF), ("neg", -1), ("bool", True)]
    reals = {
        "delta": ([1e-300, 0.5, np.float32(1e-5)], [0, 1.0, 2.0, -1e-5, "1e-5"]),
        "confidence": ([1e-9, 0.99999, np.float64(0.9)], [0, 1.0, 1.5, "0.95", 0.999999]),
        "canary_scale": ([1e-6, 0.5, 1.0, 1e4], [0, 1e4 + 1, 1e300, "2"]),
        "per_sample_check_budget": ([1e-9, 0.015, 1.0], [0, 1.5, -0.1, "0.02"]),
    }
    for name, (good, bad) in reals.items():
        for v in good:
            out.append((name, v, HANDLED, {}, 0))
        for v in bad:
            out.append((name, v, REFUSED, {}, 0))
        for label, v in generic_bad:
            out.append((name, v, REFUSED, {}, 0))
    ints = {
        # option: (good values, bad values, extra options)
        "canaries_per_step": ([2, 3, 64, 4900, np.int64(8)], [0, 1, 2.5, 10**12, "many", 4902 * 2], {}),
        "seed": ([0, 2**31, 2**64 + 5, np.int32(3)], [1.5, "1"], {}),
        "support": ([1, 4, 1000], [0, 2.5, 10**9], {"canary": "constant"}),
        "check_every": ([1, 2, 10**9, "auto"], [0, 2.5, "often"], {}),
        "observe_steps": ([1, 10**9], [0, 2.7], {}),
        "observation_window": ([1, 2, 2**26], [0, 2**26 + 1, 10**12], {}),
        "checksum_every": ([0, 1, 10**9], [2.5], {}),
        "per_sample_check_every": ([0, 1, 10**9], [2.5], {}),
        "per_sample_check_examples": ([1, 64, 10**6], [0, 2.5], {}),
    }
    for name, (good, bad, extra) in ints.items():
        for v in good:
            out.append((name, v, HANDLED, extra, 0))
        for v in bad:
            out.append((name, v, REFUSED, extra, 0))
        for label, v in generic_bad:
            if name in ("seed", "observe_steps") and v is None:
                out.append((name, v, HANDLED, extra, 0))
            elif name == "seed" and label == "neg":
                out.append((name, v, REFUSED, extra, 0))
            elif label in ("nan", "inf", "str", "list", "none", "neg", "bool"):
                out.append((name, v, REFUSED, extra, 0))
    for v in ["dirac", "constant", "random"]:
        out.append(("canary", v, HANDLED, {}, 0))
    for v in ["Dirac", "", None, 0, ["dirac"], "mislabeled-x"]:
        out.append(("canary", v, REFUSED, {}, 0))
    for v in ["one-run", "paired"]:
        out.append(("mode", v, HANDLED, {}, 0))
    for v in ["", None, "ONE-RUN", 1]:
        out.append(("mode", v, REFUSED, {}, 0))
    for v in ["gdp-cp", "gdp-bayes", "epsdelta-cp", "epsdelta-bayes"]:
        out.append(("estimator", v, HANDLED, {}, 0))
    for v in ["katz", "", None, 3]:
        out.append(("estimator", v, REFUSED, {}, 0))
    for v in [True, False]:
        out.append(("moving", v, HANDLED, {}, 0))
    for v in [1, 0, "True", None, np.bool_(True)]:
        out.append(("moving", v, REFUSED, {}, 0))
    for v in [print, (lambda r: None), (lambda r, extra=1: None), (lambda *a: None)]:
        out.append(("on_violation", v, HANDLED, {}, 0))
    for v in ["warn", 1, (lambda: None), (lambda a, b: None), object()]:
        out.append(("on_violation", v, REFUSED, {}, 0))
    return out


def auditor_option_cases():
    cases, seen = [], set()
    for name, value, expect, extra, inputs in option_values():
        label = f"auditor/{name}={_show(value)}" + ("".join(f",{k}={_show(v)}" for k, v in extra.items()))
        while label in seen:
            label += "'"
        seen.add(label)
        observed = not (name == "canary_scale" and isinstance(value, float) and value < 1e-3)
        cases.append(Case(label, "auditor options", expect,
                          auditor_case({name: value, **extra}, names=[name], observed=observed)))
    return cases


def _show(value) -> str:
    if callable(value) and getattr(value, "__name__", "") == "<lambda>":
        return "lambda" + str(value.__code__.co_argcount)
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."


# ------------------------------------------------------------------ input canaries

def input_cases():
    import torch

    from lightning_dpaudit.integrations.digits import digits_holdout

    cases = []
    for kind in ("mislabeled", "blank", "adversarial", "crafted"):
        cases.append(Case(f"input/{kind}", "input canaries", HANDLED,
                          auditor_case({"canary": kind, "canaries_per_step": 8}, names=["canary"], inputs=64)))
    x, y = digits_holdout(16)
    bad = [
        ("labels-onehot", {"canary_labels": torch.nn.functional.one_hot(y, 10)}, ["labels"]),
        ("labels-float", {"canary_labels": y.float()}, ["labels"]),
        ("labels-short", {"canary_labels": y[:3]}, ["labels"]),
        ("labels-negative", {"canary_labels": y - 20}, ["labels"]),
        ("labels-list", {"canary_labels": y.tolist()}, ["labels"]),
        ("inputs-numpy", {"canary_inputs": x.numpy()}, ["inputs"]),
        ("inputs-list", {"canary_inputs": x.tolist()}, ["inputs"]),
        ("inputs-empty", {"canary_inputs": x[:0], "canary_labels": y[:0]}, ["inputs"]),
        ("inputs-nan", {"canary_inputs": torch.full_like(x, NAN)}, ["inputs", "finite", "nan"]),
        ("inputs-inf", {"canary_inputs": torch.full_like(x, INF)}, ["inputs", "finite", "inf"]),
        ("inputs-shape", {"canary_inputs": x.reshape(16, 64)}, ["inputs", "shape"]),
        ("inputs-double", {"canary_inputs": x.double()}, ["inputs", "dtype"]),
        ("inputs-int", {"canary_inputs": x.long()}, ["inputs", "dtype"]),
        ("recraft-0", {"recraft_every": 0}, ["recraft_every"]),
        ("recraft-float", {"recraft_every": 2.5}, ["recraft_every"]),
        ("recraft-bool", {"recraft_every": True}, ["recraft_every"]),
        ("recraft-str", {"recraft_every": "often"}, ["recraft_every"]),
        ("loss-str", {"loss_fn": "ce"}, ["loss_fn"]),
        ("loss-mean", {"loss_fn": torch.nn.CrossEntropyLoss()}, ["loss_fn"]),
        ("loss-wrong-arity", {"loss_fn": lambda a: a.sum()}, ["loss_fn"]),
        ("loss-returns-vector", {"loss_fn": torch.nn.CrossEntropyLoss(reduction="none")}, ["loss_fn"]),
        ("loss-returns-nan", {"loss_fn": lambda o, t: (o * NAN).sum()}, ["loss_fn", "finite", "nan"]),
        ("per-step-5000", {"canaries_per_step": 5000}, ["canaries_per_step"]),
        ("no-module", {"module": None}, ["module"]),
        ("other-module", {"module": needs_model(lambda m: torch.nn.Linear(64, 10))}, ["module"]),
    ]
    for kind in ("mislabeled", "adversarial"):
        for label, change, names in bad:
            options = {"canary": kind, "canary_inputs": x, "canary_labels": y, "canaries_per_step": 8, **change}
            cases.append(Case(f"input/{kind}/{label}", "input canaries", REFUSED,
                              auditor_case(options, names=names, inputs=16)))
    good = [
        ("module-inside-GradSampleModule", {"module": needs_model(lambda m: m._module)}),
        ("recraft-none", {"recraft_every": None}),
        ("recraft-1", {"recraft_every": 1}),
        ("per-step-2", {"canaries_per_step": 2}),
        ("per-step-odd", {"canaries_per_step": 5}),
        ("one-example", {"canary_inputs": x[:1], "canary_labels": y[:1]}),
        ("paired", {"mode": "paired"}),
    ]
    for label, change in good:
        options = {"canary": "adversarial", "canary_inputs": x, "canary_labels": y, "canaries_per_step": 8, **change}
        cases.append(Case(f"input/adversarial/{label}", "input canaries", HANDLED,
                          auditor_case(options, names=["canary"], inputs=16)))
    # the InputCanaries object itself
    obj_bad = [
        ("kind", {"kind": "dirac"}), ("kind-none", {"kind": None}), ("craft_steps", {"craft_steps": -1}),
        ("craft_steps", {"craft_steps": 10**12}), ("step_size", {"step_size": NAN}), ("step_size", {"step_size": -1}),
        ("epsilon", {"epsilon": INF}), ("epsilon", {"epsilon": "0.3"}), ("min_strength", {"min_strength": 0}),
        ("min_strength", {"min_strength": 1.5}), ("num_classes", {"num_classes": 1}), ("num_classes", {"num_classes": 2.0}),
        ("num_classes", {"num_classes": 3}),
    ]
    for label, change in obj_bad:
        cases.append(Case(f"InputCanaries/{label}={_show(list(change.values())[0])}", "input canaries",
                          REFUSED, _input_object_case(change, [label.split("-")[0], "canary", "num_classes", "labels"]
                                                      if label.startswith(("kind", "num_classes")) else [label])))
    return cases


def _input_object_case(change, names):
    def run():
        quiet()
        from lightning_dpaudit.engine.canaries.input_canaries import InputCanaries
        from lightning_dpaudit.integrations.digits import digits_holdout

        x, y = digits_holdout(16)
        kwargs = {"kind": "crafted", "inputs": x, "labels": y, "craft_steps": 5, **change}
        kind = kwargs.pop("kind")
        if change.get("craft_steps") == 10**12 or change.get("num_classes") == 3:
            # accepted values only fail when used: run them
            return auditor_case({"canary": None}, names=names, inputs=16)() if False else _run_input_object(kind, kwargs, names)
        return refusal(lambda: InputCanaries(kind, **kwargs), names)

    return run


def _run_input_object(kind, kwargs, names):
    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.engine.canaries.input_canaries import InputCanaries

    reference = plain_params({"holdout": 16}, STEPS)

    def setup():
        model, optimizer, loader, _ = private(holdout=16)
        return model, optimizer, loader, PrivacyAuditor(optimizer, canary=InputCanaries(kind, **kwargs), module=model,
                                                        canaries_per_step=4, seed=1)

    def use(ctx):
        run_steps(*ctx[:3], STEPS)

    return staged(setup, use, lambda ctx, _: judge_run(ctx[3], ctx[0], reference, STEPS, names), names)


# ------------------------------------------------------------------ attach targets

def attach_cases():
    import torch

    def target(make, names, expect):
        def run():
            quiet()
            from lightning_dpaudit import PrivacyAuditor

            return refusal(lambda: PrivacyAuditor(make()), names)
        return Case(f"attach/{make.__name__}", "attach targets", expect, run)

    def plain_sgd():
        return torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)

    def adam():
        return torch.optim.Adam(torch.nn.Linear(4, 2).parameters())

    def a_model():
        return torch.nn.Linear(4, 2)

    def none():
        return None

    def a_string():
        return "optimizer"

    def a_list_of_dp():
        return [private()[1]]

    def lightning_wrapping_sgd():
        from pytorch_lightning.core.optimizer import LightningOptimizer

        return LightningOptimizer(plain_sgd())

    def privacy_engine():
        return private()[3]

    def data_loader():
        return private()[2]

    def grad_sample_module():
        return private()[0]

    cases = [target(f, ["Opacus", "DPOptimizer", "optimizer"], REFUSED) for f in
             (plain_sgd, adam, a_model, none, a_string, a_list_of_dp, lightning_wrapping_sgd, privacy_engine,
              data_loader, grad_sample_module)]

    def lightning_wrapping_dp(model, optimizer):
        pass

    # DP optimizers of other kinds and states, run for STEPS steps
    def wrapped(model, optimizer):
        from pytorch_lightning.core.optimizer import LightningOptimizer

        return LightningOptimizer(optimizer)

    cases.append(Case("attach/LightningOptimizer(DPOptimizer)", "attach targets", HANDLED,
                      _attach_run(lambda m, o: wrapped(m, o))))
    cases.append(Case("attach/per-layer clipping", "attach targets", HANDLED,
                      auditor_case({}, names=["optimizer"], private_options={"clipping": "per_layer"})))
    cases.append(Case("attach/loss_reduction=sum", "attach targets", HANDLED,
                      auditor_case({}, names=["optimizer"], private_options={"loss_reduction": "sum"})))
    cases.append(Case("attach/no poisson", "attach targets", HANDLED,
                      auditor_case({}, names=["optimizer"], private_options={"poisson_sampling": False})))
    cases.append(Case("attach/prv accountant", "attach targets", HANDLED,
                      auditor_case({}, names=["optimizer"], private_options={"accountant": "prv"})))
    cases.append(Case("attach/gdp accountant", "attach targets", HANDLED,
                      auditor_case({}, names=["optimizer"], private_options={"accountant": "gdp"})))
    cases.append(Case("attach/float64 model", "attach targets", HANDLED,
                      auditor_case({}, names=["optimizer"], private_options={"dtype": torch.float64})))
    cases.append(Case("attach/sigma=1e-3", "attach targets", HANDLED,
                      auditor_case({}, names=["noise_multiplier"], private_options={"noise_multiplier": 1e-3})))
    cases.append(Case("attach/sigma=1e6", "attach targets", HANDLED,
                      auditor_case({}, names=["noise_multiplier"], private_options={"noise_multiplier": 1e6})))
    cases.append(Case("attach/max_grad_norm=1e-8", "attach targets", HANDLED,
                      auditor_case({}, names=["max_grad_norm"], private_options={"max_grad_norm": 1e-8})))
    cases.append(Case("attach/max_grad_norm=1e8", "attach targets", HANDLED,
                      auditor_case({}, names=["max_grad_norm"], private_options={"max_grad_norm": 1e8})))
    for attribute, value in [("noise_multiplier", 0.0), ("noise_multiplier", -1.0), ("noise_multiplier", NAN),
                             ("noise_multiplier", INF), ("noise_multiplier", "1"), ("noise_multiplier", None),
                             ("max_grad_norm", 0.0), ("max_grad_norm", -1.0), ("max_grad_norm", NAN),
                             ("max_grad_norm", None), ("max_grad_norm", "1.0")]:
        cases.append(Case(f"attach/optimizer.{attribute}={value!r}", "attach targets", REFUSED,
                          auditor_case({}, names=[attribute], prepare=_setter(attribute, value))))
    cases.append(Case("attach/twice", "attach targets", REFUSED, _attach_twice()))
    cases.append(Case("attach/detach-then-again", "attach targets", HANDLED, _attach_after_detach()))
    cases.append(Case("attach/optimizer-without-params", "attach targets", REFUSED, _attach_empty()))
    cases.append(Case("attach/frozen-layer", "attach targets", HANDLED, _attach_frozen()))
    cases.append(Case("attach/other-engine-accountant", "attach targets", HANDLED, _attach_foreign_accountant()))
    cases.append(Case("attach/ghost clipping", "attach targets", HANDLED, _attach_ghost()))
    cases.append(Case("attach/adaptive clipping", "attach targets", HANDLED, _attach_adaptive()))
    return cases


def _setter(attribute, value):
    def prepare(model, optimizer):
        setattr(optimizer, attribute, value)
    return prepare


def _attach_run(convert):
    def run():
        quiet()
        from lightning_dpaudit import PrivacyAuditor

        reference = plain_params({}, STEPS)

        def setup():
            model, optimizer, loader, _ = private()
            return model, optimizer, loader, PrivacyAuditor(convert(model, optimizer), seed=1)

        return staged(setup, lambda ctx: run_steps(*ctx[:3], STEPS),
                      lambda ctx, _: judge_run(ctx[3], ctx[0], reference, STEPS, ["optimizer"]), ["optimizer"])
    return run


def _attach_twice():
    def run():
        quiet()
        from lightning_dpaudit import PrivacyAuditor

        _, optimizer, _, _ = private()
        PrivacyAuditor(optimizer, seed=1)
        return refusal(lambda: PrivacyAuditor(optimizer, seed=2), ["already attached", "detach"])
    return run


def _attach_after_detach():
    def run():
        quiet()
        from lightning_dpaudit import PrivacyAuditor

        m0, o0, l0, _ = private()
        run_steps(m0, o0, l0, STEPS)
        run_steps(m0, o0, l0, STEPS)  # a second loop over the loader starts a new epoch, as below
        reference = [p.detach().clone() for p in m0.parameters()]
        model, optimizer, loader, _ = private()
        first = PrivacyAuditor(optimizer, seed=1)
        run_steps(model, optimizer, loader, STEPS)
        first.detach()
        second = PrivacyAuditor(optimizer, seed=2)
        run_steps(model, optimizer, loader, STEPS)
        cls, how = judge_run(second, model, reference, STEPS, ["detach"])
        if cls == "handled" and first.steps != STEPS:
            return "silent-wrong", f"the detached audit counted {first.steps} steps"
        return cls, how
    return run


def _attach_empty():
    def run():
        quiet()
        import torch
        from opacus.optimizers import DPOptimizer

        from lightning_dpaudit import PrivacyAuditor

        optimizer = DPOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), noise_multiplier=1.0,
                                max_grad_norm=1.0, expected_batch_size=4)
        optimizer.param_groups[0]["params"] = []
        return refusal(lambda: PrivacyAuditor(optimizer), ["param", "optimizer", "coordinates"])
    return run


def _attach_frozen():
    def run():
        quiet()
        from lightning_dpaudit import PrivacyAuditor

        def build():
            return digits_made_private(freeze_features=True)

        m0, o0, l0 = build()
        run_steps(m0, o0, l0, STEPS)
        reference = [p.detach().clone() for p in m0.parameters()]

        def setup():
            model, optimizer, loader = build()
            return model, optimizer, loader, PrivacyAuditor(optimizer, seed=1)

        return staged(setup, lambda ctx: run_steps(*ctx[:3], STEPS),
                      lambda ctx, _: judge_run(ctx[3], ctx[0], reference, STEPS, ["frozen"]), ["requires_grad"])
    return run


def _attach_foreign_accountant():
    def run():
        quiet()
        from lightning_dpaudit import PrivacyAuditor

        reference = plain_params({}, STEPS)
        other = private(noise_multiplier=5.0)[3].accountant

        def setup():
            model, optimizer, loader, _ = private()
            return model, optimizer, loader, PrivacyAuditor(optimizer, seed=1, accountant=other)

        def check(ctx, _):
            result = ctx[3].result()
            if result.violation and "claim_unaccounted" in str(result) and "accountant" in str(result):
                diff = model_difference(ctx[0], reference)
                return ("handled" if diff <= TOL else "silent-wrong"), (
                    "flagged claim_unaccounted: the accountant composes none of the released steps; model == plain")
            cls, how = judge_run(ctx[3], ctx[0], reference, STEPS, ["accountant"])
            if cls == "handled" and not (result.epsilon_accountant == 0 or math.isnan(result.epsilon_accountant)
                                         or "accountant" in str(result).lower() and "not" in str(result).lower()):
                return "silent-wrong", (f"an accountant that saw no step of this optimizer gives epsilon "
                                        f"{result.epsilon_accountant:.3g} as the claim")
            return cls, how

        return staged(setup, lambda ctx: run_steps(*ctx[:3], STEPS), check, ["accountant"])
    return run


def _attach_ghost():
    def run():
        quiet()
        import torch

        from lightning_dpaudit import PrivacyAuditor

        def build():
            return digits_made_private(criterion=torch.nn.CrossEntropyLoss(), grad_sample_mode="ghost")

        def train(model, optimizer, criterion, loader):
            run_steps(model, optimizer, loader, STEPS, loss=criterion)

        m, o, c, l = build()
        train(m, o, c, l)
        reference = [p.detach().clone() for p in m.parameters()]

        def setup():
            model, optimizer, criterion, loader = build()
            return model, optimizer, criterion, loader, PrivacyAuditor(optimizer, seed=1)

        return staged(setup, lambda ctx: train(*ctx[:4]),
                      lambda ctx, _: judge_run(ctx[4], ctx[0], reference, STEPS, ["ghost"]), ["ghost"])
    return run


def _attach_adaptive():
    def run():
        quiet()

        from lightning_dpaudit import PrivacyAuditor

        def build():
            return digits_made_private(clipping="adaptive", target_unclipped_quantile=0.5, clipbound_learning_rate=0.2,
                                       max_clipbound=10.0, min_clipbound=0.1, unclipped_num_std=5.0)

        m, o, l = build()
        run_steps(m, o, l, STEPS)
        reference = [p.detach().clone() for p in m.parameters()]

        def setup():
            model, optimizer, loader = build()
            return model, optimizer, loader, PrivacyAuditor(optimizer, seed=1)

        return staged(setup, lambda ctx: run_steps(*ctx[:3], STEPS),
                      lambda ctx, _: judge_run(ctx[3], ctx[0], reference, STEPS, ["adaptive"]), ["adaptive", "clip"])
    return run


# ------------------------------------------------------------------ noise and clipping changed mid-run

def schedule_cases():
    cases = []
    steps = 6
    changes = [
        ("sigma 1 -> 0.5", "noise_multiplier", 0.5, HANDLED),
        ("sigma 1 -> 4", "noise_multiplier", 4.0, HANDLED),
        ("sigma 1 -> 1e-3", "noise_multiplier", 1e-3, HANDLED),
        ("C 1 -> 0.1", "max_grad_norm", 0.1, HANDLED),
        ("C 1 -> 10", "max_grad_norm", 10.0, HANDLED),
        ("sigma 1 -> 0", "noise_multiplier", 0.0, "late"),
        ("sigma 1 -> nan", "noise_multiplier", NAN, "late"),
        ("sigma 1 -> -1", "noise_multiplier", -1.0, "late"),
        ("sigma 1 -> '2'", "noise_multiplier", "2", "late"),
        ("C 1 -> 0", "max_grad_norm", 0.0, "late"),
        ("C 1 -> inf", "max_grad_norm", INF, "late"),
        ("C 1 -> tensor(2.)", "max_grad_norm", "tensor", HANDLED),
    ]
    for label, attribute, value, expect in changes:
        for canary in ("dirac", "random"):
            cases.append(Case(f"schedule/{canary}/{label}", "schedules", expect,
                              _schedule_case(attribute, value, canary, steps, expect)))
    return cases


def _schedule_case(attribute, value, canary, steps, expect):
    def during(optimizer, step):
        import torch

        if step == steps // 2:
            setattr(optimizer, attribute, torch.tensor(2.0) if value == "tensor" else value)

    def run():
        quiet()
        from lightning_dpaudit import PrivacyAuditor

        names = [attribute]
        if expect != HANDLED:
            # plain Opacus trains on with such a value (or fails itself); what matters is the audit's account
            try:
                reference = plain_params({}, steps, during)
            except Exception as error:  # noqa: BLE001
                reference = None
                plain_error = describe(error)
        else:
            reference = plain_params({}, steps, during)

        def setup():
            model, optimizer, loader, _ = private()
            return model, optimizer, loader, PrivacyAuditor(optimizer, seed=1, canary=canary)

        def use(ctx):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    run_steps(*ctx[:3], steps, during)
                except Exception as error:  # noqa: BLE001
                    failed = ctx[3].result(accounting=False).audit_failed
                    if reference is None and describe(error) == plain_error and failed and attribute in failed:
                        return ("opacus", describe(error), failed)
                    raise

        def check(ctx, info):
            auditor, model = ctx[3], ctx[0]
            if info is not None and info[0] == "opacus":
                return "late", f"the audit refused it ({info[2][:90]}); then Opacus's own {info[1][:50]}, as without it"
            result = auditor.result(accounting=False)
            if expect == HANDLED:
                cls, how = judge_run(auditor, model, reference, steps, names)
                if cls == "handled":
                    sigma = float(auditor.optimizer.noise_multiplier)
                    if not math.isclose(result.mu_claimed, 1.0 / sigma, rel_tol=1e-6) and attribute == "noise_multiplier":
                        return "silent-wrong", f"mu_claimed {result.mu_claimed:.3g} after sigma became {sigma}"
                return cls, how
            text = str(result)
            if result.audit_failed or any(n in text for n in names) and not text.startswith("OK"):
                named = any(n in (result.audit_failed or text) for n in names)
                return ("late" if named else "raw"), f"{(result.audit_failed or text.splitlines()[0])[:150]}"
            return "silent-wrong", f"accepted {attribute}={value!r} mid-run; summary: {text.splitlines()[0][:70]}"

        return staged(setup, use, check, names)
    return run


# ------------------------------------------------------------------ faults inside the audit's step

def fault_cases():
    targets = [
        ("kind.plant", lambda a: (a.kind, "plant")),
        ("kind.read", lambda a: (a.kind, "read")),
        ("kind.finish_step", lambda a: (a.kind, "finish_step")),
        ("record.add", lambda a: (a.record, _first_attr(a.record, ("add", "observe", "add_step", "record")))),
        ("path.release", lambda a: (a.path, _first_attr(a.path, ("release", "add_noise", "noised", "step")))),
        ("probe.pool", lambda a: (a.probe, _first_attr(a.probe, ("rows", "canary_rows", "gather", "pool_rows")))),
        ("pipeline.check", lambda a: (a.pipeline, "check")),
        ("results.result", lambda a: (a.results, "result")),
        ("per_sample_check.around_step", lambda a: (a.per_sample_check, "around_step")),
    ]
    cases = []
    for label, where in targets:
        for at_step in (0, 1):
            for error in ("RuntimeError", "MemoryError", "KeyboardInterrupt"):
                if error == "KeyboardInterrupt" and at_step == 0:
                    continue
                expect = HANDLED
                cases.append(Case(f"fault/{label}/step{at_step + 1}/{error}", "faults", expect,
                                  _fault_case(where, at_step, error)))
    cases.append(Case("fault/on_violation raises", "faults", HANDLED, _on_violation_raises()))
    cases.append(Case("fault/accountant get_epsilon raises", "faults", HANDLED, _accountant_raises()))
    return cases


def _first_attr(obj, names):
    for name in names:
        if callable(getattr(obj, name, None)):
            return name
    return names[0]


def _fault_case(where, at_step, error_name):
    def run():
        quiet()
        from lightning_dpaudit import PrivacyAuditor

        reference = plain_params({}, STEPS)
        model, optimizer, loader, _ = private()
        auditor = PrivacyAuditor(optimizer, seed=1)
        target, name = where(auditor)
        if not callable(getattr(target, name, None)):
            return "handled", f"no {type(target).__name__}.{name} to break (nothing to probe)"
        original = getattr(target, name)
        calls = {"n": 0}
        error_type = {"RuntimeError": RuntimeError, "MemoryError": MemoryError, "KeyboardInterrupt": KeyboardInterrupt}[error_name]

        def broken(*args, **kwargs):
            if auditor.pipeline.steps >= at_step:
                calls["n"] += 1
                raise error_type(f"injected fault in {name}")
            return original(*args, **kwargs)

        setattr(target, name, broken)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run_steps(model, optimizer, loader, STEPS)
        except KeyboardInterrupt:
            if error_name == "KeyboardInterrupt":
                return "handled", "KeyboardInterrupt passed on to the training loop"
            raise
        except Exception as error:  # noqa: BLE001
            return "raw", f"training stopped by the audit's fault: {describe(error)}"
        if calls["n"] == 0:
            return "handled", f"{name} not called in a step (fault not reached)"
        if error_name == "KeyboardInterrupt":
            return "silent-wrong", "KeyboardInterrupt swallowed"
        setattr(target, name, original)
        try:
            return judge_run(auditor, model, reference, STEPS, [name], failure_expected=True)
        except Exception as error:  # noqa: BLE001
            return "raw", f"result() after the fault: {describe(error)}"
    return run


def _on_violation_raises():
    def run():
        quiet()
        from lightning_dpaudit import PrivacyAuditor
        from lightning_dpaudit.integrations.bugs import inject_bug, BUGS

        model, optimizer, loader, _ = private()
        bug = next(iter(BUGS))
        inject_bug(optimizer, bug)

        class Stop(Exception):
            pass

        def alarm(result):
            raise Stop("stop training")

        auditor = PrivacyAuditor(optimizer, seed=1, on_violation=alarm, check_every=1)
        try:
            run_steps(model, optimizer, loader, 40)
        except Stop:
            return "handled", f"on_violation's exception reached the training loop (bug {bug})"
        return "handled" if not auditor.result(accounting=False).violation else "silent-wrong", f"bug {bug}: no alarm"
    return run


def _accountant_raises():
    def run():
        quiet()
        from lightning_dpaudit import PrivacyAuditor

        model, optimizer, loader, engine = private()
        auditor = PrivacyAuditor(optimizer, seed=1)
        run_steps(model, optimizer, loader, STEPS)

        def broken(*a, **k):
            raise RuntimeError("accountant broken")

        engine.accountant.get_epsilon = broken
        try:
            result = auditor.result()
        except RuntimeError as error:
            return "late", describe(error)
        from opacus.accountants import RDPAccountant

        fresh = RDPAccountant()
        fresh.history = list(engine.accountant.history)
        true = fresh.get_epsilon(1e-5)
        ok = math.isnan(result.epsilon_accountant) or result.audit_failed or math.isclose(result.epsilon_accountant, true)
        return ("handled" if ok else "silent-wrong",
                f"epsilon_accountant={result.epsilon_accountant:.4g} (the history's own: {true:.4g})")
    return run


# ------------------------------------------------------------------ saved state (auditor) and checkpoints (callback)

def state_cases():
    import numpy as np

    corruptions = [
        ("torch-roundtrip", lambda s: _torch_roundtrip(s), HANDLED),
        ("json-roundtrip", lambda s: json.loads(json.dumps(s, default=_jsonable)), REFUSED),
        ("extra-key", lambda s: {**s, "unexpected": 1}, HANDLED),
        ("steps=huge", lambda s: {**s, "steps": 10**18}, REFUSED),
        ("steps=True", lambda s: {**s, "steps": True}, REFUSED),
        ("steps=nan", lambda s: {**s, "steps": NAN}, REFUSED),
        ("format=str", lambda s: {**s, "format": "2"}, REFUSED),
        ("setup=None", lambda s: {**s, "setup": None}, REFUSED),
        ("log=None", lambda s: {**s, "log": None}, REFUSED),
        ("monitor=[]", lambda s: {**s, "monitor": []}, REFUSED),
        ("sampler=None", lambda s: {**s, "sampler": None}, REFUSED),
        ("pool=[]", lambda s: {**s, "pool": []}, REFUSED),
        ("pool=nan", lambda s: {**s, "pool": [np.full_like(p, NAN) for p in s["pool"]]}, REFUSED),
        ("fingerprints=None", lambda s: {**s, "fingerprints": None}, REFUSED),
        ("empty dict", lambda s: {}, REFUSED),
        ("state of a longer run", None, HANDLED),
    ]
    cases = []
    for label, corrupt, expect in corruptions:
        cases.append(Case(f"state/{label}", "saved state", expect, _state_case(corrupt)))
    return cases


def _jsonable(value):
    import numpy as np

    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return str(value)


def _torch_roundtrip(state):
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _state_case(corrupt):
    def run():
        quiet()
        import copy

        from lightning_dpaudit import PrivacyAuditor

        model, optimizer, loader, _ = private()
        saver = PrivacyAuditor(optimizer, seed=1)
        run_steps(model, optimizer, loader, 5 if corrupt is None else STEPS)
        state = copy.deepcopy(saver.state_dict())
        model2, optimizer2, loader2, engine2 = private()
        engine2.accountant.history = copy.deepcopy(saver.accountant.history)  # a resume restores the accountant
        optimizer2.generator.set_state(optimizer.generator.get_state())  # and the noise generator (else: noise repeats)
        auditor = PrivacyAuditor(optimizer2, seed=1)
        before = auditor.result(accounting=False)
        names = ["state", "saved", "steps", "format", "setup", "log", "monitor", "sampler", "pool", "fingerprints", "damaged"]

        def setup():
            auditor.load_state_dict(state if corrupt is None else corrupt(state))

        def check(ctx, _):
            after = auditor.result(accounting=False)
            composed = sum(n for _, _, n in engine2.accountant.history)
            run_steps(model2, optimizer2, loader2, 1)
            final = auditor.result(accounting=False)
            if final.audit_failed:
                return "raw", f"after loading, the next step failed: {final.audit_failed[:120]}"
            if after.steps != composed:
                return "silent-wrong", f"loaded a state of {after.steps} steps where the accountant composed {composed}"
            if final.steps != after.steps + 1 or final.violation:
                return "silent-wrong", (f"steps {after.steps} -> {final.steps}, violation {final.violation}: "
                                        f"{str(final).splitlines()[0][:90]}")
            return "handled", f"loaded: steps {before.steps} -> {after.steps}, one more step audited"

        return staged(setup, lambda ctx: None, check, names)
    return run


# ------------------------------------------------------------------ the Lightning callback

def callback_cases():
    cases = []
    bad = [
        ("alert", "email"), ("alert", None), ("alert", 1), ("alert", lambda: 1),
        ("log_every_n_steps", 0), ("log_every_n_steps", -1), ("log_every_n_steps", 1.5), ("log_every_n_steps", True),
        ("log_every_n_steps", None), ("log_every_n_steps", "10"),
        ("logging_budget", 0), ("logging_budget", -0.1), ("logging_budget", 1.5), ("logging_budget", NAN),
        ("logging_budget", "0.02"), ("report", 1), ("report", None), ("checkpoint_noise_generator", "yes"),
        ("final_model_canaries", 5), ("final_model_canaries", "ood"), ("final_model_every_n_epochs", 0),
        ("final_model_every_n_epochs", 1.5), ("accountant", "rdp"), ("optimizer", 5), ("optimizer", "sgd"),
        ("delta", 0), ("confidence", 2), ("canary", "nope"), ("canaries_per_step", 1), ("mode", "x"),
        ("seed", -3), ("observation_window", 0), ("check_every", 0), ("bogus_option", 1), ("module", "model"),
    ]
    for name, value in bad:
        expect = REFUSED
        cases.append(Case(f"callback/{name}={_show(value)}", "callback options", expect,
                          _callback_build({name: value}, [name])))
    good = [
        ("default", {}), ("log_every_n_steps=1", {"log_every_n_steps": 1}),
        ("log_every_n_steps=10**9", {"log_every_n_steps": 10**9}), ("logging_budget=1", {"logging_budget": 1.0}),
        ("logging_budget=1e-9", {"logging_budget": 1e-9}), ("report=False", {"report": False}),
        ("alert=raise", {"alert": "raise"}), ("alert=stop", {"alert": "stop"}), ("alert=callable", {"alert": print}),
        ("canary=random", {"canary": "random"}), ("mode=paired", {"mode": "paired"}),
        ("observe_steps=1", {"observe_steps": 1}), ("check_every=10**9", {"check_every": 10**9}),
    ]
    for label, options in good:
        cases.append(Case(f"callback-fit/{label}", "callback fit", HANDLED, _callback_fit(options)))
    cases.append(Case("callback-fit/optimizer=plain SGD", "callback fit", "late", _callback_fit({}, plain=True)))
    cases.append(Case("callback-fit/optimizer=other DPOptimizer", "callback fit", "late", _callback_fit({}, foreign=True)))
    cases.append(Case("callback-fit/checkpoint resume", "checkpoints", HANDLED, _callback_resume(None)))
    for label, corrupt in [("state=None", lambda s: None), ("state=[]", lambda s: []),
                           ("state missing auditor", lambda s: {k: v for k, v in s.items() if k != "auditor"}),
                           ("state=str", lambda s: "x"), ("auditor state damaged", _damage_auditor_state)]:
        cases.append(Case(f"checkpoint/{label}", "checkpoints", REFUSED, _callback_resume(corrupt)))
    return cases


def _damage_auditor_state(state):
    state = dict(state)
    for key, value in state.items():
        if isinstance(value, dict) and "steps" in value:
            state[key] = {**value, "steps": -5}
    return state


def _callback_build(options, names):
    def run():
        quiet()
        from lightning_dpaudit import DPAuditCallback

        return refusal(lambda: DPAuditCallback(**options), names)
    return run


def _lightning_parts():
    import pytorch_lightning as pl
    import torch
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, Subset

    from lightning_dpaudit.integrations.digits import DigitsCNN, digits_dataset

    from opacus.data_loader import DPDataLoader
    from opacus.lightning import DPLightningDataModule

    class Shuffled(pl.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(Subset(digits_dataset(), range(256)), batch_size=64, shuffle=True,
                              generator=torch.Generator().manual_seed(0))

    def Digits():  # Poisson sampling at the accountant's rate, as a correct DP run draws its batches (seeded)
        return DPLightningDataModule(Shuffled(), generator=torch.Generator().manual_seed(0))

    class Private(pl.LightningModule):
        def __init__(self, plain=False):
            super().__init__()
            torch.manual_seed(0)
            self.model = DigitsCNN()
            self.plain = plain

        def forward(self, x):
            return self.model(x)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.model(batch[0]), batch[1])

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            if self.plain:
                return optimizer
            loader = self.trainer.datamodule.train_dataloader()
            _, optimizer, _ = PrivacyEngine().make_private(
                module=self, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                poisson_sampling=isinstance(loader, DPDataLoader), noise_generator=torch.Generator().manual_seed(1))
            return optimizer

    return pl, Digits, Private


def _trainer(pl, root, steps, callbacks, **kwargs):
    return pl.Trainer(max_steps=steps, callbacks=callbacks, logger=False, default_root_dir=root,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      accelerator="cpu", **kwargs)


def _callback_fit(options, plain=False, foreign=False):
    def run():
        quiet()
        import logging

        logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        from lightning_dpaudit import DPAuditCallback

        pl, Digits, Private = _lightning_parts()
        root = tempfile.mkdtemp()
        steps = 4
        reference_module = Private(plain=plain)
        pl.seed_everything(0, verbose=False)
        _trainer(pl, root + "/plain", steps, []).fit(reference_module, datamodule=Digits())
        reference = [p.detach().clone() for p in reference_module.parameters()]
        names = ["optimizer", "DPOptimizer", "Opacus"]

        def setup():
            extra = {}
            if foreign:
                extra["optimizer"] = private()[1]
            return DPAuditCallback(**options, **extra)

        def use(callback):
            module = Private(plain=plain)
            pl.seed_everything(0, verbose=False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer = _trainer(pl, root + "/audited", steps, [callback])
                trainer.fit(module, datamodule=Digits())
            return module, trainer

        def check(callback, info):
            module, trainer = info
            if plain or foreign:
                return "silent-wrong", f"fit ran {trainer.global_step} steps with the audit of another optimizer"
            auditor = callback.auditor
            if auditor is None:
                return "silent-wrong", "no auditor after fit"
            cls, how = judge_run(auditor, module, reference, steps, names, observed=options.get("observe_steps") != 0)
            report = [os.path.join(d, f) for d, _, fs in os.walk(root + "/audited") for f in fs if f == "audit_report.json"]
            if cls == "handled" and options.get("report", True) and not report:
                return "silent-wrong", "no audit_report.json written"
            return cls, how

        return staged(setup, use, check, names)
    return run


def _callback_resume(corrupt):
    def run():
        quiet()
        import logging

        logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
        from lightning_dpaudit import DPAuditCallback

        pl, Digits, Private = _lightning_parts()
        root = tempfile.mkdtemp()
        callback = DPAuditCallback(seed=0)
        pl.seed_everything(0, verbose=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = _trainer(pl, root, 3, [callback])
            trainer.fit(Private(), datamodule=Digits())
        state = callback.state_dict()
        fresh = DPAuditCallback(seed=0)
        names = ["state", "checkpoint", "steps", "auditor", "dict", "damaged"]

        def setup():
            return fresh.load_state_dict(state if corrupt is None else corrupt(state))

        def use(_):
            pl.seed_everything(0, verbose=False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer = _trainer(pl, root + "/resumed", 2, [fresh])
                trainer.fit(Private(), datamodule=Digits())
            return trainer

        def check(_, trainer):
            result = fresh.auditor.result(accounting=False)
            if corrupt is not None:
                return "silent-wrong", f"damaged state accepted; resumed audit has {result.steps} steps"
            if result.audit_failed or result.steps != 5:
                return "silent-wrong", f"resumed: steps {result.steps}, failed {result.audit_failed}"
            return "handled", "resumed: 3 + 2 steps audited"

        return staged(setup, use, check, names)
    return run


# ------------------------------------------------------------------ reports and the CLI

GOOD_RESULT = {
    "violation": False, "violating_layers": [], "steps": 10, "n_in": 5, "n_out": 5, "epsilon_lower_bound": 0.5,
    "epsilon_accountant": 1.0, "mu_lower_bound": 0.3, "mu_claimed": 1.0, "delta": 1e-5, "confidence": 0.95,
    "first_violation_step": None,
}


def report_cases():
    damaged = [
        ("empty", "", 1), ("whitespace", "   \n", 1), ("null", "null", 1), ("number", "42", 1), ("string", '"x"', 1),
        ("result=null", json.dumps({"result": None}), 1), ("result=list", json.dumps({"result": [1]}), 1),
        ("NaN epsilon", json.dumps({"result": {**GOOD_RESULT, "epsilon_lower_bound": NAN}}), 1),
        ("Infinity mu", json.dumps({"result": {**GOOD_RESULT, "mu_lower_bound": INF}}), 1),
        ("steps=-1", json.dumps({"result": {**GOOD_RESULT, "steps": -1}}), 1),
        ("steps=1e30", json.dumps({"result": {**GOOD_RESULT, "steps": 1e30}}), 1),
        ("steps=true", json.dumps({"result": {**GOOD_RESULT, "steps": True}}), 1),
        ("n_in=str", json.dumps({"result": {**GOOD_RESULT, "n_in": "5"}}), 1),
        ("violation=1", json.dumps({"result": {**GOOD_RESULT, "violation": 1}}), 1),
        ("violation true, no layers", json.dumps({"result": {**GOOD_RESULT, "violation": True}}), 1),
        ("OK but layers violate", json.dumps({"result": {**GOOD_RESULT, "violating_layers": ["fc"]}}), 1),
        ("delta=2", json.dumps({"result": {**GOOD_RESULT, "delta": 2}}), 1),
        ("confidence=-1", json.dumps({"result": {**GOOD_RESULT, "confidence": -1}}), 1),
        ("no observations but OK", json.dumps({"result": {**GOOD_RESULT, "n_in": 0, "n_out": 0}}), 0),
        ("missing delta", json.dumps({"result": {k: v for k, v in GOOD_RESULT.items() if k != "delta"}}), 1),
        ("truncated", json.dumps({"result": GOOD_RESULT})[:40], 1),
        ("utf16", json.dumps({"result": GOOD_RESULT}).encode("utf-16"), 1),
        ("deep nesting", "[" * 100000 + "]" * 100000, 1),
        ("huge number", '{"result": {"steps": 1' + "0" * 5000 + "}}", 1),
        ("final_model=list", json.dumps({"result": GOOD_RESULT, "final_model": [1]}), 1),
        ("layers=dict", json.dumps({"result": {**GOOD_RESULT, "layers": {"a": 1}}}), 1),
        ("good", json.dumps({"result": GOOD_RESULT}), 0),
        ("good violation", json.dumps({"result": {**GOOD_RESULT, "violation": True, "violating_layers": ["pooled"],
                                                  "first_violation_step": 3}}), 3),
    ]
    cases = []
    for label, content, status in damaged:
        expect = REFUSED if status == 1 else HANDLED
        cases.append(Case(f"report/{label}", "reports", expect, _report_case(content, status)))
    return cases


def _report_case(content, status):
    def run():
        import contextlib
        import io

        from lightning_dpaudit.app.cli import main

        root = tempfile.mkdtemp()
        with open(os.path.join(root, "audit_report.json"), "wb") as f:
            f.write(content if isinstance(content, bytes) else content.encode())
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(["report", root])
        except SystemExit as exit_:
            code = exit_.code
        except BaseException as error:  # noqa: BLE001
            return "raw", describe(error)
        lines = err.getvalue().strip().splitlines()
        if status == 1:
            if code == 1 and len(lines) == 1 and "audit_report.json" in lines[0]:
                return "refused", lines[0][-150:]
            if code == 1:
                return "raw", f"exit 1 with {len(lines)} stderr lines: {(lines or [''])[-1][:120]}"
            return "silent-wrong", f"exit {code}: {out.getvalue().strip().splitlines()[0][:80] if out.getvalue() else ''}"
        if code == status:
            head = out.getvalue().strip().splitlines()
            return "handled", f"exit {code}: {(head[1] if len(head) > 1 else '')[:80]}"
        return ("raw" if code == 1 else "silent-wrong"), f"exit {code}, expected {status}: {(lines or [''])[-1][:120]}"
    return run


def cli_cases():
    argvs = [
        (["demo", "--steps", "2", "--canaries", "4"], HANDLED),
        (["demo", "--steps", "2", "--canary", "random", "--canaries", "4"], HANDLED),
        (["demo", "--steps", "2", "--no-audit"], HANDLED),
        (["demo", "--steps", "2", "--canary", "mislabeled", "--canaries", "4"], HANDLED),
        (["demo", "--steps", "2", "--canaries", "4", "--final-model", "20"], HANDLED),
        (["demo", "--steps", "2", "--bug", "no-such"], REFUSED),
        (["demo", "--list-bugs"], HANDLED),
        (["demo", "--steps", "0"], REFUSED), (["demo", "--steps", "x"], REFUSED), (["demo", "--steps", ""], REFUSED),
        (["demo", "--steps", "1e3"], REFUSED), (["demo", "--steps", str(10**30)], REFUSED),
        (["demo", "--canaries", "1"], REFUSED), (["demo", "--canaries", str(10**12)], REFUSED),
        (["demo", "--noise-multiplier", "-1"], REFUSED), (["demo", "--noise-multiplier", "inf"], REFUSED),
        (["demo", "--noise-multiplier", "1e-300", "--steps", "2", "--canaries", "4"], "refused"),  # noise 0 in float32
        (["demo", "--noise-multiplier", "abc"], REFUSED), (["demo", "--seed", "-5"], REFUSED),
        (["demo", "--seed", str(2**70), "--steps", "2", "--canaries", "4"], REFUSED),
        (["demo", "--threads", "0"], REFUSED), (["demo", "--canary", "DIRAC"], REFUSED),
        (["demo", "--final-model", "1"], REFUSED), (["demo", "--final-model", str(10**9)], REFUSED),
        (["demo", "--final-model-kind", "ood"], REFUSED), (["demo", "--no-audit", "--canaries", "4"], REFUSED),
        (["report"], REFUSED), (["report", "/nonexistent/dir"], REFUSED), (["report", "/etc/passwd"], REFUSED),
        (["demo", "--out", "/etc/passwd/x"], REFUSED), (["demo", "--out", "/proc/forbidden"], REFUSED),
        (["--help"], HANDLED), (["demo", "--help"], HANDLED), ([], REFUSED), (["bogus"], REFUSED),
        (["report", "EMPTYDIR"], REFUSED),
    ]
    return [Case(f"cli/{' '.join(a) or '(none)'}"[:70], "cli", e, _cli_case(a, e)) for a, e in argvs]


def _cli_case(argv, expect):
    def run():
        quiet()
        import contextlib
        import io
        import logging

        logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
        from lightning_dpaudit.app.cli import main

        root = tempfile.mkdtemp()
        args = [root if a == "EMPTYDIR" else a for a in argv]
        if args[:1] == ["demo"] and "--out" not in args and "--help" not in args:
            args += ["--out", root, "--no-progress-bar", "--threads", "1"]
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                code = main(args)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException as error:  # noqa: BLE001
            return "raw", describe(error)
        lines = err.getvalue().strip().splitlines()
        if expect == REFUSED:
            if code != 0 and lines and (len(lines) <= 3 or (code == 2 and "error:" in lines[-1])):
                return "refused", f"exit {code}: {lines[-1][:130]}"
            if code != 0:
                return "raw", f"exit {code} with {len(lines)} stderr lines: {(lines or [''])[-1][:120]}"
            return "silent-wrong", f"exit 0: {out.getvalue().strip()[:100]}"
        if code != 0:
            return ("late" if lines and len(lines) <= 3 else "raw"), f"exit {code}: {(lines or [''])[-1][:130]}"
        if "demo" in argv and "--list-bugs" not in argv and "--help" not in argv:
            reports = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f == "audit_report.json"]
            if "--no-audit" in argv:
                return ("handled" if not reports else "silent-wrong"), f"exit 0, {len(reports)} reports"
            if not reports:
                return "silent-wrong", "exit 0 but no audit_report.json"
            report = json.load(open(reports[0]))
            result = report["result"]
            # sigma 1e-300: float32 draws that noise as 0 every step, which the noise-repeat test rightly reports
            zero_noise = "1e-300" in argv and result["violation"] and "noise" in json.dumps(report).lower()
            if result["n_in"] + result["n_out"] == 0 or (result["violation"] and not zero_noise):
                return "silent-wrong", f"report: n_in {result['n_in']}, violation {result['violation']}"
            return "handled", f"exit 0, report: {result['steps']} steps, {result['n_in'] + result['n_out']} obs"
        return "handled", f"exit 0: {out.getvalue().strip().splitlines()[0][:80] if out.getvalue().strip() else ''}"
    return run


# ------------------------------------------------------------------ estimators

def estimator_cases():
    import numpy as np

    from lightning_dpaudit import estimators as est

    def bounded(value):  # a valid number
        ok = isinstance(value, (int, float)) and not math.isnan(value) and value >= 0
        return ok, f"returned {value!r}"

    def estimate_ok(e):
        ok = math.isfinite(e.epsilon) and e.epsilon >= 0
        return ok, f"epsilon {e.epsilon:.3g}, n_in {e.n_in}, n_out {e.n_out}"

    def zero_estimate(e):
        return e.epsilon == 0, f"epsilon {e.epsilon:.3g} from {e.n_in}/{e.n_out} scores"

    def bounds_ok(b):
        ok = all(math.isnan(v.epsilon) or v.epsilon >= 0 for v in b.values())
        return ok, "; ".join(f"{k}={v.epsilon:.3g}" for k, v in b.items())

    rng = np.random.default_rng(0)
    same = rng.normal(size=200)
    calls = [
        # (label, call, names, expected, valid)
        ("elb/empty both", lambda: est.epsilon_lower_bound([], [], delta=1e-5), ["in_scores", "scores", "empty"], HANDLED, zero_estimate),
        ("elb/empty in", lambda: est.epsilon_lower_bound([], [0.1, 0.2], delta=1e-5), ["in_scores", "empty"], HANDLED, zero_estimate),
        ("elb/nan", lambda: est.epsilon_lower_bound([NAN], [0.0], delta=1e-5), ["in_scores"], REFUSED, None),
        ("elb/inf out", lambda: est.epsilon_lower_bound([1.0], [INF], delta=1e-5), ["out_scores"], REFUSED, None),
        ("elb/strings", lambda: est.epsilon_lower_bound(["a"], [0.0], delta=1e-5), ["in_scores"], REFUSED, None),
        ("elb/2-D", lambda: est.epsilon_lower_bound(np.zeros((2, 2)), [0.0], delta=1e-5), ["in_scores"], REFUSED, None),
        ("elb/dict", lambda: est.epsilon_lower_bound({"a": 1}, [0.0], delta=1e-5), ["in_scores"], REFUSED, None),
        ("elb/None", lambda: est.epsilon_lower_bound(None, [0.0], delta=1e-5), ["in_scores"], REFUSED, None),
        ("elb/scalar", lambda: est.epsilon_lower_bound(1.0, 0.0, delta=1e-5), ["in_scores"], HANDLED, estimate_ok),
        ("elb/same distribution", lambda: est.epsilon_lower_bound(same[:100], same[100:], delta=1e-5), ["x"], HANDLED,
         lambda e: (e.epsilon < 0.5, f"epsilon {e.epsilon:.3g}")),
        ("elb/identical scores", lambda: est.epsilon_lower_bound([0.5] * 50, [0.5] * 50, delta=1e-5), ["x"], HANDLED, zero_estimate),
        ("elb/delta=0 gdp", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=0), ["delta"], REFUSED, None),
        ("elb/delta=nan", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=NAN), ["delta"], REFUSED, None),
        ("elb/delta=True", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=True), ["delta"], REFUSED, None),
        ("elb/method=x", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=1e-5, method="x"), ["method"], REFUSED, None),
        ("elb/method=None", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=1e-5, method=None), ["method"], REFUSED, None),
        ("elb/threshold=inf", lambda: est.epsilon_lower_bound([1.0] * 9, [0.0] * 9, delta=1e-5, threshold=INF), ["threshold"], HANDLED, estimate_ok),
        ("elb/threshold=True", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=1e-5, threshold=True), ["threshold"], REFUSED, None),
        ("elb/threshold='0.5'", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=1e-5, threshold="0.5"), ["threshold"], REFUSED, None),
        ("elb/threshold=[0.5]", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=1e-5, threshold=[0.5]), ["threshold"], REFUSED, None),
        ("elb/confidence=0", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=1e-5, confidence=0), ["confidence"], REFUSED, None),
        ("elb/best 10**6", lambda: est.epsilon_lower_bound(rng.normal(1, 1, 10**6), rng.normal(0, 1, 10**6), delta=1e-5, threshold="best"), ["x"], HANDLED, estimate_ok),
        ("elb/bool scores", lambda: est.epsilon_lower_bound([True, False], [False], delta=1e-5), ["in_scores"], HANDLED, estimate_ok),
        ("efc/negative", lambda: est.epsilon_from_counts(-1, 1, 1, 1, delta=1e-5), ["tp"], REFUSED, None),
        ("efc/float", lambda: est.epsilon_from_counts(0.5, 1, 1, 1, delta=1e-5), ["tp"], REFUSED, None),
        ("efc/probabilities", lambda: est.epsilon_from_counts(0.9, 0.1, 0.2, 0.8, delta=1e-5), ["tp"], REFUSED, None),
        ("efc/nan", lambda: est.epsilon_from_counts(NAN, 1, 1, 1, delta=1e-5), ["tp"], REFUSED, None),
        ("efc/all zero", lambda: est.epsilon_from_counts(0, 0, 0, 0, delta=1e-5), ["tp", "counts"], HANDLED,
         lambda e: (e.epsilon == 0, f"epsilon {e.epsilon}")),
        ("efc/huge", lambda: est.epsilon_from_counts(10**15, 0, 0, 10**15, delta=1e-5), ["tp"], HANDLED, estimate_ok),
        ("efc/string", lambda: est.epsilon_from_counts("5", 1, 1, 1, delta=1e-5), ["tp"], REFUSED, None),
        ("efc/array", lambda: est.epsilon_from_counts([5, 6], 1, 1, 1, delta=1e-5), ["tp"], REFUSED, None),
        ("efc/bool", lambda: est.epsilon_from_counts(True, 1, 1, 1, delta=1e-5), ["tp"], REFUSED, None),
        ("efc/katz delta", lambda: est.epsilon_from_counts(5, 1, 1, 5, delta=1e-5, method="katz"), ["katz", "method"], REFUSED, None),
        ("efc/bayes", lambda: est.epsilon_from_counts(50, 10, 10, 50, delta=1e-5, method="epsdelta-bayes"), ["x"], HANDLED, estimate_ok),
        ("mfc/mismatch", lambda: est.mu_from_counts([1, 2], [1, 2, 3], [1, 2], [1, 2]), ["shape"], REFUSED, None),
        ("mfc/empty arrays", lambda: est.mu_from_counts([], [], [], []), ["tp"], HANDLED,
         lambda v: (np.size(v) == 0, f"returned {v!r}")),
        ("mfc/bool arrays", lambda: est.mu_from_counts([True], [False], [True], [False]), ["tp"], REFUSED, None),
        ("mfc/nan", lambda: est.mu_from_counts([NAN], [1], [1], [1]), ["tp"], REFUSED, None),
        ("mfc/epsdelta method", lambda: est.mu_from_counts(5, 5, 5, 5, method="epsdelta-cp"), ["method"], REFUSED, None),
        ("mfc/object array", lambda: est.mu_from_counts(np.array([1, "a"], dtype=object), [1, 1], [1, 1], [1, 1]), ["tp"], REFUSED, None),
        ("m2e/negative mu", lambda: est.mu_to_epsilon(-1, 1e-5), ["mu"], REFUSED, None),
        ("m2e/nan mu", lambda: est.mu_to_epsilon(NAN, 1e-5), ["mu"], REFUSED, None),
        ("m2e/inf mu", lambda: est.mu_to_epsilon(INF, 1e-5), ["mu"], HANDLED, lambda v: (v == INF, f"{v}")),
        ("m2e/huge mu", lambda: est.mu_to_epsilon(1e6, 1e-5), ["mu"], HANDLED, bounded),
        ("m2e/delta=0", lambda: est.mu_to_epsilon(1.0, 0), ["delta"], REFUSED, None),
        ("m2e/delta=1", lambda: est.mu_to_epsilon(1.0, 1), ["delta"], REFUSED, None),
        ("m2e/mu str", lambda: est.mu_to_epsilon("1", 1e-5), ["mu"], REFUSED, None),
        ("m2e/tiny delta", lambda: est.mu_to_epsilon(1.0, 1e-300), ["delta"], HANDLED, bounded),
        ("e2m/huge eps", lambda: est.epsilon_to_mu(1e6, 1e-5), ["epsilon"], REFUSED, None),
        ("e2m/nan", lambda: est.epsilon_to_mu(NAN, 1e-5), ["epsilon"], REFUSED, None),
        ("e2m/zero", lambda: est.epsilon_to_mu(0.0, 1e-5), ["epsilon"], HANDLED, bounded),
        ("delta_for/neg eps", lambda: est.delta_for(1.0, -1), ["epsilon"], REFUSED, None),
        ("delta_for/inf eps", lambda: est.delta_for(1.0, INF), ["epsilon"], HANDLED, lambda v: (v == 0, f"{v}")),
        ("cpu/k>n", lambda: est.clopper_pearson_upper(5, 3, 0.95), ["k", "n"], REFUSED, None),
        ("cpu/n=0", lambda: est.clopper_pearson_upper(0, 0, 0.95), ["n"], HANDLED, lambda v: (v == 1.0, f"{v}")),
        ("cpu/level=2", lambda: est.clopper_pearson_upper(1, 3, 2.0), ["level"], REFUSED, None),
        ("cpu/negative", lambda: est.clopper_pearson_upper(-1, 3, 0.95), ["k"], REFUSED, None),
        ("e2e/mu=0", lambda: est.end_to_end_epsilon(0, delta=1e-5, sample_rate=0.1, steps=10), ["mu"], HANDLED, lambda v: (v == 0, f"{v}")),
        ("e2e/mu=inf", lambda: est.end_to_end_epsilon(INF, delta=1e-5, sample_rate=0.1, steps=10), ["mu"], HANDLED, lambda v: (v == INF, f"{v}")),
        ("e2e/steps=0", lambda: est.end_to_end_epsilon(1, delta=1e-5, sample_rate=0.1, steps=0), ["steps"], HANDLED, lambda v: (v == 0, f"{v}")),
        ("e2e/steps=True", lambda: est.end_to_end_epsilon(1, delta=1e-5, sample_rate=0.1, steps=True), ["steps"], REFUSED, None),
        ("e2e/rate=0", lambda: est.end_to_end_epsilon(1, delta=1e-5, sample_rate=0, steps=10), ["sample_rate"], REFUSED, None),
        ("e2e/rate=nan", lambda: est.end_to_end_epsilon(1, delta=1e-5, sample_rate=NAN, steps=10), ["sample_rate"], REFUSED, None),
        ("e2e/history empty", lambda: est.end_to_end_epsilon(1, delta=1e-5, history=[]), ["history"], HANDLED, lambda v: (v == 0, f"{v}")),
        ("e2e/history bad entry", lambda: est.end_to_end_epsilon(1, delta=1e-5, history=[(1.0, 0.1)]), ["history"], REFUSED, None),
        ("e2e/history=str", lambda: est.end_to_end_epsilon(1, delta=1e-5, history="abc"), ["history"], REFUSED, None),
        ("e2e/history=None entries", lambda: est.end_to_end_epsilon(1, delta=1e-5, history=[None]), ["history"], REFUSED, None),
        ("e2e/both", lambda: est.end_to_end_epsilon(1, delta=1e-5, history=[(1, 0.1, 5)], steps=5), ["history"], REFUSED, None),
        ("e2e/gdp acct", lambda: est.end_to_end_epsilon(1, delta=1e-5, sample_rate=0.01, steps=100, accountant="gdp"), ["x"], HANDLED, bounded),
        ("e2e/steps=10**8 rdp", lambda: est.end_to_end_epsilon(0.5, delta=1e-5, sample_rate=0.001, steps=10**8), ["steps"], HANDLED, bounded),
        ("e2e/mu huge rdp", lambda: est.end_to_end_epsilon(1e4, delta=1e-5, sample_rate=0.5, steps=10), ["mu"], HANDLED, bounded),
        ("or/m=0", lambda: est.one_run_epsilon(0, 0, 0), ["num_canaries"], HANDLED, lambda v: (v == 0, f"{v}")),
        ("or/m=10**7", lambda: est.one_run_epsilon(10**7, 1000, 1000), ["num_canaries"], HANDLED, bounded),
        ("or/float counts", lambda: est.one_run_epsilon(100.0, 10.0, 9.0), ["num_canaries"], HANDLED, bounded),
        ("or/probability", lambda: est.one_run_epsilon(100, 10, 0.9), ["num_correct"], REFUSED, None),
        ("or/delta=1", lambda: est.one_run_epsilon(100, 10, 9, delta=1), ["delta"], REFUSED, None),
        ("or/str", lambda: est.one_run_epsilon("100", 10, 9), ["num_canaries"], REFUSED, None),
        ("orp/eps inf", lambda: est.one_run_p_value(INF, num_canaries=10, num_guesses=5, num_correct=5, delta=0), ["epsilon"], HANDLED,
         lambda v: (0 <= v <= 1, f"p={v}")),
        ("orp/eps nan", lambda: est.one_run_p_value(NAN, num_canaries=10, num_guesses=5, num_correct=5, delta=0), ["epsilon"], REFUSED, None),
        ("orf/delta=0", lambda: est.one_run_fdp_epsilon(100, 10, 9, delta=0), ["delta"], REFUSED, None),
        ("orf/delta=nan", lambda: est.one_run_fdp_epsilon(100, 10, 9, delta=NAN), ["delta"], REFUSED, None),
        ("orf/confidence=1", lambda: est.one_run_fdp_epsilon(100, 10, 9, delta=1e-5, confidence=1), ["confidence"], REFUSED, None),
        ("orf/r>m", lambda: est.one_run_fdp_epsilon(10, 20, 9, delta=1e-5), ["num_guesses"], REFUSED, None),
        ("orf/all right", lambda: est.one_run_fdp_epsilon(1000, 100, 100, delta=1e-5), ["x"], HANDLED, bounded),
        ("orb/probabilities", lambda: est.one_run_bounds({"loss": [0.1, 0.2, 0.3]}, [0.2, 0.7, 0.9], delta=1e-5), ["included"], REFUSED, None),
        ("orb/mismatch", lambda: est.one_run_bounds({"loss": [0.1, 0.2]}, [True, False, True], delta=1e-5), ["scores"], REFUSED, None),
        ("orb/empty scores", lambda: est.one_run_bounds({}, [True, False], delta=1e-5), ["scores"], REFUSED, None),
        ("orb/empty included", lambda: est.one_run_bounds({"loss": []}, [], delta=1e-5), ["canaries", "included"], REFUSED, None),
        ("orb/nan score", lambda: est.one_run_bounds({"loss": [NAN, 0.1]}, [True, False], delta=1e-5), ["scores"], REFUSED, None),
        ("orb/scores=list", lambda: est.one_run_bounds([0.1, 0.2], [True, False], delta=1e-5), ["scores"], REFUSED, None),
        ("orb/scores=array", lambda: est.one_run_bounds(np.array([0.1, 0.2]), [True, False], delta=1e-5), ["scores"], REFUSED, None),
        ("orb/selection=x", lambda: est.one_run_bounds({"loss": [0.1, 0.2]}, [True, False], delta=1e-5, selection="x"), ["selection"], REFUSED, None),
        ("orb/seed=-1 split", lambda: est.one_run_bounds({"loss": list(range(10))}, [True, False] * 5, delta=1e-5, selection="split", seed=-1), ["seed"], REFUSED, None),
        ("orb/all included", lambda: est.one_run_bounds({"loss": list(range(10))}, [True] * 10, delta=1e-5), ["x"], HANDLED, bounds_ok),
        ("orb/2-D scores", lambda: est.one_run_bounds({"loss": np.zeros((2, 2))}, [True, False], delta=1e-5), ["scores"], REFUSED, None),
        ("orb/delta=0", lambda: est.one_run_bounds({"loss": list(range(10))}, [True, False] * 5, delta=0), ["delta"], HANDLED, bounds_ok),
        ("orb/random scores", lambda: est.one_run_bounds({"loss": rng.normal(size=1000)}, rng.random(1000) < 0.5, delta=1e-5), ["x"], HANDLED,
         lambda b: (all(v.epsilon < 1.0 or math.isnan(v.epsilon) for v in b.values()), "; ".join(f"{k}={v.epsilon:.3g}" for k, v in b.items()))),
    ]
    return [Case(f"estimator/{label}", "estimators", expect, _estimator_case(call, names, valid))
            for label, call, names, expect, valid in calls]


def _estimator_case(call, names, valid):
    def run():
        return refusal(call, names, valid)
    return run


# ------------------------------------------------------------------ final-model canaries

def final_model_cases():
    import torch

    bad = [
        ("count=0", {"count": 0}, ["count"]), ("count=1", {"count": 1}, ["count"]), ("count=2.5", {"count": 2.5}, ["count"]),
        ("count=True", {"count": True}, ["count"]), ("count=10**7", {"count": 10**7}, ["count"]),
        ("count=nan", {"count": NAN}, ["count"]), ("count='10'", {"count": "10"}, ["count"]),
        ("kind=x", {"kind": "x"}, ["kind"]), ("kind=None", {"kind": None}, ["kind"]), ("kind=dirac", {"kind": "dirac"}, ["kind"]),
        ("seed=-1", {"seed": -1}, ["seed"]), ("seed=1.5", {"seed": 1.5}, ["seed"]), ("example_seed=-1", {"example_seed": -1}, ["example_seed"]),
        ("batch_size=0", {"batch_size": 0}, ["batch_size"]), ("batch_size=None", {"batch_size": None}, ["batch_size"]),
        ("num_classes=1", {"num_classes": 1}, ["num_classes"]), ("num_classes=2.0", {"num_classes": 2.0}, ["num_classes"]),
        ("loss_fn=str", {"loss_fn": "ce"}, ["loss_fn"]),
        ("inputs only", {"inputs": torch.zeros(4, 1, 8, 8)}, ["inputs", "labels"]),
        ("labels only", {"labels": torch.zeros(4, dtype=torch.long)}, ["inputs", "labels"]),
        ("custom len mismatch", {"inputs": torch.zeros(4, 1, 8, 8), "labels": torch.zeros(3, dtype=torch.long)}, ["inputs", "labels"]),
        ("custom labels float", {"inputs": torch.zeros(4, 1, 8, 8), "labels": torch.zeros(4)}, ["labels"]),
        ("custom labels negative", {"inputs": torch.zeros(4, 1, 8, 8), "labels": -torch.ones(4, dtype=torch.long)}, ["labels"]),
        ("custom inputs nan", {"inputs": torch.full((4, 1, 8, 8), NAN), "labels": torch.zeros(4, dtype=torch.long)}, ["inputs"]),
        ("custom inputs list", {"inputs": [[0.0]] * 4, "labels": torch.zeros(4, dtype=torch.long)}, ["inputs"]),
        ("custom one", {"inputs": torch.zeros(1, 1, 8, 8), "labels": torch.zeros(1, dtype=torch.long)}, ["inputs", "len"]),
        ("custom num_classes too small", {"inputs": torch.zeros(4, 1, 8, 8), "labels": torch.tensor([0, 1, 2, 5]), "num_classes": 3}, ["num_classes"]),
        ("crafted no model", {"kind": "crafted"}, ["model", "held_out"]),
        ("mislabeled no held_out", {"kind": "mislabeled"}, ["held_out"]),
        ("held_out=str", {"kind": "mislabeled", "held_out": "x"}, ["held_out"]),
        ("held_out one-class", {"kind": "mislabeled", "held_out": (torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))}, ["held_out", "class"]),
    ]
    cases = [Case(f"final-model/{label}", "final-model canaries", REFUSED, _final_build(options, names))
             for label, options, names in bad]
    wraps = [
        ("wrap list of tuples", "list", HANDLED), ("wrap empty", "empty", REFUSED), ("wrap no labels", "nolabels", REFUSED),
        ("wrap string items", "strings", REFUSED), ("wrap twice", "twice", REFUSED), ("wrap 3-channel", "shape", HANDLED),
        ("wrap constant inputs", "constant", REFUSED), ("wrap one class", "oneclass", REFUSED),
        ("wrap None", "none", REFUSED), ("wrap int labels", "intlabels", HANDLED),
    ]
    for label, how, expect in wraps:
        cases.append(Case(f"final-model/{label}", "final-model canaries", expect, _final_wrap(how)))
    audits = [
        ("audit delta=0", {"delta": 0}, HANDLED), ("audit delta=1", {"delta": 1}, REFUSED),
        ("audit delta=str", {"delta": "1e-5"}, REFUSED), ("audit confidence=1", {"delta": 1e-5, "confidence": 1}, REFUSED),
        ("audit selection=x", {"delta": 1e-5, "selection": "x"}, REFUSED),
        ("audit epoch=-1", {"delta": 1e-5, "epoch": -1}, REFUSED),
        ("audit accountant_epsilon=nan", {"delta": 1e-5, "accountant_epsilon": NAN}, HANDLED),  # nan: not known
        ("audit accountant_epsilon=-1", {"delta": 1e-5, "accountant_epsilon": -1.0}, REFUSED),
        ("audit wrong-width model", {"delta": 1e-5, "_model": "narrow"}, REFUSED),
        ("audit model returns nan", {"delta": 1e-5, "_model": "nan"}, REFUSED),
        ("audit model=None", {"delta": 1e-5, "_model": "none"}, REFUSED),
        ("audit untrained", {"delta": 1e-5}, HANDLED),
        ("record_start twice", {"delta": 1e-5, "_twice": True}, REFUSED),
    ]
    for label, options, expect in audits:
        cases.append(Case(f"final-model/{label}", "final-model canaries", expect, _final_audit(options)))
    cases.append(Case("final-model/load_state_dict junk", "final-model canaries", REFUSED, _final_state()))
    cases.append(Case("final-model/CanaryDataModule(5)", "final-model canaries", REFUSED, _final_datamodule()))
    return cases


def _final_build(options, names):
    def run():
        from lightning_dpaudit import FinalModelCanaries

        return refusal(lambda: FinalModelCanaries(**{"seed": 1, **options}), names)
    return run


def _final_wrap(how):
    def run():
        import torch
        from torch.utils.data import TensorDataset

        from lightning_dpaudit import FinalModelCanaries
        from lightning_dpaudit.integrations.digits import digits_dataset

        data = digits_dataset()
        canaries = FinalModelCanaries(20, "ood", seed=1)
        datasets = {
            "list": [(data[i][0], int(data[i][1])) for i in range(100)],
            "empty": TensorDataset(torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long)),
            "nolabels": TensorDataset(torch.rand(50, 1, 8, 8)),
            "strings": ["a", "b", "c"],
            "shape": TensorDataset(torch.rand(50, 3, 8, 8), torch.randint(10, (50,))),
            "constant": TensorDataset(torch.zeros(50, 1, 8, 8), torch.randint(10, (50,))),
            "oneclass": TensorDataset(torch.rand(50, 1, 8, 8), torch.zeros(50, dtype=torch.long)),
            "none": None,
            "intlabels": [(data[i][0], int(data[i][1])) for i in range(100)],
            "twice": data,
        }
        dataset = datasets[how]
        names = ["dataset", "label", "shape", "input", "class", "range", "empty", "wrap", "item", "num_classes", "ood"]

        def setup():
            wrapped = canaries.wrap(dataset)
            if how == "twice":
                canaries.wrap(wrapped)
            return wrapped

        def check(wrapped, _):
            n = len(wrapped)
            item = wrapped[n - 1]
            expected = len(dataset) + canaries.num_included
            ok = n == expected and tuple(item[0].shape) == tuple(dataset[0][0].shape)
            return ("handled" if ok else "silent-wrong"), f"{n} items (expected {expected})"

        return staged(setup, lambda w: None, check, names)
    return run


def _final_audit(options):
    def run():
        quiet()
        import torch

        from lightning_dpaudit import FinalModelCanaries
        from lightning_dpaudit.integrations.digits import DigitsCNN, digits_dataset

        options_ = dict(options)
        kind = options_.pop("_model", None)
        twice = options_.pop("_twice", False)
        canaries = FinalModelCanaries(50, "ood", seed=1)
        canaries.wrap(digits_dataset())
        torch.manual_seed(0)
        model = DigitsCNN()
        if kind == "narrow":
            model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))
        elif kind == "nan":
            model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
            torch.nn.init.constant_(model[1].weight, NAN)
        elif kind == "none":
            model = None
        names = list(options_) + ["model", "output", "class", "label", "finite", "nan", "record", "start", "already"]

        def setup():
            if twice:
                canaries.record_start(model)
                canaries.record_start(model)
            return canaries.audit(model, **options_)

        def check(result, _):
            bounds = getattr(result, "bounds", {})
            values = {k: getattr(v, "epsilon", v) for k, v in (bounds.items() if isinstance(bounds, dict) else [])}
            ok = all(isinstance(v, float) and (math.isnan(v) or v >= 0) for v in values.values())
            big = [k for k, v in values.items() if isinstance(v, float) and v > 2.0]
            if big:
                return "silent-wrong", f"an untrained model bounds epsilon at {values}"
            return ("handled" if ok else "silent-wrong"), f"bounds {values}"[:150]

        return staged(setup, lambda r: None, check, names)
    return run


def _final_state():
    def run():
        from lightning_dpaudit import FinalModelCanaries

        canaries = FinalModelCanaries(20, "ood", seed=1)
        return refusal(lambda: canaries.load_state_dict({"version": 1, "seed": "x", "count": 20, "kind": "ood",
                                                         "examples_fingerprint": None, "start_losses": [NAN] * 20}),
                       ["seed", "start"])
    return run


def _final_datamodule():
    def run():
        from lightning_dpaudit import CanaryDataModule, FinalModelCanaries

        return refusal(lambda: CanaryDataModule(5, FinalModelCanaries(20, seed=1)), ["datamodule"])
    return run


# ------------------------------------------------------------------ the table and the runner

# ------------------------------------------------------------------ the run's options (data_loader, other_optimizers, training_loss)

def run_option_cases():
    """The options that show the audit the run around the optimizer. Each bad value is refused at attach naming the
    option; each good one runs STEPS steps with the loop's own Opacus loader, the model equal to plain Opacus's, quiet
    unless the value itself shows a mistake of the run (then the finding's code must be the right one)."""
    import numpy as np
    import torch

    def dataset(loader):
        return loader.dataset

    values = [
        # (label, option, make(model, optimizer, loader) -> value, expected, finding code expected or None)
        ("data_loader=a string", "data_loader", lambda m, o, l: "loader", REFUSED, None),
        ("data_loader=a number", "data_loader", lambda m, o, l: 3, REFUSED, None),
        ("data_loader=a tensor", "data_loader", lambda m, o, l: torch.zeros(4, 2), REFUSED, None),
        ("data_loader=a numpy array", "data_loader", lambda m, o, l: np.zeros((4, 2)), REFUSED, None),
        ("data_loader=a dict", "data_loader", lambda m, o, l: {"x": 1}, REFUSED, None),
        ("data_loader=iter(loader)", "data_loader", lambda m, o, l: iter(l), REFUSED, None),
        ("data_loader=a generator", "data_loader", lambda m, o, l: (b for b in l), REFUSED, None),
        ("data_loader=the dataset", "data_loader", lambda m, o, l: dataset(l), REFUSED, None),
        ("data_loader=the optimizer", "data_loader", lambda m, o, l: o, REFUSED, None),
        ("data_loader=the Opacus loader", "data_loader", lambda m, o, l: l, HANDLED, None),
        ("data_loader=a shuffled loader", "data_loader",
         lambda m, o, l: torch.utils.data.DataLoader(dataset(l), batch_size=64, shuffle=True), HANDLED, "sampling"),
        ("data_loader=a sequential loader", "data_loader",
         lambda m, o, l: torch.utils.data.DataLoader(dataset(l), batch_size=64), HANDLED, "sampling"),
        ("data_loader=a list of batches", "data_loader", lambda m, o, l: [next(iter(l))], REFUSED, None),
        ("data_loader=an empty loader", "data_loader",
         lambda m, o, l: torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(0, 1)), batch_size=4),
         HANDLED, "sampling"),
        ("other_optimizers=one optimizer", "other_optimizers",
         lambda m, o, l: torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1), REFUSED, None),
        ("other_optimizers=None", "other_optimizers", lambda m, o, l: None, REFUSED, None),
        ("other_optimizers=a string", "other_optimizers", lambda m, o, l: "adam", REFUSED, None),
        ("other_optimizers=[a string]", "other_optimizers", lambda m, o, l: ["adam"], REFUSED, None),
        ("other_optimizers=a generator", "other_optimizers", lambda m, o, l: (x for x in ()), REFUSED, None),
        ("other_optimizers=[]", "other_optimizers", lambda m, o, l: [], HANDLED, None),
        ("other_optimizers=[the DP optimizer]", "other_optimizers", lambda m, o, l: [o], HANDLED, None),
        ("other_optimizers=[SGD on a separate tensor]", "other_optimizers",
         lambda m, o, l: [torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)], HANDLED, "outside_dp"),
        ("other_optimizers=[SGD on the model]", "other_optimizers",
         lambda m, o, l: [torch.optim.SGD(m.parameters(), lr=0.1)], HANDLED, None),  # the DP optimizer's tensors
        ("training_loss=a string", "training_loss", lambda m, o, l: "cross_entropy", REFUSED, None),
        ("training_loss=a number", "training_loss", lambda m, o, l: 1.0, REFUSED, None),
        ("training_loss=the right loss", "training_loss",
         lambda m, o, l: (lambda batch: torch.nn.functional.cross_entropy(m(batch[0]), batch[1], reduction="sum")),
         HANDLED, None),
        ("training_loss=takes no argument", "training_loss", lambda m, o, l: (lambda: 0.0), HANDLED, None),
        ("training_loss=raises", "training_loss", lambda m, o, l: (lambda batch: 1 / 0), HANDLED, None),
        ("training_loss=returns None", "training_loss", lambda m, o, l: (lambda batch: None), HANDLED, None),
        ("training_loss=returns a vector", "training_loss",
         lambda m, o, l: (lambda batch: torch.nn.functional.cross_entropy(m(batch[0]), batch[1], reduction="none")),
         HANDLED, None),
    ]
    return [Case(f"run-options/{label}", "run options", expect, _run_option_case(option, make, expect, code))
            for label, option, make, expect, code in values]


def _run_option_case(option, make, expect, code):
    def run():
        quiet()
        from lightning_dpaudit import PrivacyAuditor

        reference = plain_params({}, STEPS)

        def setup():
            model, optimizer, loader, _ = private()
            return model, optimizer, loader, PrivacyAuditor(optimizer, seed=1, **{option: make(model, optimizer, loader)})

        def use(ctx):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run_steps(*ctx[:3], STEPS)

        def check(ctx, _):
            auditor, model = ctx[3], ctx[0]
            result = auditor.result()
            codes = sorted({f.code for f in result.findings})
            if code is None:
                cls, how = judge_run(auditor, model, reference, STEPS, [option])
                if cls == "handled" and codes:
                    return "silent-wrong", f"findings {codes} on a correct run: {str(result).splitlines()[0][:80]}"
                return cls, how
            if model_difference(model, reference) > TOL:
                return "silent-wrong", "model differs from plain Opacus's"
            if result.audit_failed is not None:
                return "raw", f"audit_failed: {result.audit_failed[:150]}"
            if code not in codes:
                return "silent-wrong", f"expected finding {code}, got {codes}: {str(result).splitlines()[0][:80]}"
            return "handled", f"finding {code} ({', '.join(codes)}); model == plain"

        return staged(setup, use, check, [option])
    return run


def all_cases():
    cases = []
    for make in (auditor_option_cases, input_cases, attach_cases, schedule_cases, fault_cases, state_cases,
                 callback_cases, report_cases, cli_cases, estimator_cases, final_model_cases, run_option_cases):
        cases.extend(make())
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    return cases


def _child(name, connection):
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    sys.stdout = open(os.devnull, "w")  # summaries the cases print (the callback's at the end of fit)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
        quiet()
        case = next(c for c in all_cases() if c.name == name)
        cls, detail = case.run()
    except MemoryError as error:
        cls, detail = "runaway", describe(error)
    except BaseException as error:  # noqa: BLE001  the case's own code failed: report it as raw
        cls, detail = "raw", f"probe: {describe(error)} {traceback.format_exc().splitlines()[-3][:80]}"
    try:
        connection.send((cls, detail))
    finally:
        connection.close()


def run_case(context, name) -> Tuple[str, str, float]:
    receive, send = context.Pipe(duplex=False)
    start = time.perf_counter()
    process = context.Process(target=_child, args=(name, send))
    process.start()
    send.close()
    outcome = None
    if receive.poll(TIMEOUT):
        try:
            outcome = receive.recv()
        except EOFError:
            outcome = None
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join()
        if outcome is None:
            return "runaway", f"over {TIMEOUT:.0f} s", time.perf_counter() - start
    if outcome is None:
        code = process.exitcode
        return "runaway" if code in (-9, -6) else "raw", f"process died (exit {code})", time.perf_counter() - start
    return outcome[0], outcome[1], time.perf_counter() - start


def main(argv=None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--only", default=None, help="run the cases whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--verbose", action="store_true", help="also print each case's line as it ends")
    args = parser.parse_args(argv)
    cases = [c for c in all_cases() if args.only is None or args.only in c.name]
    if args.list:
        for c in cases:
            print(f"{c.expect:8s} {c.name}")
        print(f"{len(cases)} cases")
        return 0
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "opacus", "pytorch_lightning", "sklearn.datasets", "lightning_dpaudit",
                                    "lightning_dpaudit.engine.auditor", "lightning_dpaudit.integrations.callback"])
    rows, totals = [], {c: 0 for c in CLASSES}
    start = time.perf_counter()
    for i, case in enumerate(cases, 1):
        cls, detail, seconds = run_case(context, case.name)
        rows.append((case, cls, detail, seconds))
        totals[cls] += 1
        if args.verbose:
            print(f"  {case.name[:58]:58s} {case.expect:9s} {cls:13s} {seconds:5.1f}  {detail}", flush=True)
        if i % 25 == 0 or i == len(cases):
            print(f"[{i}/{len(cases)}] {time.perf_counter() - start:.0f} s  " +
                  "  ".join(f"{c}={n}" for c, n in totals.items() if n), flush=True)
    print()
    print(f"{'case':58s} {'expected':9s} {'got':13s} {'s':>5s}  detail")
    for case, cls, detail, seconds in rows:
        mark = "" if cls == case.expect else " *"
        print(f"{case.name[:58]:58s} {case.expect:9s} {cls + mark:13s} {seconds:5.1f}  {detail}")
    print()
    print(f"{len(rows)} cases in {time.perf_counter() - start:.0f} s")
    for c in CLASSES:
        print(f"  {c:13s} {totals[c]:4d}  ({100 * totals[c] / max(1, len(rows)):.1f}%)")
    unexpected = sum(1 for case, cls, _, _ in rows if cls != case.expect)
    print(f"  differing from the expected class: {unexpected}")
    bad = totals["late"] + totals["raw"]
    print(f"  late + raw: {bad} ({100 * bad / max(1, len(rows)):.1f}%); silent-wrong: {totals['silent-wrong']}; "
          f"runaway: {totals['runaway']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
