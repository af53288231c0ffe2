"""No recorded violation goes unalarmed; an error of the audit's own code never ends or changes training."""

import json
import warnings

import numpy as np
import pytest
import torch
from opacus.optimizers import DPOptimizer
from pytorch_lightning.loggers import TensorBoardLogger

from lightning_dpaudit import DPAuditCallback, PrivacyAuditor, PrivacyViolationError
from lightning_dpaudit.analysis.report import summary_table, write_report
from lightning_dpaudit.analysis.report_reading import ReportError, load_report
from lightning_dpaudit.bugs import inject_bug
from lightning_dpaudit.engine.canaries.gradient import GradientCanaries
from lightning_dpaudit.engine.step.pipeline import AuditFailedWarning
from lightning_dpaudit.engine.state import AuditStateError
from lightning_dpaudit.integrations.digits import make_private_digits, train_steps
from test_callback import Private, _fit
from test_report import fake_result

pytestmark = [pytest.mark.filterwarnings("ignore:.*Full backward hook"), pytest.mark.usefixtures("one_thread")]


def _audited(bug="no-noise", **options):
    """A digits model under a (leaking) DPOptimizer and an auditor; on_violation collects the alarms."""
    model, optimizer, loader, _ = make_private_digits(seed=5)
    if bug:
        inject_bug(optimizer, bug)
    alarms = []
    auditor = PrivacyAuditor(optimizer, seed=0, on_violation=alarms.append, **options)
    return model, optimizer, loader, auditor, alarms


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ------------------------------------------------------------------ no alarm is lost


@pytest.mark.parametrize("alert", ["raise", "warn", "stop", "callable"])
def test_a_violation_after_the_last_check_alerts_at_the_end_of_fit(tmp_path, alert):
    seen = []
    callback = DPAuditCallback(alert=seen.append if alert == "callable" else alert, seed=0)  # checks every 8 steps
    fit = lambda: _fit(tmp_path, steps=7, callback=callback, module=Private(bug="no-noise"))  # noqa: E731
    if alert == "raise":
        with pytest.raises(PrivacyViolationError, match=r"DP AUDIT VIOLATION found at step 7 \(first violating step [1-6]\)"):
            fit()
        assert not hasattr(callback.auditor.optimizer, "_dpaudit_auditor")  # left as it was
    elif alert == "warn":
        with pytest.warns(UserWarning, match="DP AUDIT VIOLATION") as record:
            fit()
        assert sum("DP AUDIT VIOLATION" in str(w.message) for w in record) == 1
    else:
        fit()
    assert callback.alerted and len(seen) == (alert == "callable")
    report = load_report(tmp_path)["result"]  # written whatever the alert does
    assert report["violation"] and report["first_violation_step"] < 7 and report["steps"] == 7
    assert report["detected_step"] == 7  # found at the end of fit's check


def test_the_last_observed_step_checks(tmp_path):
    seen = []
    callback = DPAuditCallback(alert=seen.append, seed=0, report=False, observe_steps=10, check_every=16)
    _fit(tmp_path, steps=14, callback=callback, module=Private(bug="no-noise"))
    assert len(seen) == 1 and seen[0].steps == 10 and seen[0].violation


def test_result_alarms_a_violation_recorded_since_the_last_check():
    model, optimizer, loader, auditor, alarms = _audited(check_every=16)
    train_steps(model, optimizer, loader, 5)
    assert alarms == []
    result = auditor.result()
    assert result.violation and len(alarms) == 1 and alarms[0].violation and alarms[0].steps == 5
    auditor.result()
    train_steps(model, optimizer, loader, 11)  # the check at step 16 alarms no more
    assert len(alarms) == 1


@pytest.mark.parametrize("alerted", ["no", "false", 0, None, np.array([False])])
def test_alerted_must_be_true_or_false(alerted):
    model, optimizer, loader, auditor, _ = _audited(bug=None)
    train_steps(model, optimizer, loader, 2)
    state = auditor.state_dict()
    state["alerted"] = alerted
    with pytest.raises(AuditStateError, match="`alerted`"):
        auditor.load_state_dict(state)
    assert auditor.steps == 2 and not auditor.record.alerted
    state["alerted"] = np.bool_(False)
    auditor.load_state_dict(state)  # numpy's bool is a bool
    callback = DPAuditCallback()
    with pytest.raises(AuditStateError, match="`alerted` is 'no'"):
        callback.load_state_dict({"history": [], "alerted": "no"})
    assert callback._pending_state is None and not callback.alerted


