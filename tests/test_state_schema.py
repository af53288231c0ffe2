"""Saved state is checked against the Sections that wrote it (analysis/schema.py) before anything is loaded: a
damaged or foreign auditor or callback state is refused with AuditStateError naming the field, and the auditor
and the callback are left exactly as they were. States written by this version load and the audit goes on."""

import copy
import math
import warnings

import numpy as np
import pytest
import torch
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, Subset

from lightning_dpaudit import AuditStateError, DPAuditCallback, PrivacyAuditor
from lightning_dpaudit.analysis.record import RECORD
from lightning_dpaudit.analysis.schema import Field, Section, StateError
from lightning_dpaudit.engine.state import check_state
from lightning_dpaudit.integrations.digits import digits_dataset, digits_holdout, train_steps
from lightning_dpaudit.integrations.logged_values import _from_checkpoint

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]


def _run(sigma=1.0):
    """Linear(64, 10) on 256 digits, batch 64, make_private with its accountant (seeded)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    loader = DataLoader(Subset(digits_dataset(), range(256)), batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=loader,
        noise_multiplier=sigma, max_grad_norm=1.0, poisson_sampling=False,
    )
    return model, optimizer, loader, engine.accountant


def _train(model, optimizer, loader, steps):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_steps(model, optimizer, loader, steps)


@pytest.fixture(scope="module")
def saved():
    """A state with two claim segments: 2 steps at noise multiplier 1, then 2 at 2."""
    model, optimizer, loader, accountant = _run()
    auditor = PrivacyAuditor(optimizer, seed=1, accountant=accountant)
    _train(model, optimizer, loader, 2)
    optimizer.noise_multiplier = 2.0
    _train(model, optimizer, loader, 2)
    state = auditor.state_dict()
    assert len(state["monitor"]["segments"]) == 1 and state["sampler"]["block"]
    assert [tuple(e) for e in accountant.history] == SAVED_ACCOUNTING
    return state


SAVED_ACCOUNTING = [(1.0, 0.25, 2), (2.0, 0.25, 2)]  # what `saved`'s run composed (batch 64 of 256)


def _resume_accounting(auditor):
    """As a resume does: the accountant comes back with the saved run's history (a state's steps are at most the
    steps its accountant composed)."""
    auditor.accountant.history = list(SAVED_ACCOUNTING)


def _same(a, b) -> bool:
    """Equal states: the same keys, values and arrays (NaN equal to NaN)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=np.asarray(a).dtype.kind == "f")
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _auditor_after_two_steps():
    model, optimizer, loader, accountant = _run()
    auditor = PrivacyAuditor(optimizer, seed=2, accountant=accountant)
    _train(model, optimizer, loader, 2)
    return model, optimizer, loader, auditor


def _set(path, value):
    """A corruption: state[path[0]][path[1]]... = value."""
    def corrupt(state):
        target = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return corrupt


def _edit(path, index, value):
    """A corruption of one element of the array at `path`."""
    def corrupt(state):
        target = state
        for key in path:
            target = target[key]
        target[index] = value
    return corrupt


