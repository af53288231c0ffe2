"""`dpaudit report DIR` as a CI gate: every report under DIR is read, each prints its path, summary and verdict, and
the command exits with the worst status (3 a violation, 4 a failed audit, 5 a run whose training diverged, 1 a damaged
report, 0 all OK); `--latest`
reads the newest alone. A failed audit fails the test-suite helpers too, and the demo refuses a bug it does not
know (the empty name included) and a noise multiplier whose claim is beyond the float range."""

import json
import os
import re

import pytest

from lightning_dpaudit.app.cli import main
from lightning_dpaudit.integrations import testing
from lightning_dpaudit.integrations.testing import AuditIncomplete, PrivacyAuditFailure, audit_optimizer, train_audited

_OK = {
    "violation": False, "violating_layers": [], "steps": 10, "n_in": 5, "n_out": 5, "epsilon_lower_bound": 0.5,
    "epsilon_accountant": 1.0, "mu_lower_bound": 0.3, "mu_claimed": 1.0, "delta": 1e-5, "confidence": 0.95,
    "first_violation_step": None,
}
_VIOLATION = {**_OK, "violation": True, "violating_layers": ["pooled"], "first_violation_step": 3}
_FAILED = {**_OK, "audit_failed": "TypeError: boom at step 4"}
FAILURE_LINE = "the audit failed: its record is incomplete (TypeError: boom at step 4)"
_DIVERGED = {**_OK, "findings": [{"code": "training_diverged", "message": "training diverged at step 7: a parameter, "
                                  "a gradient or the release is NaN or inf"}]}


def _write(directory, result, mtime=None):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "audit_report.json"
    path.write_text(json.dumps({"result": result}) if isinstance(result, dict) else result)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return directory


def test_a_report_whose_audit_failed_exits_with_its_own_status_and_names_the_failure(tmp_path, capsys):
    _write(tmp_path, _FAILED)
    assert main(["report", str(tmp_path)]) == 4
    out = capsys.readouterr().out
    assert FAILURE_LINE in out.splitlines()


def test_a_report_whose_training_diverged_exits_with_its_own_status_and_says_from_when(tmp_path, capsys):
    """Before: exit 0, the run's OK verdict standing for steps that were never audited."""
    _write(tmp_path, _DIVERGED)
    assert main(["report", str(tmp_path)]) == 5
    out = capsys.readouterr().out
    assert "the audit covers only the steps before training diverged (training diverged at step 7)" in out.splitlines()


def test_a_violation_with_a_failed_audit_keeps_the_violations_status_and_still_names_the_failure(tmp_path, capsys):
    _write(tmp_path, {**_VIOLATION, "audit_failed": "TypeError: boom at step 4"})
    assert main(["report", str(tmp_path)]) == 3
    out = capsys.readouterr().out
    assert "VIOLATION" in out and FAILURE_LINE in out.splitlines()


@pytest.mark.parametrize("runs,status", [
    ({"a": _OK, "b": _OK}, 0),
    ({"a": _OK, "b": "{damaged"}, 1),
    ({"a": "{damaged", "b": _FAILED, "c": _OK}, 4),
    ({"a": _VIOLATION, "b": _FAILED, "c": "{damaged", "d": _OK}, 3),
    ({"a": _FAILED, "b": _VIOLATION}, 3),
    ({"a": _OK, "b": _DIVERGED, "c": "{damaged"}, 5),
    ({"a": _DIVERGED, "b": _FAILED}, 4),
])
def test_every_report_under_the_directory_is_gated_and_the_worst_status_wins(tmp_path, capsys, runs, status):
    """The newest report is the last written (`b`, `c` or `d`): an older bad one still fails the gate."""
    for i, (name, result) in enumerate(sorted(runs.items())):
        _write(tmp_path / "logs" / name / "version_0", result, mtime=1_000_000 + i)
    assert main(["report", str(tmp_path)]) == status
    captured = capsys.readouterr()
    readable = [name for name, result in runs.items() if isinstance(result, dict)]
    for name in readable:
        assert f"audit report in {tmp_path / 'logs' / name / 'version_0'}" in captured.out
    assert len(re.findall(r"^audit report in ", captured.out, flags=re.M)) == len(readable)
    if len(runs) - len(readable):
        assert "dpaudit report:" in captured.err and "not valid JSON" in captured.err
    assert captured.out.rstrip().splitlines()[-1].startswith(f"{len(runs)} reports: ")


