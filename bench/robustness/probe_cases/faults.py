"""Probe cases: faults inside the audit's step (a part of the audit raising, the alert raising, the accountant raising)."""

from __future__ import annotations

import math
import warnings

from .common import Case, HANDLED, STEPS, describe, judge_run, plain_params, private, quiet, run_steps


def fault_cases():
    targets = [
        ("kind.plant", lambda a: (a.kind, "plant")),
        ("kind.read", lambda a: (a.kind, "read")),
        ("kind.finish_step", lambda a: (a.kind, "finish_step")),
        ("record.add", lambda a: (a.record, _first_attr(a.record, ("add", "observe", "add_step", "record")))),
        ("path.release", lambda a: (a.path, _first_attr(a.path, ("release", "add_noise", "noised", "step")))),
        ("probe.pool", lambda a: (a.kind.probe, _first_attr(a.kind.probe, ("rows", "canary_rows", "gather", "pool_rows")))),
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