_DAMAGED = [
    # negative canary positions: in a drawn step, the static canaries, the pool's coordinates
    (_edit(("sampler", "block", 0, 0), (0, 0), -1), r"`sampler.block\[0\]` positions holds -1 at \[0, 0\]; expected finite numbers >= 0"),
    (_set(("sampler", "static"), np.array([[3], [-2]])), r"`sampler.static` holds -2 at \[1, 0\]"),
    (_edit(("pool", 0), 0, -5), r"`pool\[0\]` holds -5 at 0"),
    (_edit(("sampler", "pool", 1), 0, 10), r"`sampler.pool` \[1\] holds coordinates up to 10; tensor 1 has 10 values"),
    (_edit(("sampler", "block", 0, 0), (0, 0), 10**6), r"`sampler.block\[0\]` holds pool position 1000000"),
    # NaN canary weights, and weights that are not unit directions
    (_edit(("sampler", "block", 1, 1), (3, 0), np.nan), r"`sampler.block\[1\]` weights holds nan at \[3, 0\]; expected finite numbers"),
    (_edit(("sampler", "block", 1, 1), (3, 0), 0.5), r"`sampler.block\[1\]` has weights that are not unit directions"),
    (_set(("sampler", "block", 2, 2), np.ones(3, dtype=bool)), r"`sampler.block\[2\]` has positions .* k = \d+ canaries per step"),
    # NaN moments, and histograms that do not count the log's observations
    (_edit(("log", "moments"), (0, 1, 1), np.nan), r"`log.moments` holds nan at \[0, 1, 1\]; expected numbers \(not NaN\)"),
    (_edit(("log", "moments"), (1, 0, 2), -4.0), r"`log.moments` holds a negative sum of squares"),
    (_set(("log", "total"), 3), r"`log.total` is 3, but the histograms count \d+ observations"),
    (_edit(("log", "value"), slice(None), np.nan), None),  # NaN observations are part of the log: this one loads
    # negative counts in a later claim segment (and in the first)
    (lambda s: s["monitor"]["segments"][0]["counts"].update({-1: [-3, 0, 0, 0]}),
     r"monitor.segments\[0\] counts for group -1 are \[-3, 0, 0, 0\]; counts are 4 whole numbers >= 0"),
    (lambda s: s["monitor"]["segments"][0]["counts"].update({7: [0, 0, 0, 0]}), r"`monitor.segments\[0\].counts` has group 7"),
    (lambda s: s["monitor"]["segments"][0]["bounds"].update({-1: float("nan")}), r"`monitor.segments\[0\].bounds\[-1\]` is nan"),
    (lambda s: s["monitor"]["first_violation"].update({0: -1}), r"`monitor.first_violation\[0\]` is -1; expected a whole number >= 0"),
    # inflated claims: the first segment's are the set-up's; segments hold distinct claims
    (lambda s: s["monitor"]["claims"].update({-1: 100.0}), r"`monitor.claims\[-1\]` is 100.0; the set-up claims mu = 1.0"),
    (lambda s: s["monitor"]["claims"].update({1: 1.5}), r"`monitor.claims\[1\]` is 1.5; the set-up claims mu = 1.0"),
    (lambda s: s["monitor"]["claims"].update({-1: 0.5}), r"`monitor.claims\[-1\]` is 0.5; the set-up claims mu = 1.0"),
    (lambda s: s["monitor"]["segments"][0]["claims"].update({-1: 0.0}), r"`monitor.segments\[0\].claims\[-1\]` is 0.0"),
    (lambda s: s["monitor"]["segments"][0]["claims"].update({-1: 1.0, 0: 1.0, 1: 1.0}),
     r"`monitor.segments` holds two segments of the same claims"),
    (_set(("monitor", "current"), 5), r"`monitor.current` is 5, but the state has 2 segments"),
    # the format: removed, or not a format
    (lambda s: s.pop("format"), r"the audit state's `format` is missing, but it holds a set-up record"),
    (_set(("format",), True), r"audit state format True is not one this version reads"),
    (_set(("format",), 1), r"`format` is 1 \(0.1.0\), but it holds a set-up record"),
    # the record's own fields
    (_set(("alerted",), "yes"), r"`alerted` is 'yes'; expected true or false"),
    (_set(("alerted",), 1), r"`alerted` is 1; expected true or false"),
    (_set(("failed",), 3), r"`failed` is 3; expected a string"),
    (_set(("problems",), [["code", "message", -2]]), r"`problems\[0\]` is \['code', 'message', -2\]"),
    (_set(("fingerprints", "bits"), 256), r"`fingerprints.bits` is 256; this audit fingerprints 128 sentinel coordinates"),
    (_set(("fingerprints", "first_repeat"), [3]), r"`fingerprints.first_repeat` is \[3\]; expected \(step, earlier step\)"),
    (_set(("correlation", "n"), -1), r"`correlation.n` is -1"),
]


@pytest.mark.parametrize("corrupt,message", _DAMAGED)
def test_a_damaged_state_is_refused_by_field_and_the_auditor_is_unchanged(saved, corrupt, message):
    state = copy.deepcopy(saved)
    corrupt(state)
    model, optimizer, loader, auditor = _auditor_after_two_steps()
    before = auditor.state_dict()
    if message is None:
        _resume_accounting(auditor)
        auditor.load_state_dict(state)
        assert auditor.steps == saved["steps"]
        return
    with pytest.raises(AuditStateError, match=message):
        auditor.load_state_dict(state)
    assert _same(auditor.state_dict(), before)
    _train(model, optimizer, loader, 1)  # the audit goes on from where it was
    assert auditor.steps == 3 and not auditor.result(accounting=False).violation


def test_a_state_of_this_version_loads_and_the_audit_goes_on(saved):
    model, optimizer, loader, auditor = _auditor_after_two_steps()
    _resume_accounting(auditor)
    auditor.load_state_dict(copy.deepcopy(saved))
    loaded = auditor.state_dict()
    assert saved["monitor"]["current"] == 1 and loaded["monitor"].pop("current") == 0  # the claim the optimizer holds now
    assert _same(loaded, {**saved, "monitor": {k: v for k, v in saved["monitor"].items() if k != "current"}})
    n_in = auditor.result(accounting=False).n_in
    torch.manual_seed(7)  # fresh noise: the saved run drew the global generator's next steps already (a replay is flagged)
    _train(model, optimizer, loader, 2)
    result = auditor.result(accounting=False)
    assert result.steps == saved["steps"] + 2 and result.n_in > n_in


