"""The `dpaudit` command and the examples, run briefly as a user would."""

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dpaudit.cli import main

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


def test_demo_with_a_bug_shows_the_alert(tmp_path, capsys):
    with pytest.warns(UserWarning, match="DP audit violation"):
        assert main(["demo", "--steps", "30", "--bug", "no-noise", "--out", str(tmp_path), "--no-progress-bar"]) == 0
    out = capsys.readouterr().out
    assert "VIOLATION" in out and "the audit found a leak" in out


def test_demo_without_audit(tmp_path, capsys):
    assert main(["demo", "--steps", "10", "--no-audit", "--out", str(tmp_path), "--no-progress-bar"]) == 0
    assert not list(tmp_path.rglob("audit_report.json"))


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
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args, *extra],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert expect in done.stdout
