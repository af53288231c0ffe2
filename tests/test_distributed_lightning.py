"""DPAuditCallback under Lightning's strategy="ddp" on 2 CPU processes (gloo), each run bounded in time.

Runs tests/lightning_ddp_runs.py (the module of examples/lightning_ddp.py); Lightning
starts the second rank itself. Fixed seeds; a correct run false-alarms with probability
<= 5% at the default confidence, and these seeds are quiet.
"""

import json
from pathlib import Path

from ddp_scenarios import run_bounded

ROOT = Path(__file__).resolve().parents[1]


def run(variant, out, *args, timeout=240):
    """(exit code, output) of a 2-process Lightning run; a hang fails the test at `timeout`."""
    return run_bounded([ROOT / "tests" / "lightning_ddp_runs.py", variant, out, *args], timeout=timeout)


def test_recipe_is_quiet_reports_from_rank_zero_and_resumes(tmp_path):
    code, text = run("recipe", tmp_path, "--steps", "20")
    assert code == 0, text[-3000:]
    assert text.count("OK: no leak beyond the claim detected") == 1  # the summary comes from rank 0 only
    assert "rank 1 finished at step 20" in text and "rank 0 finished at step 20" in text
    code, text = run("recipe", tmp_path, "--steps", "40", "--resume", str(tmp_path / "checkpoints" / "last.ckpt"))
    assert code == 0, text[-3000:]
    reports = sorted(tmp_path.glob("run/version_*/audit_report.json"))
    assert len(reports) == 2  # one per fit, written by rank 0 only
    first, result = (json.loads(r.read_text())["result"] for r in reports)
    assert result["steps"] == 40 and not result["violation"] and result["noise_repeats"] == 0
    assert (result["n_in"], result["n_out"]) == (2 * first["n_in"], 2 * first["n_out"])  # every observation once
    # No violation means the anytime bound stayed at or below the claim. The fixed-sample 95%
    # bound exceeds the claim in up to 5% of correct runs, and this recipe's noise generator
    # takes a fresh seed each run (examples/lightning_ddp.py), so it is only asked to be close.
    assert 0 < result["mu_lower_bound_anytime"] <= result["mu_claimed"]
    assert 0.8 * result["mu_claimed"] < result["mu_lower_bound"]


def test_make_private_on_the_bare_module_raises_on_every_rank_before_training(tmp_path):
    code, text = run("unwrapped", tmp_path, "--alert", "raise")
    assert code != 0
    assert "finished at step" not in text
    for rank in ("[rank0]", "[rank1]"):
        assert any(rank in line and "PrivacyViolationError" in line and "exact checks" in line for line in text.splitlines()), text[-3000:]
    assert "DistributedDPOptimizer" in text  # the message says how to fix it


def test_accountant_sample_rate_of_one_rank_raises_on_every_rank_at_train_start(tmp_path):
    code, text = run("unsharded", tmp_path, "--alert", "raise")
    assert code != 0 and "finished at step" not in text
    for rank in ("[rank0]", "[rank1]"):
        assert any(rank in line and "PrivacyViolationError" in line for line in text.splitlines()), text[-3000:]
    assert "sample rate" in text and "DistributedSampler" in text


def test_alert_raise_and_stop_end_the_job_on_every_rank(tmp_path):
    code, text = run("recipe", tmp_path / "raise", "--steps", "40", "--bug", "no-noise", "--alert", "raise")
    assert code != 0 and "finished at step" not in text
    assert all(any(r in line and "PrivacyViolationError" in line for line in text.splitlines()) for r in ("[rank0]", "[rank1]"))
    code, text = run("recipe", tmp_path / "stop", "--steps", "40", "--bug", "no-noise", "--alert", "stop")
    assert code == 0, text[-3000:]
    assert "rank 0 finished at step 1" in text and "rank 1 finished at step 1" in text


def test_final_model_canaries_are_the_same_on_every_rank(tmp_path):
    """Each process draws its own secret seed; rank 0's is taken by all before the data is read."""
    import re

    code, text = run("recipe", tmp_path, "--steps", "10", "--final-model", "40")
    assert code == 0, text[-3000:]
    lines = dict(re.findall(r"rank (\d) (canaries .*)", text))
    assert set(lines) == {"0", "1"} and lines["0"] == lines["1"], text[-3000:]
    report = json.loads(next(tmp_path.glob("run/version_*/audit_report.json")).read_text())
    assert report["final_model"]["num_canaries"] == 40 and report["final_model"]["step"] == 10