@pytest.mark.parametrize("options", [{"mode": "paired"}, {"canary": "random", "moving": False}])
def test_states_of_other_designs_pass_their_check(options):
    model, optimizer, loader, _ = _run()
    auditor = PrivacyAuditor(optimizer, seed=1, **options)
    _train(model, optimizer, loader, 3)
    state = auditor.state_dict()
    check_state(state, auditor.setup, claims=auditor.record.monitor.opening)
    twin = PrivacyAuditor(_run()[1], seed=2, **options)
    twin.load_state_dict(state)
    assert _same(twin.state_dict(), state)


def test_an_input_canary_state_passes_its_check_and_a_damaged_one_is_refused():
    inputs, labels = digits_holdout(16)
    model, optimizer, loader, _ = _run()
    options = dict(canary="mislabeled", canaries_per_step=8, canary_inputs=inputs, canary_labels=labels)
    auditor = PrivacyAuditor(optimizer, seed=1, module=model, **options)
    _train(model, optimizer, loader, 2)
    state = auditor.state_dict()
    model2, optimizer2, _, _ = _run()
    twin = PrivacyAuditor(optimizer2, seed=2, module=model2, **options)
    twin.load_state_dict(copy.deepcopy(state))
    assert twin.steps == 2
    state["input_canaries"]["y"] = state["input_canaries"]["y"][:3]
    before = twin.state_dict()
    with pytest.raises(AuditStateError, match=r"`input_canaries.x` has inputs \(8, .*\) and labels \(3,\)"):
        twin.load_state_dict(state)
    assert _same(twin.state_dict(), before)


def test_a_section_writes_only_fields_it_has_a_rule_for():
    section = Section("part", Field("count", "int", low=0), Field("note", "str", optional=True))
    assert section.dump({"count": 2}) == {"count": 2}
    with pytest.raises(KeyError, match=r"fields without a rule \['extra'\]"):
        section.dump({"count": 2, "extra": 1})
    with pytest.raises(KeyError, match=r"fields not written \['count'\]"):
        section.dump({"note": "x"})
    with pytest.raises(StateError, match=r"`part.count` is -1; expected a whole number >= 0"):
        section.check({"count": -1}, path="part")
    fields = set(RECORD.names)
    model, optimizer, loader, auditor = _auditor_after_two_steps()
    assert set(auditor.record.state_dict()) == fields  # the record writes exactly its Section's fields


# ------------------------------------------------------------------ the callback's checkpoint state


def _callback_with_auditor(sigma=1.0, steps=2):
    model, optimizer, loader, accountant = _run(sigma)
    callback = DPAuditCallback(report=False)
    callback.auditor = PrivacyAuditor(optimizer, seed=3, accountant=accountant)
    _train(model, optimizer, loader, steps)
    callback.history = [{"step": steps, "eps_lower_bound": 0.5, "eps_accountant": 1.5}]
    return callback


def _callback_snapshot(callback):
    return (copy.deepcopy(callback.history), callback.alerted, callback._pending_state, callback.auditor.state_dict(),
            list(callback.auditor.accountant.history))


def _assert_callback_unchanged(callback, before):
    after = _callback_snapshot(callback)
    assert after[:3] == before[:3] and _same(after[3], before[3]) and after[4] == before[4]


@pytest.fixture(scope="module")
def checkpointed():
    return _callback_with_auditor(steps=3).state_dict()


def test_a_callback_state_of_this_version_restores(checkpointed):
    callback = _callback_with_auditor()
    callback.auditor.accountant.history = []
    callback.load_state_dict(copy.deepcopy(checkpointed))
    assert callback.auditor.steps == 3 and callback.history == checkpointed["history"]
    assert callback.auditor.accountant.history == [tuple(e) for e in checkpointed["accountant_history"]]


