"""Probe cases: faults inside the audit's step (a part of the audit raising, the alert raising, the accountant raising)."""

from __future__ import annotations

import math
import warnings

from .common import (Case, HANDLED, STEPS, TOL, describe, judge_run, model_difference, plain_params, private, quiet,
                     run_steps)


def fault_cases():
    core = [
        ("kind.plant", lambda a: (a.kind, "plant")),
        ("kind.read", lambda a: (a.kind, "read")),
        ("kind.finish_step", lambda a: (a.kind, "finish_step")),
        ("record.add", lambda a: (a.record, _first_attr(a.record, ("add", "observe", "add_step", "record")))),
        ("path.release", lambda a: (a.path, _first_attr(a.path, ("release", "add_noise", "noised", "step")))),
        ("probe.pool", lambda a: (a.kind.probe, _first_attr(a.kind.probe, ("rows", "canary_rows", "gather", "pool_rows")))),
    ]
    cases = []
    for label, where in core:
        for at_step in (0, 1):
            for error in ("RuntimeError", "MemoryError", "KeyboardInterrupt"):
                if error == "KeyboardInterrupt" and at_step == 0:
                    continue
                cases.append(Case(f"fault/{label}/step{at_step + 1}/{error}", "faults", HANDLED,
                                  _fault_case(where, at_step, error)))
    for check_class, hooks in CHECK_HOOKS:
        for hook in hooks:
            for at_step in ((0,) if hook in ONCE + AT_RESULT else (0, 1)):
                for error in ("RuntimeError", "MemoryError", "KeyboardInterrupt"):
                    if error == "KeyboardInterrupt" and at_step == 0:
                        continue
                    cases.append(Case(f"fault/check {check_class}.{hook}/step{at_step + 1}/{error}", "faults", HANDLED,
                                      _check_fault_case(check_class, hook, at_step, error)))
    cases.append(Case("fault/on_violation raises", "faults", HANDLED, _on_violation_raises()))
    cases.append(Case("fault/accountant get_epsilon raises", "faults", HANDLED, _accountant_raises()))
    return cases


# every default check of a single-process run with its model and loader given, and the hooks it implements
CHECK_HOOKS = [
    ("SamplingCheck", ("attach", "loader", "batch", "step", "status")),
    ("MultiplicityCheck", ("loader", "batch", "step", "status")),
    ("PerSampleCheck", ("attach", "accumulate", "around_step", "status")),
    ("CouplingCheck", ("attach", "batch", "step", "status")),
    ("OutsideDPCheck", ("attach", "batch", "step", "status")),
    ("AccountantCheck", ("attach", "step")),  # a mechanism check: no status line of its own
]
ONCE = ("attach", "loader")  # called once, before the first step
AT_RESULT = ("status",)  # called when the result is read, after training (its fault dated by the last step)


def _first_attr(obj, names):
    for name in names:
        if callable(getattr(obj, name, None)):
            return name
    return names[0]


def _fault_case(where, at_step, error_name):
    """A part of the audit's own step raises from step `at_step` on: the audit fails, says so, and training is plain."""
    def run():
        quiet()
        from lightning_dpaudit import PrivacyAuditor

        reference = plain_params({}, STEPS)
        model, optimizer, loader, _ = private()
        auditor = PrivacyAuditor(optimizer, seed=1)
        target, name = where(auditor)
        if not callable(getattr(target, name, None)):
            return "raw", f"no {type(target).__name__}.{name} to break (the probe is out of date)"
        original, calls = getattr(target, name), {"n": 0}
        setattr(target, name, _faulty(original, lambda: auditor.pipeline.steps >= at_step, error_name, name, calls))
        judged = _train_through_fault(lambda: run_steps(model, optimizer, loader, STEPS), error_name, calls, name)
        setattr(target, name, original)
        if judged is not None:
            return judged
        try:
            return judge_run(auditor, model, reference, STEPS, [name], failure_expected=True)
        except Exception as error:  # noqa: BLE001
            return "raw", f"result() after the fault: {describe(error)}"
    return run


