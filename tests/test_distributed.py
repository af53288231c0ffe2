"""The audit of Opacus's DistributedDPOptimizer on two gloo processes (127.0.0.1), each launch bounded in time.

The scenarios run in tests/ddp_scenarios.py; every launch fails, rather than hangs, if a
rank does not finish within its timeout. All runs use fixed seeds, so they are
deterministic; the statistical statement behind "a correct run is quiet" is the audit's
own: a false alarm with probability <= 5% per run at the default confidence.
"""

import math

import pytest

from ddp_scenarios import launch, run_bounded
from lightning_dpaudit.bugs import BUGS, DISTRIBUTED_BUGS


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    return launch("setups", tmp_path_factory.mktemp("setups"))


def test_correct_run_updates_as_unaudited_and_every_rank_agrees(tmp_path):
    ranks = launch("correct", tmp_path, steps=60)
    first, second = ranks
    assert first["optimizer"] == "DistributedDPOptimizer"
    assert first == second  # the same observations, counts and bounds on every rank
    for rank in ranks:
        assert rank["max_update_gap"] <= 1e-6  # each replica's update is the un-audited one
        assert not rank["violation"] and rank["problems"] == []
        assert rank["n_in"] == rank["n_out"] == 60 * rank["canaries_per_step"] // 2
        # rank 1 adds no noise itself, yet it observes the reduced release: a tight, valid bound there too
        assert 0.85 < rank["mu_lower_bound"] <= 1.0
        assert rank["epsilon_lower_bound"] <= rank["epsilon_accountant"]


def test_a_wrong_per_sample_gradient_on_one_rank_is_named_there_and_alarms_every_rank(tmp_path):
    """The exact per-sample check runs on each rank's own examples (step 1); the finding stays on the rank
    that found it, the alarm reaches every rank at the same check (the one that ends step 1)."""
    first, second = launch("correct", tmp_path, steps=12, wrong_sampler_rank=1)
    assert [p[0] for p in first["problems"]] == ["exact_check_other_rank"]
    assert [p[0] for p in second["problems"]] == ["per_sample_gradients"]
    assert "bias`" in second["problems"][0][1] and "plain autograd" in second["problems"][0][1]
    assert first["violation"] and second["violation"]
    # rank 1 records its finding at step 1; rank 0 learns of it at the check that ends that step
    assert second["first_violation_step"] == 1 and first["first_violation_step"] == 2


def test_per_layer_clipping_under_ddp_is_audited(tmp_path):
    first, second = launch("correct", tmp_path, steps=30, clipping="per_layer")
    assert first == second and first["optimizer"] == "SimpleDistributedPerLayerOptimizer"
    assert first["max_update_gap"] <= 1e-6 and not first["violation"]
    assert 0.3 < first["mu_lower_bound"] <= 0.5  # each tensor's claim: C_l / (sigma * C) = 0.5 / 1.0


def test_ddp_bug_zoo_is_flagged_and_a_correct_run_is_not(tmp_path):
    names = ["correct", *DISTRIBUTED_BUGS, *BUGS]
    found = launch("bugs", tmp_path, names=names, steps=150, timeout=420,
                   bug_options={"reseeded-resume": {"resume_at": 60}})  # a resume inside this short run
    first, second = found
    for name in names:  # identical audits, except where the bug is that the ranks release different gradients
        assert (first[name] == second[name]) == (name != "skipped-reduction"), name
    assert not first["correct"]["violation"]
    missed = [(rank, name) for rank, answers in enumerate(found) for name in names[1:] if not answers[name]["violation"]]
    assert not missed, f"not flagged under DDP: {missed}"
    skipped = [answers["skipped-reduction"] for answers in found]
    assert skipped[0]["first_violation_step"] == skipped[1]["first_violation_step"]  # every rank alerts at one check
    assert [p[0] for p in skipped[0]["problems"]] == ["rank_disagreement"]  # rank 0 holds the noise, rank 1 does not
    assert [p[0] for p in first["noise-on-other-rank"]["problems"]] == ["noise_placement"]
    assert first["noise-over-world-size"]["mu_lower_bound"] > 1.5  # the noise is half the claim: mu near 2
    assert "noise repeats" in first["reused-noise"]["violating"]
    # noise of the right size that is not fresh: negated every second step, or correlated 0.8 with the step before
    assert first["antithetic-noise"]["first_violation_step"] <= 10 and "noise repeats" in first["antithetic-noise"]["violating"]
    assert first["correlated-noise"]["first_violation_step"] <= 50 and first["correlated-noise"]["violating"] == ["noise correlated"]


def test_plain_dp_optimizer_in_a_job_of_two_processes_alarms_at_attach_on_every_rank(setups):
    for rank in setups:
        plain = rank["plain_optimizer"]
        assert plain["optimizer"] == "DPOptimizer"
        assert plain["error"] == "alert" and plain["message"] == ["exact checks"]


def test_replicas_that_drift_apart_are_flagged_at_the_next_checksum(setups):
    for rank in setups:
        drift = rank["drift"]
        assert drift["violation"] and drift["first_violation_step"] == 21
        code, message, step = drift["problems"][0]
        assert code == "replica_drift" and step == 21 and "(module.0.weight)" in message


def test_ranks_that_disagree_about_the_audit_refuse_it_at_attach(setups):
    for rank in setups:
        assert rank["disagreement"] is not None and "disagree about the audit's settings" in rank["disagreement"]


def test_sample_rate_that_ignores_the_world_size_is_flagged(setups):
    for rank in setups:
        answers = rank["sample_rate"]
        assert not answers["sharded"]["violation"]
        code, message, _ = answers["unsharded"]["problems"][0]
        assert code == "sample_rate" and "0.50 x" in message
        assert math.isnan(answers["unsharded"]["epsilon_accountant"])  # nothing trained: the flag came first


def _run_example(args, tmp_path, timeout=240):
    code, text = run_bounded(args, timeout=timeout, cwd=tmp_path)
    assert code == 0, text[-3000:]
    return text


def test_both_examples_run_on_two_processes(tmp_path):
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = _run_example(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                         str(root / "examples" / "ddp_torchrun.py"), "--steps", "10", "--out", "tr"], tmp_path)
    assert text.count("OK: no leak beyond the claim detected") == 1
    result = json.loads((tmp_path / "tr" / "audit_report.json").read_text())["result"]
    assert result["steps"] == 10 and math.isfinite(result["epsilon_lower_bound"]) and result["epsilon_lower_bound"] > 0
    _run_example([str(root / "examples" / "lightning_ddp.py"), "--steps", "10", "--out", "runs"], tmp_path)
    (report,) = (tmp_path / "runs").glob("lightning_ddp/version_*/audit_report.json")
    assert json.loads(report.read_text())["result"]["steps"] == 10


def test_the_distributed_optimizer_the_audit_cannot_read_is_refused_with_the_alternative():
    from opacus.optimizers.ddp_perlayeroptimizer import DistributedPerLayerOptimizer

    from lightning_dpaudit import PrivacyAuditor

    optimizer = DistributedPerLayerOptimizer.__new__(DistributedPerLayerOptimizer)  # the class is what is refused
    with pytest.raises(TypeError, match="backward hooks") as error:
        PrivacyAuditor(optimizer)
    assert "DPDDP" in str(error.value)
