"""Probe cases: input canaries, their options and the objects given as canary inputs and labels."""

from __future__ import annotations

from .common import (Case, HANDLED, INF, NAN, REFUSED, STEPS, auditor_case, judge_run, needs_model, plain_params,
                     private, quiet, refusal, run_steps, show, staged)


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
        cases.append(Case(f"InputCanaries/{label}={show(list(change.values())[0])}", "input canaries",
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
