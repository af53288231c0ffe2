"""Ghost clipping under DDP and FSDP on two gloo processes (127.0.0.1), each launch bounded in time.

The scenarios run in tests/sharded_scenarios.py. Runs use fixed seeds, so they are
deterministic; "a correct run is quiet" rests on the audit's own guarantee (a false alarm
with probability <= 5% per run at the default confidence).
"""

import pytest

from ddp_scenarios import launch

BUGS = {  # bug: (finding, violation)
    "halved-linear-norms": ("layer", True),
    "unclamped-coefficients": ("clipping_scales_up", False),
    "wrong-noise": ("noise_scale", True),
    "no-noise": ("noise_scale", True),
    "mean-sensitivity": ("noise_scale", True),
    "reused-noise": ("noise_repeats", True),
}
EXACT = ("halved-linear-norms",)  # flagged by the exact checks at their first step (0: the first noised step)
EXACT_CODES = {"per_sample_gradients", "canary_clipping"}  # the replay's and the canaries' clipping compared
OPTIMIZERS = {"ddp": "DistributedDPOptimizerFastGradientClipping", "fsdp": "FSDPOptimizerFastGradientClipping"}


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def job(request, tmp_path_factory):
    mode = request.param
    names = ["correct", *BUGS] + (["noise-on-other-rank"] if mode == "ddp" else [])
    ranks = launch("both", tmp_path_factory.mktemp(mode), script="sharded_scenarios.py", timeout=420, mode=mode,
                   steps=40, names=names, exact_names=["correct", *EXACT])
    return mode, ranks


def test_correct_run_updates_as_unaudited_and_every_rank_agrees(job):
    mode, ranks = job
    first, second = (rank["correct"] for rank in ranks)
    assert first["optimizer"] == OPTIMIZERS[mode]
    assert first["result"] == second["result"]  # the same observations, counts, bounds and findings on every rank
    for rank in (first, second):
        assert rank["max_update_gap"] <= 1e-6  # each rank's update (its shards under FSDP) is the un-audited one
        assert not rank["violation"] and rank["problems"] == []
        assert rank["n_in"] == rank["n_out"] == 40 * rank["canaries_per_step"] // 2
        assert 0.9 < rank["mu_lower_bound"] <= 1.0  # tight and valid
        assert rank["epsilon_lower_bound"] <= rank["epsilon_accountant"]
        assert rank["data_path"].startswith("1 step(s) compared"), rank["data_path"]  # step 1 of 40, every 100


def test_bug_zoo_is_flagged_with_its_finding_on_every_rank(job):
    mode, ranks = job
    first, second = (rank["bugs"] for rank in ranks)
    assert first == second
    assert not first["correct"]["violation"] and first["correct"]["findings"] == []
    for name, (finding, violation) in BUGS.items():
        assert first[name]["violation"] is violation, name
        assert finding in first[name]["findings"], (name, first[name]["findings"])
    if mode == "ddp":
        assert "noise_placement" in first["noise-on-other-rank"]["findings"]


def test_exact_checks_run_on_every_rank_and_flag_ghost_bugs_at_step_one(job):
    """Under FSDP each rank replays its own examples from the gathered tensors (under DDP, from its replica)."""
    mode, ranks = job
    first, second = (rank["exact"] for rank in ranks)
    for rank in (first, second):
        assert not rank["correct"]["violation"] and rank["correct"]["findings"] == []
        assert rank["correct"]["data_path"].startswith("39 step(s) compared"), rank["correct"]["data_path"]
        for name in EXACT:
            assert rank[name]["violation"] and rank[name]["first_violation_step"] == 0, (name, rank[name]["problems"])
            assert EXACT_CODES <= set(rank[name]["findings"]), (name, rank[name]["findings"])


def test_fsdp_pipeline_mistakes_are_flagged_and_mixed_precision_is_declined(tmp_path):
    """Copies of the batch inside the step (rows per record), a module centring over the batch (independence),
    and a mixed-precision policy the exact checks' replay cannot reproduce (said, never alarmed on)."""
    ranks = launch("pipeline", tmp_path, script="sharded_scenarios.py", timeout=300)
    assert ranks[0] == ranks[1]  # every rank records the same findings (multiplicity and coupling: each its own)
    found = ranks[0]
    assert found["copies"]["findings"] == ["multiplicity"] and found["copies"]["first"] == {"multiplicity": 1}
    assert found["copies"]["data_path"].startswith("7 step(s) compared")
    assert found["centred"]["findings"] == ["coupled_examples"] and found["centred"]["first"] == {"coupled_examples": 1}
    assert found["mixed_precision"]["findings"] == []
    assert "mixed-precision policy" in found["mixed_precision"]["data_path"]
    assert ("independence of examples (nothing compared yet: the exact checks replayed nothing: "
            in found["mixed_precision"]["pipeline"]), found["mixed_precision"]["pipeline"]


def test_fsdp_a_rank_whose_exact_check_stopped_still_gathers_with_the_others(tmp_path):
    """The gathers are collectives: a rank leaving them would hang the others at the next checked step."""
    first, second = launch("check_fault", tmp_path, script="sharded_scenarios.py", timeout=240)
    assert first["data_path"].startswith("stopped at step 2: RuntimeError: a fault of the check's own code")
    assert second["data_path"].startswith("4 step(s) compared"), second["data_path"]  # steps 1, 3, 5, 7
    for rank in (first, second):
        assert rank["steps"] == 9 and rank["findings"] == [] and rank["gap"] <= 1e-6


def test_fsdp_ranks_agree_to_skip_a_check_when_one_is_short_of_memory(tmp_path):
    """The gathered model must fit on every rank; one rank short of memory makes every rank decline, together."""
    ranks = launch("short_of_memory", tmp_path, script="sharded_scenarios.py", timeout=240)
    for rank in ranks:
        assert rank["steps"] == 6 and rank["findings"] == []
        assert rank["data_path"].startswith("nothing compared yet (the gathered model"), rank["data_path"]
