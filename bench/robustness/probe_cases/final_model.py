"""Probe cases: final-model canaries (FinalModelCanaries), their options, wrapping, audit and state."""

from __future__ import annotations

import math

from .common import Case, HANDLED, NAN, REFUSED, quiet, refusal, staged


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
