"""The FSDP examples on two CPU processes (gloo): examples/fsdp_torchrun.py under torchrun and
examples/lightning_fsdp.py, whose Trainer starts its second process itself; each run bounded in time."""

import json
import math
import re
from pathlib import Path

from ddp_scenarios import run_bounded

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
PARAMETERS = 6788  # TokenClassifier's


def _run(tmp_path, *args):
    code, text = run_bounded(args, timeout=240, cwd=tmp_path)
    assert code == 0, text[-3000:]
    return text


def _torchrun(tmp_path, *args):
    return _run(tmp_path, *TORCHRUN, ROOT / "examples" / "fsdp_torchrun.py", *args)


def _lightning(tmp_path, *args):
    return _run(tmp_path, ROOT / "examples" / "lightning_fsdp.py", *args)


def _check_sharded(text):
    """Rank 0 holds about half of every tensor: the model really is sharded over the two ranks."""
    (line,) = re.findall(r"sharded: rank 0 holds ([\d,]+) of ([\d,]+) parameters \((\w+)\)", text)
    local, total, optimizer = int(line[0].replace(",", "")), int(line[1].replace(",", "")), line[2]
    assert total == PARAMETERS and abs(local - total / 2) <= 64, line
    assert optimizer == "FSDPOptimizerFastGradientClipping"


def _check_quiet(text, report, steps):
    assert text.count("OK: no leak beyond the claim detected") == 1  # printed by rank 0 only
    assert "VIOLATION" not in text
    result = json.loads(report.read_text())["result"]
    assert result["steps"] == steps and not result["violation"]
    assert math.isfinite(result["epsilon_lower_bound"]) and result["epsilon_lower_bound"] > 0
    assert result["epsilon_lower_bound"] <= result["epsilon_accountant"]
    assert result["n_in"] > 0 and result["n_in"] == result["n_out"]
    assert report.with_suffix(".png").stat().st_size > 0


def _check_flagged(text, report, steps):
    assert text.count("VIOLATION: leak beyond the claim") == 1 and "OK: no leak" not in text
    result = json.loads(report.read_text())["result"]
    assert result["violation"] and result["steps"] == steps


def test_fsdp_torchrun_example_audits_every_step_and_reports_once(tmp_path):
    text = _torchrun(tmp_path, "--steps", "8", "--out", "fsdp")
    _check_sharded(text)
    _check_quiet(text, tmp_path / "fsdp" / "audit_report.json", 8)
    assert text.count("audit report:") == 1
    assert json.loads((tmp_path / "fsdp" / "audit_report.json").read_text())["settings"]["world_size"] == 2


def test_fsdp_torchrun_example_flags_a_run_without_noise(tmp_path):
    text = _torchrun(tmp_path, "--steps", "4", "--out", "bug", "--bug", "no-noise")
    _check_flagged(text, tmp_path / "bug" / "audit_report.json", 4)


def test_lightning_fsdp_example_audits_every_step_and_reports_once(tmp_path):
    text = _lightning(tmp_path, "--steps", "8", "--out", "runs")
    _check_sharded(text)
    (report,) = (tmp_path / "runs").glob("lightning_fsdp/version_*/audit_report.json")
    _check_quiet(text, report, 8)


def test_lightning_fsdp_example_flags_a_run_without_noise(tmp_path):
    text = _lightning(tmp_path, "--steps", "4", "--out", "runs", "--bug", "no-noise")
    (report,) = (tmp_path / "runs").glob("lightning_fsdp/version_*/audit_report.json")
    _check_flagged(text, report, 4)