ERRORS = {"RuntimeError": RuntimeError, "MemoryError": MemoryError, "KeyboardInterrupt": KeyboardInterrupt}


def _faulty(original, fires, error_name, name, calls):
    """`original` made to raise `error_name` whenever fires() holds (counted in calls["n"])."""
    def broken(*args, **kwargs):
        if fires():
            calls["n"] += 1
            raise ERRORS[error_name](f"injected fault in {name}")
        return original(*args, **kwargs)
    return broken


def _train_through_fault(train, error_name, calls, name):
    """train() with the fault in place: (class, detail) when that already judges the case, else None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train()
    except KeyboardInterrupt:
        if error_name == "KeyboardInterrupt":
            return "handled", "KeyboardInterrupt passed on to the training loop"
        raise
    except Exception as error:  # noqa: BLE001
        return "raw", f"training or result() stopped by the audit's fault: {describe(error)}"
    if calls["n"] == 0:
        return "raw", f"{name} was not called (the fault was not reached: the probe is out of date)"
    if error_name == "KeyboardInterrupt":
        return "silent-wrong", "KeyboardInterrupt swallowed"
    return None


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


def _check_fault_case(class_name, hook, at_step, error_name):
    """One check's hook raises from step `at_step` on: that check alone is stopped and says so, every other check
    goes on, training is not disturbed (the model equals plain Opacus's) and nothing alarms."""
    def run():
        quiet()
        from lightning_dpaudit import PrivacyAuditor, default_checks

        classes = {type(c).__name__: type(c) for c in default_checks()}
        if class_name not in classes or hook not in vars(classes[class_name]):
            return "raw", (f"the probe's target {class_name}.{hook} is not a default check's hook (the probe is out "
                           "of date)")
        cls = classes[class_name]
        reference = plain_params({}, STEPS)
        model, optimizer, loader, _ = private()
        original, calls, made = vars(cls)[hook], {"n": 0}, {}

        def fires():
            return hook in ONCE + AT_RESULT or ("auditor" in made and made["auditor"].pipeline.steps >= at_step)

        def train():
            made["auditor"] = PrivacyAuditor(optimizer, seed=1, module=model, data_loader=loader)
            run_steps(model, optimizer, loader, STEPS)
            made["result"] = made["auditor"].result()

        setattr(cls, hook, _faulty(original, fires, error_name, f"{class_name}.{hook}", calls))  # before the auditor
        try:  # is made: the runner binds each hook's methods once
            judged = _train_through_fault(train, error_name, calls, f"{class_name}.{hook}")
        finally:
            setattr(cls, hook, original)
        if judged is not None:
            return judged
        auditor, result = made["auditor"], made["result"]
        return _judge_stopped(auditor, result, cls, model, reference)
    return run


def _judge_stopped(auditor, result, cls, model, reference):
    check = next(c for c in auditor.checks.checks if type(c) is cls)
    diff = model_difference(model, reference)
    if diff > TOL:
        return "silent-wrong", f"model differs from plain Opacus's by {diff:.3g}"
    stopped = dict(result.checks_stopped)
    if set(stopped) != {check.name}:
        return "silent-wrong", f"checks stopped {sorted(stopped)}, expected [{check.name!r}] alone"
    if not stopped[check.name].startswith("stopped at step"):
        return "silent-wrong", f"the stopped check's status reads {stopped[check.name][:60]!r}"
    if result.audit_failed is not None:
        return "silent-wrong", f"one check's fault failed the whole audit: {result.audit_failed[:60]}"
    if result.violation:
        return "silent-wrong", f"a violation after a check's fault: {str(result).splitlines()[0][:80]}"
    if check.name not in str(result) or "stopped" not in str(result):
        return "silent-wrong", "the summary does not name the stopped check"
    if result.steps != STEPS or result.n_in + result.n_out == 0:
        return "silent-wrong", f"the canaries stopped too: {result.steps} steps, {result.n_in + result.n_out} obs"
    return "handled", f"{check.name!r} {stopped[check.name][:50]}; the others ran; model == plain"