@pytest.mark.parametrize("corrupt,message", [
    (_set(("alerted",), "no"), r"the callback state's `alerted` is 'no'; expected true or false"),
    (_set(("alerted",), None), r"`alerted` is None"),
    (_set(("history",), [{"step": -1, "eps_lower_bound": 0.5, "eps_accountant": 1.0}]), r"`history\[0\].step` is -1"),
    (_set(("accountant_history",), [[1.0, 1.5, 4]]), r"`accountant_history\[0\]` is \[1.0, 1.5, 4\]; expected"),
    (_set(("accountant_history",), [[float("nan"), 0.25, 4]]), r"`accountant_history\[0\]` is \[nan, 0.25, 4\]"),
    # an accountant history from another noise multiplier than the optimizer's
    (_set(("accountant_history",), [[2.0, 0.25, 3]]),
     r"`accountant_history` composes noise multipliers \[2.0\], never the optimizer's 1: the saved accounting is another run's"),
    # a claim segment the accounting does not back: noise multiplier 4 was never composed
    (lambda s: s["auditor"]["monitor"]["segments"].append({
        "claims": {-1: 0.25, 0: 0.25, 1: 0.25}, "counts": {-1: [4, 4, 4, 4], 0: [2, 2, 2, 2], 1: [2, 2, 2, 2]},
        "bounds": {-1: 0.0, 0: 0.0, 1: 0.0}, "first_violation": {}}),
     r"`auditor.monitor.segments\[0\].claims\[-1\]` is 0.25 \(noise multiplier 4\), but the saved accountant history "
     r"composes noise multipliers \[1.0\]"),
    (_set(("final_model",), {"canaries": {"version": 1, "seed": -1, "count": 10, "kind": "ood", "examples_fingerprint": None,
                                          "start_losses": None}, "history": []}), r"`final_model.canaries.seed` is -1"),
    (_set(("final_model",), {"canaries": {"version": 1, "seed": 5, "count": 3, "kind": "ood", "examples_fingerprint": None,
                                          "start_losses": [0.5, float("nan"), 1.0]}, "history": []}),
     r"`final_model.canaries.start_losses\[1\]` is nan"),
    # the auditor's part: refused by the auditor, with the callback unchanged too
    (lambda s: s["auditor"]["monitor"]["claims"].update({-1: 50.0}), r"`monitor.claims\[-1\]` is 50.0"),
])
def test_a_damaged_callback_state_is_refused_by_field_and_the_callback_is_unchanged(checkpointed, corrupt, message):
    state = copy.deepcopy(checkpointed)
    corrupt(state)
    callback = _callback_with_auditor()
    callback.auditor.accountant.history = []  # as after a resume: the saved accounting would be restored
    before = _callback_snapshot(callback)
    with pytest.raises(AuditStateError, match=message):
        callback.load_state_dict(state)
    _assert_callback_unchanged(callback, before)


def test_a_callback_state_of_a_run_whose_noise_changed_restores():
    """Noise multiplier 1, then 2: the accounting composes both, the resumed optimizer starts at the set-up's 1."""
    model, optimizer, loader, accountant = _run()
    first = DPAuditCallback(report=False)
    first.auditor = PrivacyAuditor(optimizer, seed=3, accountant=accountant)
    _train(model, optimizer, loader, 2)
    optimizer.noise_multiplier = 2.0
    _train(model, optimizer, loader, 2)
    state = first.state_dict()
    assert [entry[0] for entry in state["accountant_history"]] == [1.0, 2.0]
    callback = _callback_with_auditor()
    callback.auditor.accountant.history = []
    callback.load_state_dict(state)
    assert callback.auditor.steps == 4 and len(callback.auditor.record.monitor.segments) == 2


def test_a_state_loaded_before_fit_start_is_checked_when_it_arrives():
    callback = DPAuditCallback(report=False)
    with pytest.raises(AuditStateError, match=r"`accountant_history\[0\]` is 'x'"):
        callback.load_state_dict({"history": [], "alerted": False, "accountant_history": ["x"]})
    assert callback._pending_state is None and callback.history == [] and not callback.alerted


_LEGACY = "DPAuditCallback{'canary': None, 'mode': None, 'canaries_per_step': None, 'estimator': None}"


def _legacy_state():
    from pathlib import Path

    checkpoint = torch.load(Path(__file__).parent / "data" / "v0_1_checkpoint.ckpt", weights_only=True)
    return checkpoint["callbacks"][_LEGACY]


def test_a_checkpoint_with_two_0_1_0_states_is_refused_instead_of_restarting_the_audit():
    state = _legacy_state()
    other = _LEGACY.replace("'canary': None", "'canary': 'random'")
    callback = DPAuditCallback(report=False)
    with pytest.raises(AuditStateError, match=r"the checkpoint holds 2 audit states of version 0.1.0 .*'canary': 'random'"):
        callback.on_load_checkpoint(None, None, {"callbacks": {_LEGACY: state, other: copy.deepcopy(state)}})
    assert callback._pending_state is None and callback.history == [] and not callback.alerted
    callback.on_load_checkpoint(None, None, {"callbacks": {_LEGACY: state}})  # one of them: resumed as before
    assert _from_checkpoint(callback._pending_state["auditor"])["steps"] == 16
    fresh = DPAuditCallback(report=False)
    fresh.on_load_checkpoint(None, None, {"callbacks": {"DPAuditCallback": {"history": [], "alerted": False}, _LEGACY: state}})
    assert fresh._pending_state is None  # this version's key: Lightning loads it itself
