"""Saved state complete and bounded: a state of this format lacking a part it always holds is refused by name (not
read as a 0.1.0 state); sizes are checked against the format's bounds before any entry is read, so a damaged
state of any size is refused, or a large good one loaded, at once; and what a damaged checkpoint holds in place
of an array, a noise generator's state or a name is refused with a message naming it, not a raw error."""

import copy
import time

import numpy as np
import pytest
import torch

from lightning_dpaudit import AuditStateError
from lightning_dpaudit.analysis.claim_segments import MAX_SEGMENTS
from lightning_dpaudit.analysis.observations import MAX_WINDOW
from lightning_dpaudit.analysis.record import MAX_PROBLEMS
from lightning_dpaudit.integrations import callback_state
from lightning_dpaudit.integrations.callback_state import MAX_HISTORY
from lightning_dpaudit.integrations.opacus_history import historical_bug
from test_state_schema import (_assert_callback_unchanged, _auditor_after_two_steps, _callback_snapshot,
                               _callback_with_auditor, _resume_accounting, _same, saved)  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]

# Generous: each of these states is refused or loaded in well under a second; a check per entry took tens of seconds.
SECONDS = 2.0


@pytest.fixture(scope="module")
def checkpointed():
    return _callback_with_auditor(steps=3).state_dict()


def _refused(state, message):
    """The state is refused with `message` within SECONDS, and the auditor is left as it was."""
    model, optimizer, loader, auditor = _auditor_after_two_steps()
    before = auditor.state_dict()
    start = time.perf_counter()
    with pytest.raises(AuditStateError, match=message):
        auditor.load_state_dict(state)
    seconds = time.perf_counter() - start
    assert _same(auditor.state_dict(), before)
    return seconds


# ------------------------------------------------------------------ a state of this format holds every part


@pytest.mark.parametrize("part,message", [
    (("log", "counts"), r"`log.counts` is missing; every audit state of format 2 or later holds it"),
    (("log", "moments"), r"`log.moments` is missing; every audit state of format 2 or later holds it"),
    (("log", "total"), r"`log.total` is missing"),
    (("monitor", "claims"), r"`monitor.claims` is missing; every audit state of format 2 or later holds it"),
    (("monitor", "segments"), r"`monitor.segments` is missing"),
    (("sampler", "block"), r"`sampler.block` is missing; every audit state of format 2 or later holds it"),
    (("sampler", "pool"), r"`sampler.pool` is missing"),
    (("fingerprints", "matches"), r"`fingerprints.matches` is missing"),
    (("problems",), r"`problems` is missing; every audit state of format 2 or later holds it"),
    (("correlation",), r"`correlation` is missing"),
])
def test_a_state_of_this_format_missing_a_part_it_always_holds_is_refused_by_name(saved, part, message):
    state = copy.deepcopy(saved)
    target = state
    for key in part[:-1]:
        target = target[key]
    del target[part[-1]]
    _refused(state, message)


# ------------------------------------------------------------------ sizes are bounded before any entry is read


def test_a_million_problems_are_refused_at_once(saved):
    state = copy.deepcopy(saved)
    state["problems"] = [["code", "message", 1]] * 10**6
    seconds = _refused(state, rf"`problems` holds 1,000,000 entries; at most {MAX_PROBLEMS:,} fit the format")
    assert seconds < SECONDS


def test_a_hundred_thousand_claim_segments_are_refused_at_once(saved):
    state = copy.deepcopy(saved)
    segment = state["monitor"]["segments"][0]
    state["monitor"]["segments"] = [
        {**segment, "claims": {group: 0.5 * 1.02 ** -i for group in segment["claims"]}} for i in range(10**5)
    ]
    seconds = _refused(state, rf"`monitor.segments` holds 100,000 entries; at most {MAX_SEGMENTS:,} fit the format")
    assert seconds < SECONDS


def test_more_observation_rows_than_a_window_holds_are_refused_before_they_are_read(saved):
    state = copy.deepcopy(saved)
    state["log"]["value"] = np.broadcast_to(np.zeros(1), (MAX_WINDOW + 1,))  # a view: no memory
    seconds = _refused(state, rf"`log.value` holds {MAX_WINDOW + 1:,} entries; at most {MAX_WINDOW:,} fit the format")
    assert seconds < SECONDS


def _long_accounting(state, entries):
    """`entries` accountant-history entries composing the saved run's 3 steps, and as many logged epsilons."""
    state["accountant_history"] = [[1.0, 0.25, 1]] * 3 + [[1.0, 0.25, 0]] * (entries - 3)
    state["history"] = [{"step": 3, "eps_lower_bound": 0.5, "eps_accountant": 1.5}] * entries
    return state