def test_a_resumed_violation_that_was_not_alarmed_alarms_at_the_next_check():
    model, optimizer, loader, first, alarms = _audited(check_every=8)
    train_steps(model, optimizer, loader, 5)
    state = first.state_dict()  # recorded at step 1, alarmed at no check yet
    assert alarms == [] and state["alerted"] is False and state["monitor"]
    first.detach()
    model, optimizer, loader, second, resumed = _audited(check_every=8)
    second.load_state_dict(state)
    train_steps(model, optimizer, loader, 2)
    assert resumed == []
    train_steps(model, optimizer, loader, 1)  # step 8: the next check
    assert len(resumed) == 1 and resumed[0].steps == 8 and resumed[0].first_violation_step == 1
    assert second.state_dict()["alerted"] is True


# ------------------------------------------------------------------ a fault of the audit


def _fail_at(auditor, method, step, error=TypeError):
    """The canary kind's `method` raises at `step` (counted from 1)."""
    original = getattr(auditor.kind, method)

    def broken(*args, **kwargs):
        if auditor.steps == step - 1:
            raise error(f"{method} failed")
        return original(*args, **kwargs)

    setattr(auditor.kind, method, broken)


@pytest.mark.parametrize("method,step", [("plant", 1), ("read", 3)])
def test_a_fault_of_the_audit_leaves_training_as_plain_opacus_makes_it(method, step):
    model, optimizer, loader, _ = make_private_digits(seed=5)
    train_steps(model, optimizer, loader, 6)
    plain, plain_noise = _params(model), optimizer.generator.get_state()

    model, optimizer, loader, auditor, _ = _audited(bug=None)
    _fail_at(auditor, method, step)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        train_steps(model, optimizer, loader, 6)
    failures = [w for w in record if issubclass(w.category, AuditFailedWarning)]
    assert len(failures) == 1 and f"{method} failed" in str(failures[0].message)
    if step == 1:  # nothing audited: the very same training
        assert torch.equal(_params(model), plain)
    else:  # audited steps leave R - K = S + noise, equal to the last bits
        assert torch.allclose(_params(model), plain, rtol=0, atol=1e-6)
    assert torch.equal(optimizer.generator.get_state(), plain_noise)  # one noise draw per step, as without the audit
    assert "add_noise" not in vars(optimizer) and not hasattr(optimizer, "_dpaudit_auditor")  # detached
    result = auditor.result()
    assert result.audit_failed == f"TypeError: {method} failed at step {step}" and result.steps == step - 1
    assert auditor.state_dict()["failed"] == result.audit_failed


