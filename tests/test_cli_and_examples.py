"""The `dpaudit` command and the examples, run briefly as a user would."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_dpaudit.engine.canaries.gradient_canaries import KINDS
from lightning_dpaudit.app.cli import GRADIENT_CANARIES, INPUT_CANARIES, main
from lightning_dpaudit.app.demo import INPUT_DEMO, DigitsDataModule, demo_plan, held_out_digits
from lightning_dpaudit.engine.canaries.input_canaries import INPUT_KINDS

ROOT = Path(__file__).resolve().parents[1]


def test_list_bugs(capsys):
    assert main(["demo", "--list-bugs"]) == 0
    out = capsys.readouterr().out
    assert "no-noise" in out and "few-seeds" in out


def test_unknown_bug_is_refused(capsys):
    assert main(["demo", "--bug", "gremlins"]) == 2
    assert "--list-bugs" in capsys.readouterr().err


def test_demo_writes_logs_and_report_and_report_command_reads_it(tmp_path, capsys):
    assert main(["demo", "--steps", "30", "--out", str(tmp_path), "--no-progress-bar"]) == 0
    out = capsys.readouterr().out
    assert "OK: no leak beyond the claim detected" in out
    assert "tensorboard --logdir" in out
    run_dir = tmp_path / "demo" / "version_0"
    assert (run_dir / "audit_report.json").exists() and list(run_dir.glob("events.out.tfevents.*"))
    assert main(["report", str(tmp_path)]) == 0
    assert "epsilon (delta=1e-05)" in capsys.readouterr().out


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("canary", [*GRADIENT_CANARIES, *INPUT_CANARIES])
def test_every_demo_canary_ends_with_a_positive_bound(canary, tmp_path, capsys, restore_threads):
    # Few steps for speed; sigma 1 (per-step mu 1) makes the few observations enough for a
    # positive bound. One thread: two on two shared cores wait for each other.
    args = ["demo", "--canary", canary, "--steps", "40", "--noise-multiplier", "1", "--threads", "1",
            "--out", str(tmp_path), "--no-progress-bar"]
    assert main(args) == 0
    assert torch.get_num_threads() == 1
    out = capsys.readouterr().out
    if canary in INPUT_CANARIES:
        assert f"canary {canary!r}: {INPUT_DEMO[canary][0]} per step from the 297 digits held out from training, 40 steps" in out
    else:
        assert f"canary {canary!r}: " in out and "per step, 40 steps" in out
    assert "OK: no leak beyond the claim detected" in out
    result = json.loads((tmp_path / "demo" / "version_0" / "audit_report.json").read_text())["result"]
    assert result["canary"] == canary and result["steps"] == 40
    assert math.isfinite(result["epsilon_lower_bound"]) and result["epsilon_lower_bound"] > 0


def test_demo_plan_defaults_and_held_out_canaries():
    assert (GRADIENT_CANARIES, INPUT_CANARIES) == (KINDS, INPUT_KINDS)
    assert demo_plan("dirac") == {"steps": 600, "canaries_per_step": 1024, "source": None}
    for kind, (count, steps) in INPUT_DEMO.items():
        assert demo_plan(kind)["steps"] == steps and demo_plan(kind)["canaries_per_step"] == count
    assert demo_plan("crafted", steps=7, canaries_per_step=4)["steps"] == 7
    images, labels = held_out_digits(0)
    train = DigitsDataModule(seed=0)
    train.setup()
    seen = {tuple(x.flatten().tolist()) for x, _ in train.train_set}
    assert len(images) == len(labels) == 297 and not any(tuple(x.flatten().tolist()) in seen for x in images)


def test_demo_with_a_bug_shows_the_alert(tmp_path, capsys):
    with pytest.warns(UserWarning, match="DP AUDIT VIOLATION"):
        assert main(["demo", "--steps", "30", "--bug", "no-noise", "--out", str(tmp_path), "--no-progress-bar"]) == 0
    out = capsys.readouterr().out
    assert "VIOLATION" in out and "the audit found a leak" in out


def test_demo_without_audit(tmp_path, capsys):
    assert main(["demo", "--steps", "10", "--no-audit", "--out", str(tmp_path), "--no-progress-bar"]) == 0
    assert not list(tmp_path.rglob("audit_report.json"))


def test_report_command_prints_findings_and_reads_older_reports(tmp_path, capsys):
    import json

    from lightning_dpaudit.analysis.report import write_report
    from lightning_dpaudit.analysis.results import AuditResult, Finding

    result = AuditResult(
        epsilon_lower_bound=30.0, epsilon_accountant=1.4, mu_lower_bound=4.9, mu_lower_bound_anytime=1.5, mu_claimed=1.0,
        violation=True, violating_layers=("pooled",), n_in=512, n_out=512, steps=1, estimator="gdp-cp",
        confidence=0.95, delta=1e-5, epsilon_step_lower_bound=32.0, epsilon_step_claimed=4.38, first_violation_step=1,
        noise_repeats=0, mode="one-run", canary="dirac", layers=(),
        findings=(Finding(code="noise_scale", message="noise std 0.0165 x claimed", first_step=1, measured=0.0165, claimed=1.0),),
    )
    new, old = tmp_path / "new", tmp_path / "old"
    for directory in (new, old):
        write_report(directory, result, settings={}, versions={}, history=[], in_values=[1.0, 0.9], out_values=[0.0, 0.1])
    report = json.loads((old / "audit_report.json").read_text())
    del report["result"]["findings"]  # as written before findings existed
    (old / "audit_report.json").write_text(json.dumps(report))
    assert main(["report", str(new)]) == 3  # a violation: the exit status a CI gate reads
    assert "  - noise_scale: noise std 0.0165 x claimed" in capsys.readouterr().out
    assert main(["report", str(old)]) == 3
    out = capsys.readouterr().out
    assert "VIOLATION" in out and "noise_scale" not in out


def test_report_on_an_empty_directory(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 1
    assert "no audit_report.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    "script,args,expect",
    [
        ("plain_pytorch.py", ["--steps", "40"], "violation: False"),
        ("catch_a_bug.py", ["--steps", "60"], "caught: bug 'mean-sensitivity' leaks more than it claims"),
        ("lightning_opacus.py", ["--steps", "30"], "OK: no leak beyond the claim detected"),
    ],
)
def test_examples_run(script, args, expect, tmp_path):
    extra = ["--out", str(tmp_path)] if script == "lightning_opacus.py" else []
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args, "--threads", "1", *extra],
                          capture_output=True, timeout=600, cwd=tmp_path)  # bytes: text mode would turn \r into \n
    stdout, output = done.stdout.decode(), done.stdout + done.stderr
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert expect in stdout
    assert stdout.startswith("torch threads: 1 (--threads)\n")
    # not a terminal: no progress bar redrawn in place, a few lines at most (lightning_opacus, 30 steps: 4.6 KB;
    # Lightning's bar made it 10 KB)
    assert b"\r" not in output and len(output) < 7_000, len(output)