def test_latest_gates_the_newest_report_alone(tmp_path, capsys):
    _write(tmp_path / "old", _VIOLATION, mtime=1_000_000)
    _write(tmp_path / "new", _OK, mtime=2_000_000)
    assert main(["report", str(tmp_path)]) == 3  # the older violation fails the gate
    capsys.readouterr()
    assert main(["report", "--latest", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"audit report in {tmp_path / 'new'}" in out and str(tmp_path / "old") not in out


def test_the_report_help_describes_the_gate(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "every audit report" in text and "--latest" in text and "4 when an audit failed" in text


# ------------------------------------------------------------------ the test-suite helpers


class _Result:
    def __init__(self, violation, failed):
        self.violation, self.audit_failed = violation, failed
        self.mu_lower_bound_anytime, self.confidence, self.mu_claimed = 0.1, 0.95, 1.0
        self.epsilon_lower_bound, self.epsilon_accountant = 0.1, 1.0
        self.violating_layers, self.steps, self.first_violation_step, self.findings = (), 4, None, ()
        self.detected_step = None


def _failing_audit(monkeypatch, violation):
    """train_audited's audit as if its own code failed at step 4 (a failure is an error of the audit's code, not of
    the optimizer: it is stood in for here)."""
    class Auditor:
        def __init__(self, optimizer, **options):
            pass

        def result(self):
            return _Result(violation, "TypeError: boom at step 4")

        def detach(self):
            pass

        def observations(self):
            return {}

    monkeypatch.setattr(testing, "PrivacyAuditor", Auditor)


def test_train_audited_raises_when_the_audit_failed(monkeypatch):
    _failing_audit(monkeypatch, violation=False)
    with pytest.raises(AuditIncomplete, match=r"train_audited: the audit failed \(TypeError: boom at step 4\) after 4 "
                                              r"step\(s\): its record is incomplete") as error:
        train_audited(steps=1)
    assert error.value.result.audit_failed == "TypeError: boom at step 4"
    assert isinstance(error.value, PrivacyAuditFailure)


def test_audit_optimizer_raises_when_the_audit_failed_and_a_leak_found_first_stays_a_leak(monkeypatch):
    _failing_audit(monkeypatch, violation=False)
    with pytest.raises(AuditIncomplete, match=r"opacus DPOptimizer: the audit failed \(TypeError: boom at step 4\)"):
        audit_optimizer(steps=1)
    with pytest.raises(AuditIncomplete, match=r"the audit failed"):
        audit_optimizer(steps=1, expect_violation=True)
    _failing_audit(monkeypatch, violation=True)
    with pytest.raises(PrivacyAuditFailure, match=r"leaks more than it claims.*\n  the audit failed afterwards "
                                                  r"\(TypeError: boom at step 4\)") as error:
        audit_optimizer(steps=1)
    assert not isinstance(error.value, AuditIncomplete)


# ------------------------------------------------------------------ the demo's arguments


@pytest.mark.parametrize("bug", ["", "no-such-bug"])
def test_the_demo_refuses_an_empty_or_unknown_bug_with_the_allowed_names(bug, capsys):
    assert main(["demo", "--bug", bug]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"Unexpected value for `--bug`: unknown bug '{bug}'; use one of .*no-noise.*reused-noise", err), err


def test_run_demo_refuses_an_empty_bug_and_a_noise_multiplier_below_the_float_range():
    from lightning_dpaudit.app.demo import run_demo

    with pytest.raises(ValueError, match=r"Unexpected value for `bug`: ''; use None \(no bug\) or one of .*no-noise"):
        run_demo(bug="")
    with pytest.raises(ValueError, match=r"Unexpected value for `noise_multiplier`: 1e-320; use a finite number >= 1e-300"):
        run_demo(noise_multiplier=1e-320)


def test_the_demo_refuses_a_noise_multiplier_whose_claim_is_beyond_the_float_range(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--noise-multiplier", "1e-320"])
    assert exit_.value.code == 2
    assert re.search(r"--noise-multiplier: 1e-320 is below 1e-300: the claimed mu = 1 / 1e-320 is beyond the float "
                     r"range; use a finite number >= 1e-300", capsys.readouterr().err)


def test_the_demo_refuses_a_noise_float32_draws_as_zero_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--noise-multiplier", "1e-300", "--steps", "2"])
    assert exit_.value.code == 2
    assert re.search(r"argument --noise-multiplier: the noise's std noise_multiplier \* max_grad_norm = 1e-300 is below "
                     r"float32's smallest normal number", capsys.readouterr().err)
