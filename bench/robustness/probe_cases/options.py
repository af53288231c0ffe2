"""Probe cases: every option of PrivacyAuditor, and the options that show the audit the run around the optimizer
(data_loader, other_optimizers, training_loss)."""

from __future__ import annotations

import warnings

from .common import (Case, HANDLED, INF, NAN, REFUSED, STEPS, TOL, auditor_case, judge_run, model_difference,
                     plain_params, private, quiet, run_steps, show, staged)


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
        label = f"auditor/{name}={show(value)}" + ("".join(f",{k}={show(v)}" for k, v in extra.items()))
        while label in seen:
            label += "'"
        seen.add(label)
        observed = not (name == "canary_scale" and isinstance(value, float) and value < 1e-3)
        cases.append(Case(label, "auditor options", expect,
                          auditor_case({name: value, **extra}, names=[name], observed=observed)))
    return cases


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
