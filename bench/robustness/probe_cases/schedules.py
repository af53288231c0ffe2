"""Probe cases: the noise multiplier and the clipping bound changed mid-run."""

from __future__ import annotations

import math
import warnings

from .common import Case, HANDLED, INF, NAN, describe, judge_run, plain_params, private, quiet, run_steps, staged


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
