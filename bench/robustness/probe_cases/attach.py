"""Probe cases: what PrivacyAuditor is given to audit, and attaching it twice, after detach, to frozen tensors, with a
foreign accountant, under ghost or adaptive clipping."""

from __future__ import annotations

import math

from .common import (Case, HANDLED, INF, NAN, REFUSED, STEPS, TOL, auditor_case, digits_made_private, judge_run,
                     model_difference, plain_params, private, quiet, refusal, run_steps, staged)


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
    # no noise at all is a run the audit can describe: certain, `no_noise`, and trained as plain Opacus trains it
    cases.append(Case("attach/optimizer.noise_multiplier=0.0", "attach targets", HANDLED,
                      auditor_case({}, names=["noise_multiplier"], prepare=_setter("noise_multiplier", 0.0), observed=False,
                                   codes=("no_noise",))))
    for attribute, value in [("noise_multiplier", -1.0), ("noise_multiplier", NAN),
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


def _audited_like_plain(build, words, stage_words):
    """A staged case: the model, optimizer and loader of `build()` trained STEPS steps under a default audit, judged
    against the same run without it (`words`: what the judgement looks for, `stage_words`: what each stage's
    error would name)."""
    from lightning_dpaudit import PrivacyAuditor

    m, o, l = build()
    run_steps(m, o, l, STEPS)
    reference = [p.detach().clone() for p in m.parameters()]

    def setup():
        model, optimizer, loader = build()
        return model, optimizer, loader, PrivacyAuditor(optimizer, seed=1)

    return staged(setup, lambda ctx: run_steps(*ctx[:3], STEPS),
                  lambda ctx, _: judge_run(ctx[3], ctx[0], reference, STEPS, words), stage_words)


def _attach_frozen():
    def run():
        quiet()
        return _audited_like_plain(lambda: digits_made_private(freeze_features=True), ["frozen"], ["requires_grad"])
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
        return _audited_like_plain(
            lambda: digits_made_private(clipping="adaptive", target_unclipped_quantile=0.5, clipbound_learning_rate=0.2,
                                        max_clipbound=10.0, min_clipbound=0.1, unclipped_num_std=5.0),
            ["adaptive"], ["adaptive", "clip"])
    return run