def test_a_long_accountant_history_is_checked_once_and_at_once(checkpointed, monkeypatch):
    state = _long_accounting(copy.deepcopy(checkpointed), 300_000)
    callback = _callback_with_auditor()
    callback.auditor.accountant.history = []
    passes = []
    check = callback_state.check_callback_state
    monkeypatch.setattr(callback_state, "check_callback_state", lambda s: passes.append(1) or check(s))
    start = time.perf_counter()
    callback.load_state_dict(state)
    assert time.perf_counter() - start < SECONDS
    assert len(passes) == 1  # one pass over the state on resume
    assert len(callback.auditor.accountant.history) == 300_000 and callback.auditor.steps == 3


@pytest.mark.parametrize("where,value,message", [
    ("accountant_history", [1.0, 1.5, 0], r"`accountant_history\[299999\]` is \[1.0, 1.5, 0\]; expected"),
    ("accountant_history", [1.0, 0.25, True], r"`accountant_history\[299999\]` is \[1.0, 0.25, True\]"),
    ("history", {"step": -1, "eps_lower_bound": 0.5, "eps_accountant": 1.5}, r"`history\[299999\].step` is -1"),
    ("history", {"step": 3, "eps_lower_bound": 0.5, "eps_accountant": -1.0},
     r"`history\[299999\].eps_accountant` is -1.0"),
])
def test_a_long_history_damaged_at_its_end_is_refused_at_once_by_entry(checkpointed, where, value, message):
    state = _long_accounting(copy.deepcopy(checkpointed), 300_000)
    state[where][-1] = value
    callback = _callback_with_auditor()
    callback.auditor.accountant.history = []
    before = _callback_snapshot(callback)
    start = time.perf_counter()
    with pytest.raises(AuditStateError, match=message):
        callback.load_state_dict(state)
    assert time.perf_counter() - start < SECONDS
    _assert_callback_unchanged(callback, before)


def test_histories_beyond_the_bound_are_refused_at_once(checkpointed):
    for where, entry in (("accountant_history", [1.0, 0.25, 0]),
                         ("history", {"step": 3, "eps_lower_bound": 0.5, "eps_accountant": 1.5})):
        state = copy.deepcopy(checkpointed)
        state[where] = [entry] * (MAX_HISTORY + 1)
        callback = _callback_with_auditor()
        start = time.perf_counter()
        with pytest.raises(AuditStateError, match=rf"`{where}` holds {MAX_HISTORY + 1:,} entries; at most {MAX_HISTORY:,}"):
            callback.load_state_dict(state)
        assert time.perf_counter() - start < SECONDS


# ------------------------------------------------------------------ what a damaged checkpoint holds, named


@pytest.mark.parametrize("corrupt,message", [
    (lambda s: s["auditor"]["log"]["counts"].update({"__ndarray__": np.zeros(3)}),
     r"`auditor.log.counts.__ndarray__` is a ndarray; expected a tensor"),
    (lambda s: s["auditor"]["log"].update({"step": np.array(["a", "b"])}),
     r"`auditor.log.step` is a numpy array of <U1; the audit state's arrays hold bools, integers or floats"),
    (lambda s: s["auditor"]["log"]["counts"].update({"dtype": "no-such-dtype"}),
     r"`auditor.log.counts.dtype` is 'no-such-dtype'; expected the name of a numpy bool, integer or float dtype"),
    (lambda s: s["auditor"]["log"]["counts"].update({"dtype": "complex128"}), r"`auditor.log.counts.dtype` is 'complex128'"),
    (lambda s: s.update({"noise_generator": [1, 2, 3]}),
     r"`noise_generator` is a list; expected a torch.Generator's state \(a 1-d torch.uint8 tensor"),
    (lambda s: s.update({"noise_generator": torch.zeros(3)}), r"`noise_generator` is a torch.float32 tensor of shape \(3,\)"),
    (lambda s: s.update({"noise_generator": torch.zeros(3, dtype=torch.uint8)}),
     r"`noise_generator` is not a state of the optimizer's cpu generator"),
    (lambda s: s.update({"history": [{"step": 10**400, "eps_lower_bound": 0.5, "eps_accountant": 1.5}]}),
     r"`history\[0\].step` is .*beyond the float range"),
    (lambda s: s.update({"accountant_history": [[1.0, 0.25, 3], [1.0, 0.25, 10**400]]}), r"`accountant_history\[1\]` is"),
])
def test_what_a_damaged_checkpoint_holds_is_named_not_a_raw_error(checkpointed, corrupt, message):
    state = copy.deepcopy(checkpointed)
    corrupt(state)
    callback = _callback_with_auditor()
    callback.checkpoint_noise_generator = True
    callback.auditor.optimizer.generator = torch.Generator()
    callback.auditor.accountant.history = []
    before = _callback_snapshot(callback)
    with pytest.raises(AuditStateError, match=message):
        callback.load_state_dict(state)
    _assert_callback_unchanged(callback, before)


def test_a_historical_bug_asked_for_by_a_list_is_refused_by_name():
    with pytest.raises(ValueError, match=r"Unexpected value for `name`: \['opacus-751'\] of type list; use one name, "
                                         r"a string, of: .*opacus-751"):
        historical_bug(["opacus-751"])
    assert historical_bug("opacus-751").name == "opacus-751"
