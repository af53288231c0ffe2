"""examples/fsdp_torchrun.py run by torchrun on two CPU processes (gloo), bounded in time."""

import json
import math
from pathlib import Path

from ddp_scenarios import run_bounded

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _torchrun(tmp_path, *args):
    code, text = run_bounded([*TORCHRUN, str(ROOT / "examples" / "fsdp_torchrun.py"), *args], timeout=240, cwd=tmp_path)
    assert code == 0, text[-3000:]
    return text


def test_fsdp_example_audits_every_step_and_reports_once(tmp_path):
    text = _torchrun(tmp_path, "--steps", "8", "--out", "fsdp")
    assert text.count("OK: no leak beyond the claim detected") == 1  # printed by rank 0 only
    assert text.count("audit report:") == 1 and "VIOLATION" not in text
    record = json.loads((tmp_path / "fsdp" / "audit_report.json").read_text())
    result = record["result"]
    assert record["settings"]["world_size"] == 2
    assert result["steps"] == 8 and not result["violation"]
    assert math.isfinite(result["epsilon_lower_bound"]) and result["epsilon_lower_bound"] > 0
    assert result["epsilon_lower_bound"] <= result["epsilon_accountant"]
    assert result["n_in"] > 0 and result["n_in"] == result["n_out"]
    assert (tmp_path / "fsdp" / "audit_report.png").stat().st_size > 0


def test_fsdp_example_flags_a_run_without_noise(tmp_path):
    text = _torchrun(tmp_path, "--steps", "4", "--out", "bug", "--bug", "no-noise")
    assert text.count("VIOLATION: leak beyond the claim") == 1 and "OK: no leak" not in text
    result = json.loads((tmp_path / "bug" / "audit_report.json").read_text())["result"]
    assert result["violation"] and result["steps"] == 4