def test_an_interrupt_and_the_optimizers_own_error_still_raise():
    model, optimizer, loader, auditor, _ = _audited(bug=None)
    _fail_at(auditor, "plant", 2, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        train_steps(model, optimizer, loader, 3)
    assert optimizer._dpaudit_auditor is auditor and auditor.result().audit_failed is None
    auditor.detach()

    calls = []

    class Failing(DPOptimizer):
        def add_noise(self):
            calls.append(1)
            if len(calls) == 2:
                raise ValueError("the optimizer's own error")
            super().add_noise()

    model, optimizer, loader, _ = make_private_digits(seed=5)
    optimizer.__class__ = Failing
    auditor = PrivacyAuditor(optimizer, seed=0)
    with pytest.raises(ValueError, match="the optimizer's own error"):
        train_steps(model, optimizer, loader, 3)
    assert auditor.result().audit_failed is None and optimizer._dpaudit_auditor is auditor


def test_a_fault_under_the_trainer_is_reported_and_training_completes(tmp_path, monkeypatch):
    read, calls = GradientCanaries.read, []

    def broken(self, planted, view):
        calls.append(1)
        if len(calls) == 3:  # one read per step
            raise RuntimeError("read failed")
        return read(self, planted, view)

    monkeypatch.setattr(GradientCanaries, "read", broken)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callback, logger = DPAuditCallback(seed=0, alert="raise"), TensorBoardLogger(tmp_path, name="tb")
    with pytest.warns(AuditFailedWarning, match="read failed") as record:
        trainer = _fit(tmp_path, steps=6, callback=callback, logger=logger)
    assert trainer.global_step == 6 and sum(issubclass(w.category, AuditFailedWarning) for w in record) == 1
    assert "dpaudit/audit_failed/text_summary" in EventAccumulator(logger.log_dir).Reload().Tags()["tensors"]
    report = load_report(logger.log_dir)["result"]
    assert report["audit_failed"] == "RuntimeError: read failed at step 3" and report["steps"] == 2
    assert not hasattr(callback.auditor.optimizer, "_dpaudit_auditor")


def test_a_fault_in_a_hook_of_the_callback_is_warned_once_and_recorded(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("no such metric")

    monkeypatch.setattr(DPAuditCallback, "_log", broken)
    callback = DPAuditCallback(seed=0, log_every_n_steps=2)
    with pytest.warns(AuditFailedWarning, match="no such metric") as record:
        trainer = _fit(tmp_path, steps=6, callback=callback)
    assert trainer.global_step == 6 and sum(issubclass(w.category, AuditFailedWarning) for w in record) == 1
    failed = load_report(tmp_path)["result"]["audit_failed"]
    assert failed == "on_train_batch_end: KeyError: 'no such metric' at step 2"
    assert callback.auditor.steps == 6  # the audit itself went on


def test_the_report_shows_the_failure_and_refuses_a_malformed_one(tmp_path):
    result = fake_result()
    assert "AUDIT FAILED" not in summary_table({"result": result.to_dict()})
    failed = result.__class__(**{**result.__dict__, "audit_failed": "TypeError: x at step 12"})
    write_report(tmp_path, failed, settings={}, versions={}, history=[], histogram=None,
                 in_values=np.zeros(3), out_values=np.ones(3))
    report = load_report(tmp_path)
    assert report["result"]["audit_failed"] == "TypeError: x at step 12"
    assert summary_table(report).splitlines()[1].startswith("AUDIT FAILED: TypeError: x at step 12")
    report["result"]["audit_failed"] = 3
    (tmp_path / "audit_report.json").write_text(json.dumps(report))
    with pytest.raises(ReportError, match="`audit_failed` is 3"):
        load_report(tmp_path)


def test_a_fault_recording_before_an_exact_check_leaves_training_running():
    """At the exact checks' steps the pending readings are recorded first (a divergence test); a fault there is the
    audit's own: training goes on as plain Opacus makes it."""
    model, optimizer, loader, _ = make_private_digits(seed=5)
    train_steps(model, optimizer, loader, 6)
    plain = _params(model)
    model, optimizer, loader, auditor, _ = _audited(bug=None)
    original, failed = auditor.record.add, []

    def broken(*args, **kwargs):
        if auditor.steps == 1 and not failed:  # the pending readings of step 1, recorded before step 2's exact check
            failed.append(True)
            raise RuntimeError("record failed")
        return original(*args, **kwargs)

    auditor.record.add = broken
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        train_steps(model, optimizer, loader, 6)
    assert [w for w in record if issubclass(w.category, AuditFailedWarning)]
    assert torch.allclose(_params(model), plain, rtol=0, atol=1e-6)
    assert "RuntimeError: record failed" in auditor.result().audit_failed


def test_what_on_violation_raises_at_an_exact_checks_finding_reaches_the_training_loop():
    """A finding of the exact check (the optimizer does not clip) alarms inside the check; the user's exception is
    theirs, not the check's own failure."""

    class Stop(Exception):
        pass

    def stop(result):
        raise Stop("stop training")

    model, optimizer, loader, _ = make_private_digits(seed=0)
    inject_bug(optimizer, "batch-clipping")
    auditor = PrivacyAuditor(optimizer, seed=1, on_violation=stop, check_every=1)
    with pytest.raises(Stop):
        train_steps(model, optimizer, loader, 40)
    assert auditor.per_sample_check.stopped is None and auditor.steps <= 2
