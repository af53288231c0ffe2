"""Bad input across the public surface: each is refused before any training step or output, with an
error of the documented type whose message names the value and what is allowed, and the optimizer
is left as it was. The CLI answers with one line on stderr and a non-zero exit status."""

import json
import re

import pytest
import torch

from lightning_dpaudit import DPAuditCallback
from lightning_dpaudit.analysis.report_reading import ReportError, load_report
from lightning_dpaudit.app.cli import main

# ---- the `dpaudit` command


@pytest.mark.parametrize("argv,message", [
    (["demo", "--steps", "0"], r"--steps: 0 is below 1"),
    (["demo", "--steps", "-1"], r"--steps: -1 is below 1"),
    (["demo", "--steps", "2.7"], r"--steps: '2.7' is not an integer"),
    (["demo", "--canaries", "0"], r"--canaries: 0 is below 2"),
    (["demo", "--canaries", "-5"], r"--canaries: -5 is below 2"),
    (["demo", "--threads", "0"], r"--threads: 0 is below 1"),
    (["demo", "--threads", "-2"], r"--threads: -2 is below 1"),
    (["demo", "--seed", "-1"], r"--seed: -1 is below 0"),
    (["demo", "--noise-multiplier", "0"], r"--noise-multiplier: 0 must be a finite number > 0"),
    (["demo", "--noise-multiplier", "nan"], r"--noise-multiplier: nan must be a finite number > 0"),
    (["demo", "--canary", "diracc"], r"--canary: invalid choice: 'diracc'"),
    (["demo", "--bogus"], r"unrecognized arguments: --bogus"),
    (["nothing"], r"invalid choice: 'nothing'"),
    ([], r"the following arguments are required: command"),
])
def test_cli_refuses_bad_arguments_before_training(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code != 0
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_cli_refuses_an_output_path_that_cannot_be_a_directory(tmp_path, capsys):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    for out in (blocker, blocker / "below"):
        with pytest.raises(SystemExit) as exit_:
            main(["demo", "--out", str(out)])
        assert exit_.value.code != 0
        assert f"{blocker} exists and is not a directory" in capsys.readouterr().err


def test_cli_refuses_an_unknown_bug(capsys):
    assert main(["demo", "--bug", "no-such-bug"]) != 0
    assert "unknown bug 'no-such-bug'" in capsys.readouterr().err


_GOOD = {
    "violation": False, "violating_layers": [], "steps": 10, "n_in": 5, "n_out": 5, "epsilon_lower_bound": 0.5,
    "epsilon_accountant": 1.0, "mu_lower_bound": 0.3, "mu_claimed": 1.0, "delta": 1e-5, "confidence": 0.95,
    "first_violation_step": None,
}

_FINAL_MODEL = {
    "accountant_epsilon": 1.0, "num_canaries": 2, "num_included": 1,
    "bounds": {"steinke": {"score": "loss", "correct": 1, "guesses_in": 1, "guesses_out": 0, "epsilon": 0.0}},
}


def _deeply_nested(depth: int) -> list:
    """[[[...[1]...]]]: deeper than numpy's 32 dimensions when depth > 32."""
    value = [1]
    for _ in range(depth - 1):
        value = [value]
    return value


_DAMAGED = [
    ("", r"not valid JSON .* damaged or truncated"),
    ('{"result": {"violation": fal', r"not valid JSON"),
    (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", r"not a text file"),
    ('{"name": "x", "version": "1"}', r"no `result` record: not an audit report"),
    ("[1, 2]", r"no `result` record"),
    ('{"result": {"violation": "no", "violating_layers": "pooled"}}', r"the result lacks steps"),
    (json.dumps({"result": {**_GOOD, "violation": "no"}}), r"`violation` is 'no'; expected true or false"),
    (json.dumps({"result": {**_GOOD, "violating_layers": "pooled"}}), r"`violating_layers` is 'pooled'; expected a list"),
    (json.dumps({"result": {**_GOOD, "n_in": -106}}), r"`n_in` is -106; expected a whole number >= 0"),
    (json.dumps({"result": {**_GOOD, "steps": 2.5}}), r"`steps` is 2.5"),
    (json.dumps({"result": {**_GOOD, "epsilon_lower_bound": -3.2}}), r"`epsilon_lower_bound` is -3.2; it cannot be negative"),
    (json.dumps({"result": {**_GOOD, "mu_claimed": "lots"}}), r"`mu_claimed` is 'lots'; expected a number"),
    (json.dumps({"result": {**_GOOD, "first_violation_step": "soon"}}), r"`first_violation_step` is 'soon'"),
    (json.dumps({"result": _GOOD, "final_model": {"bounds": {}}}), r"final-model section has no `bounds` record"),
    (json.dumps({"result": _GOOD, "final_model": {"bounds": {"steinke": {"score": "loss", "correct": -1}}}}),
     r"final-model section bound 'steinke': `correct` is -1"),
    (json.dumps({"result": _GOOD, "final_model": {"bounds": {"steinke": {
        "score": "loss", "correct": 1, "guesses_in": 1, "guesses_out": 0, "epsilon": "big"}}}}),
     r"`epsilon` is 'big'; expected a number >= 0"),
    (json.dumps({"result": {**_GOOD, "notes": "the run was fine"}}), r"`notes` is 'the run was fine'; expected a list"),
    (json.dumps({"result": {**_GOOD, "notes": [3]}}), r"`notes\[0\]` is 3; expected a string"),
    (json.dumps({"result": {**_GOOD, "data_path": ["per-sample gradients"]}}),
     r"`data_path` is \['per-sample gradients'\]; expected a string"),
    (json.dumps({"result": {**_GOOD, "pipeline": 5}}), r"`pipeline` is 5; expected a string"),
    (json.dumps({"result": {**_GOOD, "epsilon_sampling": "small"}}), r"`epsilon_sampling` is 'small'; expected a number"),
    (json.dumps({"result": {**_GOOD, "first_noise_repeat": [3]}}), r"`first_noise_repeat` is \[3\]; expected \[step, the"),
    (json.dumps({"result": {**_GOOD, "findings": [{"code": "x", "message": "y", "first_step": "soon"}]}}),
     r"`findings\[0\].first_step` is 'soon'; expected a whole number"),
    (json.dumps({"result": _GOOD, "final_model": {**_FINAL_MODEL, "accountant_epsilon": "1.2"}}),
     r"the final-model section's `accountant_epsilon` is '1.2'; expected a number"),
    (json.dumps({"result": _GOOD, "final_model": {**_FINAL_MODEL, "num_canaries": "20"}}),
     r"the final-model section's `num_canaries` is '20'; expected a whole number"),
    (json.dumps({"result": _GOOD, "final_model": {**_FINAL_MODEL, "histograms": {"loss": {
        "edges": [0.0, 1.0], "included": [1, 2], "excluded": [1]}}}}),
     r"`histograms\['loss'\].included` holds 2 counts for 2 edges; expected 1, one per bin"),
    (json.dumps({"result": {**_GOOD, "n_in": _deeply_nested(100)}}),
     r"`n_in` is a list \(\[\[\[\[.*\.\.\.\); expected a whole number"),
    (json.dumps({"result": _GOOD, "final_model": {**_FINAL_MODEL, "histograms": {"loss": {
        "edges": [0.0, 1.0], "included": _deeply_nested(40), "excluded": [1]}}}}),
     r"`histograms\['loss'\].included\[0\]` is a list \(\[\[\[\[.*\.\.\.\); expected a whole number"),
]


@pytest.mark.parametrize("content,message", _DAMAGED)
def test_a_damaged_or_foreign_report_is_refused_in_one_line(tmp_path, content, message, capsys):
    path = tmp_path / "audit_report.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ReportError, match=message):
        load_report(tmp_path)
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr()
    assert err.out == "" and len(err.err.strip().splitlines()) == 1 and str(path) in err.err


def test_report_reading_refuses_a_directory_named_like_the_report_and_a_missing_folder(tmp_path, capsys):
    (tmp_path / "audit_report.json").mkdir()
    with pytest.raises(ReportError, match=r"is not a file"):
        load_report(tmp_path)
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_a_good_report_still_reads(tmp_path, capsys):
    (tmp_path / "audit_report.json").write_text(json.dumps({"result": _GOOD}))
    assert main(["report", str(tmp_path)]) == 0
    assert "OK: no leak beyond the claim detected" in capsys.readouterr().out


# ---- DPAuditCallback's options


@pytest.mark.parametrize("options,message", [
    ({"alert": "email"}, r"`alert`: 'email'; use one of warn, raise, stop or a callable"),
    ({"alert": 5}, r"`alert`: 5"),
    ({"alert": lambda: None}, r"`alert` must accept one argument"),
    ({"alert": lambda a, b: None}, r"`alert` must accept one argument"),
    ({"log_every_n_steps": 0}, r"`log_every_n_steps`: 0; use an integer >= 1"),
    ({"log_every_n_steps": 2.5}, r"`log_every_n_steps`: 2.5"),
    ({"log_every_n_steps": True}, r"`log_every_n_steps`: True"),
    ({"logging_budget": 0}, r"`logging_budget`: 0"),
    ({"logging_budget": 1.5}, r"`logging_budget`: 1.5"),
    ({"logging_budget": float("nan")}, r"`logging_budget`: nan"),
    ({"report": "yes"}, r"`report`: 'yes'; use True or False"),
    ({"checkpoint_noise_generator": 1}, r"`checkpoint_noise_generator`: 1"),
    ({"accountant": 5}, r"`accountant`: 5; pass an Opacus accountant"),
    ({"canaries": 32}, r"Unexpected option\(s\) for DPAuditCallback: canaries"),
    ({"optimizer_kwargs": {}}, r"Unexpected option\(s\) for DPAuditCallback: optimizer_kwargs"),
    ({"on_violation": print}, r"Unexpected option\(s\) for DPAuditCallback: on_violation; use `alert`"),
])
def test_callback_options_are_checked_when_it_is_built(options, message):
    with pytest.raises(ValueError, match=message):
        DPAuditCallback(**options)


@pytest.mark.parametrize("optimizer,message", [
    ("sgd", r"`optimizer`: str; pass the Opacus DPOptimizer returned by PrivacyEngine.make_private"),
    (torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), r"`optimizer`: SGD; pass the Opacus DPOptimizer"),
])
def test_callback_refuses_an_optimizer_that_is_not_opacus_when_it_is_built(optimizer, message):
    with pytest.raises(TypeError, match=message):
        DPAuditCallback(optimizer=optimizer)


# ---- PrivacyAuditor options and saved state
# Every option of PrivacyAuditor with values it must refuse at attach (the optimizer left as it
# was), the optimizer's own claim, input canaries' sample and loss, and saved states that are
# foreign, incomplete or damaged (refused before any step, the auditor left as it was).

import copy as _copy

import numpy as _np
import pytest as _pytest
import torch as _torch

from lightning_dpaudit import PrivacyAuditor as _Auditor
from lightning_dpaudit.integrations.digits import digits_holdout as _holdout
from lightning_dpaudit.integrations.digits import make_private_digits as _private
from lightning_dpaudit.integrations.digits import train_steps as _train


def _untouched(optimizer) -> bool:
    return "add_noise" not in vars(optimizer) and not hasattr(optimizer, "_dpaudit_auditor")


_BAD_OPTIONS = [
    ("delta", 0, r"`delta`: 0; use a finite number in \(0.0, 1.0\)"),
    ("delta", 1.0, r"`delta`: 1.0"),
    ("delta", float("nan"), r"`delta`: nan"),
    ("delta", "1e-5", r"`delta`: '1e-5'; use a number"),
    ("confidence", 1.0, r"`confidence`: 1.0"),
    ("confidence", 0, r"`confidence`: 0"),
    ("confidence", "0.95", r"`confidence`: '0.95'"),
    ("confidence", 0.999999, r"`confidence`: 0.999999; use a number in \(0.0, 0.99999\] \(above it the false-alarm budget"),
    ("canary", "diracc", r"`canary`: 'diracc'; valid kinds are dirac, constant, random, mislabeled"),
    ("canary", 5, r"`canary`: 5"),
    ("canaries_per_step", 2.5, r"`canaries_per_step`: 2.5; use an integer >= 2"),
    ("canaries_per_step", 1, r"`canaries_per_step`: 1; use an integer >= 2"),
    ("canaries_per_step", -4, r"`canaries_per_step`: -4"),
    ("canaries_per_step", True, r"`canaries_per_step`: True"),
    ("canaries_per_step", "many", r"`canaries_per_step`: 'many'"),
    ("canaries_per_step", 10**6, r"needs 1000000 coordinates; the optimizer has 9802 parameters"),
    ("mode", "two-run", r"`mode`: 'two-run'; valid modes are one-run, paired"),
    ("estimator", "katz", r"estimator 'katz' bounds pure epsilon-DP"),
    ("estimator", "bogus", r"bogus"),
    ("seed", -1, r"`seed`: -1; use an integer >= 0"),
    ("seed", 1.5, r"`seed`: 1.5"),
    ("canary_scale", 0, r"`canary_scale`: 0"),
    ("canary_scale", float("nan"), r"`canary_scale`: nan"),
    ("canary_scale", float("inf"), r"`canary_scale`: inf"),
    ("canary_scale", "2", r"`canary_scale`: '2'"),
    ("moving", "no", r"`moving`: 'no'; use True or False"),
    ("moving", 1, r"`moving`: 1"),
    ("support", 0, r"`support`: 0; use an integer >= 1"),
    ("support", 2.5, r"`support`: 2.5"),
    ("check_every", 0, r"`check_every`: 0"),
    ("check_every", 2.5, r"`check_every`: 2.5"),
    ("check_every", "often", r"`check_every`: 'often'"),
    ("observe_steps", 0, r"`observe_steps`: 0"),
    ("observe_steps", 2.7, r"`observe_steps`: 2.7"),
    ("observation_window", 0, r"`observation_window`: 0"),
    ("checksum_every", -1, r"`checksum_every`: -1; use an integer >= 0"),
    ("checksum_every", 2.5, r"`checksum_every`: 2.5"),
    ("per_sample_check_every", None, r"`per_sample_check_every`: None; use an integer >= 0"),
    ("per_sample_check_examples", None, r"`per_sample_check_examples`: None; use an integer >= 1"),
    ("on_violation", 5, r"`on_violation`: 5; use a callable"),
    ("on_violation", lambda: None, r"`on_violation` must accept one argument"),
    ("on_violation", lambda a, b: None, r"`on_violation` must accept one argument"),
    ("module", 5, r"`module`: int; pass the torch.nn.Module"),
    ("accountant", 5, r"`accountant`: 5; pass an Opacus accountant"),
    ("accountant", "rdp", r"`accountant`: 'rdp'"),
]


@_pytest.mark.parametrize("name,value,message", _BAD_OPTIONS, ids=[f"{n}={getattr(v, '__name__', None) or repr(v)}" if callable(v) else f"{n}={v!r}" for n, v, _ in _BAD_OPTIONS])
def test_auditor_option_refused_at_attach(name, value, message):
    _, optimizer, _, _ = _private(seed=0)
    with _pytest.raises(ValueError, match=message):
        _Auditor(optimizer, **{name: value})
    assert _untouched(optimizer)


def test_auditor_refuses_an_optimizer_that_is_not_opacus():
    model = _torch.nn.Linear(4, 2)
    with _pytest.raises(TypeError, match=r"needs an Opacus DPOptimizer, got SGD"):
        _Auditor(_torch.optim.SGD(model.parameters(), lr=0.1))


@_pytest.mark.parametrize("attribute,value,message", [
    ("noise_multiplier", -1.0, r"noise_multiplier: -1.0; it must be a finite number > 0, or 0 \(no noise"),
    ("noise_multiplier", float("nan"), r"noise_multiplier: nan"),
    ("max_grad_norm", 0.0, r"max_grad_norm: 0.0; clipping needs a finite bound > 0"),
    ("max_grad_norm", float("inf"), r"max_grad_norm: inf"),
])
def test_auditor_refuses_an_optimizer_without_a_claim(attribute, value, message):
    _, optimizer, _, _ = _private(seed=0)
    setattr(optimizer, attribute, value)
    with _pytest.raises(ValueError, match=message):
        _Auditor(optimizer)
    assert _untouched(optimizer)


def _input_run(**options):
    inputs, labels = _holdout(64)
    model, optimizer, loader, _ = _private(seed=0, holdout=64)
    return model, optimizer, loader, {"canary_inputs": inputs, "canary_labels": labels, **options}


@_pytest.mark.parametrize("change,message", [
    (lambda o: o.update(canary_labels=_torch.nn.functional.one_hot(o["canary_labels"], 10)), r"1-D tensor of class indices \(not one-hot\)"),
    (lambda o: o.update(canary_labels=o["canary_labels"][:10]), r"`inputs` has 64 examples but `labels` has 10"),
    (lambda o: o.update(canary_labels=o["canary_labels"] + 20), r"`labels` must be integers in \[0, 10\)"),
    (lambda o: o.update(canary_inputs=o["canary_inputs"].reshape(64, 64)), r"cannot take canary inputs of shape \(64,\)"),
    (lambda o: o.update(canary_inputs=o["canary_inputs"].double()), r"canary inputs must be a tensor of the model's dtype"),
    (lambda o: o.update(loss_fn=_torch.nn.CrossEntropyLoss()), r"`loss_fn` must sum over the batch"),
    (lambda o: o.update(canary_inputs=None), r"need a sample of in-distribution inputs"),
    (lambda o: o.update(recraft_every=0), r"`recraft_every`: 0"),
    (lambda o: o.update(canaries_per_step=5000), r"input canaries are at most 4096 per step"),
    (lambda o: o["canary_inputs"].__setitem__(3, float("inf")), r"`canary_inputs`: 64 of its 4096 values are not finite \(the first is inf\)"),
    (lambda o: o["canary_inputs"].__setitem__((0, 0, 0, 0), float("nan")), r"`canary_inputs`: 1 of its 4096 values are not finite \(the first is nan\)"),
    (lambda o: o.update(loss_fn=lambda outputs: outputs.sum()), r"`loss_fn` must take two arguments \(outputs, labels\)"),
])
def test_input_canaries_refused_at_attach(change, message):
    model, optimizer, _, options = _input_run(canary="adversarial")
    change(options)
    with _pytest.raises(ValueError, match=message):
        _Auditor(optimizer, module=model, **options)
    assert _untouched(optimizer)


def test_input_canaries_need_the_model():
    _, optimizer, _, options = _input_run(canary="mislabeled")
    with _pytest.raises(ValueError, match=r"input canaries need the model: pass `module=`"):
        _Auditor(optimizer, **options)
    assert _untouched(optimizer)


def test_blank_canaries_need_no_labels():
    model, optimizer, loader, options = _input_run(canary="blank", canaries_per_step=8)
    del options["canary_labels"]
    auditor = _Auditor(optimizer, module=model, **options)
    _train(model, optimizer, loader, 2)
    assert auditor.steps == 2 and auditor.result().n_in + auditor.result().n_out > 0


# ------------------------------------------------------------------ saved state


@_pytest.fixture(scope="module")
def _saved():
    """The state of a short audit on the digits CNN (sigma 1, dirac, 1,024 canaries, one-run)."""
    model, optimizer, loader, _ = _private(seed=0)
    auditor = _Auditor(optimizer, seed=1)
    _train(model, optimizer, loader, 3)
    return auditor.state_dict()


def _fresh(**options):
    model, optimizer, loader, _ = _private(seed=0, **options.pop("private", {}))
    return model, optimizer, loader, _Auditor(optimizer, seed=2, **options)


def _assert_unchanged(auditor, before):
    after = auditor.result(accounting=False)
    assert (auditor.steps, after.n_in, after.n_out) == (before.steps, before.n_in, before.n_out)


@_pytest.mark.parametrize("setup,message", [
    ({"private": {"noise_multiplier": 2.0}}, r"noise_multiplier \(saved 1.0, here 2.0\)"),
    ({"canary": "random"}, r"canary \(saved 'dirac', here 'random'\)"),
    ({"canaries_per_step": 64}, r"canaries_per_step \(saved 1024, here 64\)"),
    ({"mode": "paired"}, r"mode \(saved 'one-run', here 'paired'\)"),
    ({"private": {"max_grad_norm": 0.5}}, r"max_grad_norms \(saved \[1.0, .*here \[0.5"),
    ({"private": {"clipping": "per_layer"}}, r"clipping \(saved 'flat', here 'per_layer'\)"),
])
def test_a_state_from_another_set_up_is_refused_by_name(_saved, setup, message):
    model, optimizer, loader, auditor = _fresh(**setup)
    before = auditor.result(accounting=False)
    with _pytest.raises(ValueError, match=message + r".*start a new audit"):
        auditor.load_state_dict(_saved)
    _assert_unchanged(auditor, before)
    _train(model, optimizer, loader, 1)  # the run goes on
    assert auditor.steps == 1


def test_a_state_from_another_model_is_refused_before_any_step(_saved):
    model = _torch.nn.Sequential(_torch.nn.Flatten(), _torch.nn.Linear(64, 10))
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    data = DataLoader(TensorDataset(_torch.randn(64, 1, 8, 8), _torch.randint(10, (64,))), batch_size=16)
    model, optimizer, data = PrivacyEngine().make_private(
        module=model, optimizer=_torch.optim.SGD(model.parameters(), lr=0.1), data_loader=data,
        noise_multiplier=1.0, max_grad_norm=1.0,
    )
    auditor = _Auditor(optimizer, seed=0)
    with _pytest.raises(ValueError, match=r"saved on another set-up: shapes \(saved \[\[8, 1, 3, 3\].*here \[\[10, 64\], \[10\]\]\)"):
        auditor.load_state_dict(_saved)
    _train(model, optimizer, data, 1)
    assert auditor.steps == 1


def test_input_and_gradient_states_do_not_mix(_saved):
    model, optimizer, _, options = _input_run(canary="mislabeled", canaries_per_step=8)
    auditor = _Auditor(optimizer, module=model, **options)
    with _pytest.raises(ValueError, match=r"canary \(saved 'dirac', here 'mislabeled'\).*input \(saved False, here True\)"):
        auditor.load_state_dict(_saved)


@_pytest.mark.parametrize("key", ["steps", "sampler", "pool", "fingerprints", "log", "monitor"])
def test_a_state_missing_a_field_is_refused_by_name(_saved, key):
    state = dict(_saved)
    del state[key]
    _, _, _, auditor = _fresh()
    with _pytest.raises(ValueError, match=rf"the audit state lacks '{key}'"):
        auditor.load_state_dict(state)
    assert auditor.steps == 0


@_pytest.mark.parametrize("state,message", [
    ("not a state", r"an audit state is a dict .* got str"),
    (None, r"an audit state is a dict .* got NoneType"),
    ([1, 2], r"got list"),
])
def test_something_else_than_a_state_is_refused(state, message):
    _, _, _, auditor = _fresh()
    with _pytest.raises(ValueError, match=message):
        auditor.load_state_dict(state)


@_pytest.mark.parametrize("corrupt,message", [
    (lambda s: s.update(format=99), r"audit state format 99 is not one this version reads"),
    (lambda s: s.update(steps=-3), r"`steps` is -3"),
    (lambda s: s.update(steps="7"), r"`steps` is '7'"),
    (lambda s: s.update(steps=2.5), r"`steps` is 2.5"),
    (lambda s: s.pop("setup"), r"lacks its set-up record"),
    (lambda s: s["monitor"]["counts"].update({-1: [-106, 0, 0, 0]}), r"monitor counts for group -1 are \[-106, 0, 0, 0\]"),
    (lambda s: s["monitor"]["counts"].update({-1: [1.5, 0, 0, 0]}), r"monitor counts for group -1"),
    (lambda s: s.update(monitor="counts"), r"`monitor` is not a dict"),
    (lambda s: s.update(fingerprints={"bits": "x"}), r"the audit state is damaged \(`fingerprints`: ValueError"),
    (lambda s: s["log"].update(counts=_np.zeros((3, 3, 3))), r"the audit state is damaged \(`log`: ValueError: observation counts"),
    (lambda s: s["sampler"].update(rng="x"), r"the audit state is damaged \(`sampler` or `pool`"),
    (lambda s: s["correlation"].update(signs=0.5), r"the audit state is damaged \(`correlation`: ValueError: "
     r"`correlation.signs` has shape \(\); expected \(3, 128\): a row of sentinel signs per step in the window"),
    (lambda s: s["correlation"].update(signs=_np.zeros((3, 2, 64))), r"`correlation.signs` has shape \(3, 2, 64\); "
     r"expected \(3, 128\)"),
    (lambda s: s["correlation"].update(labels=_np.arange(2)), r"`correlation.labels` has shape \(2,\); expected \(3,\)"),
    (lambda s: s["correlation"].update(sums=_np.zeros((512, 2))), r"`correlation.sums` has shape \(512, 2\); "
     r"expected \(512,\): a sum per lag"),
])
def test_a_damaged_state_is_refused_and_the_auditor_left_as_it_was(_saved, corrupt, message):
    state = _copy.deepcopy(_saved)
    corrupt(state)
    model, optimizer, loader, auditor = _fresh()
    _train(model, optimizer, loader, 2)
    before = auditor.result(accounting=False)
    from lightning_dpaudit import AuditStateError

    with _pytest.raises(AuditStateError, match=message):
        auditor.load_state_dict(state)
    _assert_unchanged(auditor, before)
    _train(model, optimizer, loader, 1)
    assert auditor.steps == 3 and not auditor.result(accounting=False).violation


def test_a_failure_of_the_exact_check_around_the_step_stops_that_check_alone():
    from lightning_dpaudit import CheckStoppedWarning

    model, optimizer, loader, auditor = _fresh()
    _train(model, optimizer, loader, 1)

    def broken(*args, **kwargs):  # its code runs before the audited step, in the optimizer's add_noise
        raise RuntimeError("failure in the exact check")

    auditor.per_sample_check.around_step = broken
    with _pytest.warns(CheckStoppedWarning, match="failure in the exact check"):
        _train(model, optimizer, loader, 2)
    result = auditor.result(accounting=False)
    assert result.audit_failed is None and auditor.steps == 3  # the audit goes on, the step audited
    assert result.checks_stopped == (("per-sample gradients", "stopped at step 2: RuntimeError: failure in the exact check"),)


@_pytest.mark.parametrize("where", ["input-canary gradients", "reading the release"])
def test_a_failure_inside_an_audited_step_leaves_plain_training_working(where):
    if where == "input-canary gradients":
        model, optimizer, loader, options = _input_run(canary="mislabeled", canaries_per_step=8)
        auditor = _Auditor(optimizer, module=model, **options)
        target, name = auditor.kind.input_probe, "gradients"
    else:
        model, optimizer, loader, auditor = _fresh()
        target, name = auditor.kind, "read"
    _train(model, optimizer, loader, 1)

    def broken(*args, **kwargs):
        raise RuntimeError(f"failure in {where}")

    setattr(target, name, broken)
    from lightning_dpaudit.engine.step.pipeline import AuditFailedWarning

    with _pytest.warns(AuditFailedWarning, match=f"failure in {where}"):
        _train(model, optimizer, loader, 1)  # the step ends without the audit, which detaches itself
    assert all(not hasattr(p, "summed_grad") or not _torch.is_tensor(p.summed_grad) or p.summed_grad.isfinite().all()
               for p in optimizer.params)
    assert _untouched(optimizer)
    assert auditor.result(accounting=False).audit_failed == f"RuntimeError: failure in {where} at step 2"
    before = [p.detach().clone() for p in model.parameters()]
    _train(model, optimizer, loader, 2)  # plain training goes on
    assert any(not _torch.equal(b, p) for b, p in zip(before, model.parameters()))


# ---- the estimators

from lightning_dpaudit import estimators as _est  # noqa: E402


@_pytest.mark.parametrize("call,message", [
    (lambda: _est.end_to_end_epsilon(1, delta=0.99, sample_rate=0.01, steps=100, accountant="bogus"), r"`accountant`: 'bogus'"),
    (lambda: _est.end_to_end_epsilon(20, delta=1e-5, sample_rate=0.01, steps=100, accountant="prv"), r"beyond what the PRV accountant computes"),
    (lambda: _est.end_to_end_epsilon(1, delta=1e-5, sample_rate=0.01, steps=2.7), r"`steps`: 2.7; it must be a whole number"),
    (lambda: _est.end_to_end_epsilon(1, delta=1e-5, sample_rate=0.01, steps=-1), r"`steps`: -1"),
    (lambda: _est.end_to_end_epsilon(1, delta=1e-5, sample_rate=1.5, steps=10), r"`sample_rate`: 1.5; it must lie in \(0, 1\]"),
    (lambda: _est.end_to_end_epsilon(1, delta=1e-5, sample_rate="0.1", steps=10), r"`sample_rate`: '0.1'; use a number"),
    (lambda: _est.end_to_end_epsilon(float("nan"), delta=1e-5, sample_rate=0.1, steps=10), r"`mu_step`: nan"),
    (lambda: _est.end_to_end_epsilon(1, delta="1e-5", sample_rate=0.1, steps=10), r"`delta`: '1e-5'; use a number"),
    (lambda: _est.end_to_end_epsilon(1, delta=0, sample_rate=0.1, steps=10), r"`delta` must be > 0 here"),
    (lambda: _est.one_run_p_value(1.0, num_canaries=10, num_guesses=5, num_correct=-1, delta=1e-5), r"`num_correct`: -1"),
    (lambda: _est.one_run_p_value(1.0, num_canaries=10, num_guesses=5, num_correct=3, delta=2), r"`delta`: 2.0; it must lie in \[0, 1\)"),
    (lambda: _est.one_run_p_value(-1.0, num_canaries=10, num_guesses=5, num_correct=3, delta=0), r"`epsilon`: -1.0"),
    (lambda: _est.one_run_p_value(1.0, num_canaries=4, num_guesses=5, num_correct=3, delta=0), r"`num_guesses` \(5\) cannot exceed"),
    (lambda: _est.one_run_epsilon(1000, 100, 101), r"`num_correct` \(101\) cannot exceed"),
    (lambda: _est.one_run_epsilon(1000, 100, 90, confidence="0.95"), r"`confidence`: '0.95'; use a number"),
    (lambda: _est.mu_from_counts(-1, 5, 5, 5), r"`tp`: -1; counts must be whole numbers"),
    (lambda: _est.mu_from_counts(1.5, 5, 5, 5), r"`tp`: 1.5"),
    (lambda: _est.mu_from_counts([1, 2], [1], [1, 2], [1, 2]), r"must have one shape"),
    (lambda: _est.mu_from_counts(5, 5, 5, 5, method="katz"), r"`method`: 'katz'"),
    (lambda: _est.epsilon_lower_bound([[1.0, 2.0]], [0.0, 0.1], delta=1e-5), r"`in_scores` must be 1-D .* shape \(1, 2\)"),
    (lambda: _est.epsilon_lower_bound([1.0, float("nan")], [0.0], delta=1e-5), r"only finite numbers"),
    (lambda: _est.epsilon_lower_bound([1.0], [0.0], delta=1e-5, confidence=1.0), r"`confidence`: 1.0"),
    (lambda: _est.mu_to_epsilon(1.0, "1e-5"), r"`delta`"),
    (lambda: _est.epsilon_lower_bound([1.0], [0.0], delta=1e-5, threshold=True), r"`threshold`: True; pass a number, None or 'best'"),
    (lambda: _est.epsilon_lower_bound([1.0], [0.0], delta=1e-5, threshold=[0.5]), r"`threshold`: \[0.5\]; pass a number"),
    (lambda: _est.clopper_pearson_upper(5, 3, 0.95), r"`k` \(5\) cannot exceed `n` \(3\)"),
    (lambda: _est.clopper_pearson_upper([1, 4], [2, 3], 0.95), r"`k` \(4\) cannot exceed `n` \(3\)"),
    (lambda: _est.clopper_pearson_upper(-1, 3, 0.95), r"`k`: -1; counts must be whole numbers >= 0"),
    (lambda: _est.clopper_pearson_upper(1, 3.5, 0.95), r"`n`: 3.5"),
    (lambda: _est.clopper_pearson_upper(1, 3, 2.0), r"`level`: 2.0; it must lie in \(0, 1\)"),
    (lambda: _est.end_to_end_epsilon(1, delta=1e-5, history=[(1.0, 0.1)]), r"Unexpected entry in `history`: \(1.0, 0.1\); each is \(noise_multiplier, sample_rate, steps\)"),
    (lambda: _est.end_to_end_epsilon(1, delta=1e-5, history=[None]), r"Unexpected entry in `history`: None"),
    (lambda: _est.end_to_end_epsilon(1, delta=1e-5, history="abc"), r"`history`: 'abc'; pass a list of"),
    (lambda: _est.one_run_bounds([0.1, 0.2], [True, False], delta=1e-5), r"`scores`: a list; pass a dict of score name"),
    (lambda: _est.one_run_bounds({"loss": list(range(10))}, [True, False] * 5, delta=1e-5, selection="split", seed=-1),
     r"`seed`: -1; use an integer >= 0"),
])
def test_estimators_refuse_bad_arguments_by_name(call, message):
    with _pytest.raises(ValueError, match=message):
        call()


def test_clopper_pearson_upper_still_bounds_valid_counts():
    assert float(_est.clopper_pearson_upper(0, 0, 0.95)) == 1.0 and float(_est.clopper_pearson_upper(3, 3, 0.95)) == 1.0
    assert 0.0 < float(_est.clopper_pearson_upper(0, 10, 0.95)) < 0.3
    assert _np.allclose(_est.clopper_pearson_upper(_np.array([0, 5]), _np.array([10, 10]), 0.95),
                        [_est.clopper_pearson_upper(0, 10, 0.95), _est.clopper_pearson_upper(5, 10, 0.95)])


def test_end_to_end_epsilon_is_never_negative():
    assert _est.end_to_end_epsilon(1, delta=0.99, sample_rate=0.01, steps=100) == 0.0


# ---- refused at once, naming the bad value: what a new user tries first

import os as _os
import tracemalloc as _tracemalloc

import pytorch_lightning as _pl
from opacus import PrivacyEngine as _PrivacyEngine
from torch.utils.data import DataLoader as _DataLoader
from torch.utils.data import Subset as _Subset

from lightning_dpaudit.engine.canaries.input_canaries import InputCanaries as _InputCanaries
from lightning_dpaudit.integrations.digits import digits_dataset as _digits


class _DigitsData(_pl.LightningDataModule):
    def train_dataloader(self):
        return _DataLoader(_Subset(_digits(), range(128)), batch_size=32, shuffle=True,
                           generator=_torch.Generator().manual_seed(0))


class _ManualPrivate(_pl.LightningModule):
    """Lightning's manual optimization with Opacus; the auditor attaches to `self.optimizers()` (a
    LightningOptimizer) or to the optimizer inside it."""

    def __init__(self, unwrap: bool):
        super().__init__()
        self.automatic_optimization = False
        self.model = _torch.nn.Sequential(_torch.nn.Flatten(), _torch.nn.Linear(64, 10))
        self.privacy_engine = _PrivacyEngine(accountant="rdp")
        self.unwrap, self.auditor = unwrap, None

    def forward(self, x):
        return self.model(x)

    def configure_optimizers(self):
        optimizer = _torch.optim.SGD(self.parameters(), lr=0.1)
        _, optimizer, _ = self.privacy_engine.make_private(
            module=self, optimizer=optimizer, data_loader=self.trainer.datamodule.train_dataloader(),
            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
        )
        return optimizer

    def on_train_start(self):
        wrapper = self.optimizers()
        self.auditor = _Auditor(wrapper.optimizer if self.unwrap else wrapper, seed=0)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(_torch.nn.functional.cross_entropy(self(images), labels))
        optimizer.step()


def _manual_fit(tmp_path, unwrap: bool) -> _ManualPrivate:
    _pl.seed_everything(0, verbose=False)
    module = _ManualPrivate(unwrap)
    trainer = _pl.Trainer(max_steps=8, logger=False, default_root_dir=tmp_path, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")
    trainer.fit(module, datamodule=_DigitsData())
    return module


def test_manual_optimization_audits_the_optimizer_inside_the_lightning_wrapper(tmp_path):
    wrapped = _manual_fit(tmp_path / "wrapped", unwrap=False)
    plain = _manual_fit(tmp_path / "plain", unwrap=True)
    accountant_steps = sum(n for _, _, n in wrapped.privacy_engine.accountant.history)
    assert wrapped.auditor.steps == accountant_steps == 8  # every step the accountant composed is audited
    result = wrapped.auditor.result()
    assert result.n_in + result.n_out == 8 * wrapped.auditor.options.canaries_per_step and not result.violation
    assert result.epsilon_accountant == _pytest.approx(wrapped.privacy_engine.accountant.get_epsilon(1e-5))
    # the same observations as an audit attached to the optimizer itself
    ours, theirs = wrapped.auditor.observations(), plain.auditor.observations()
    assert all(_np.array_equal(ours[key], theirs[key]) for key in ("step", "layer", "is_in", "value"))
    values, is_in = ours["value"], ours["is_in"]
    assert abs(values[is_in].mean() - 1.0) < 0.2 and abs(values[~is_in].mean()) < 0.2  # N(1, 1) in, N(0, 1) out


def _automatic_private():
    """_ManualPrivate's model and private optimizer under Lightning's automatic optimization (cross-entropy)."""
    module = _ManualPrivate(unwrap=True)
    module.automatic_optimization, module.on_train_start = True, lambda: None
    module.training_step = lambda batch, *rest: _torch.nn.functional.cross_entropy(module(batch[0]), batch[1])
    return module


def _bare_trainer(tmp_path, callback, max_steps: int):
    """A Trainer of `max_steps` steps with `callback` alone: no logger, bar, summary or checkpoints."""
    return _pl.Trainer(max_steps=max_steps, logger=False, default_root_dir=tmp_path, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", callbacks=[callback])


def test_final_model_canaries_never_wrapped_into_the_training_data_are_refused_before_any_step(tmp_path):
    from lightning_dpaudit import FinalModelCanaries

    canaries = FinalModelCanaries(8, "ood", num_classes=10, seed=1)
    callback = DPAuditCallback(seed=0, final_model_canaries=canaries)  # and a datamodule without them
    module = _automatic_private()
    trainer = _bare_trainer(tmp_path, callback, 4)
    with _pytest.raises(ValueError, match=r"`final_model_canaries`: its wrap\(\) made no training dataset.*"
                                          r"CanaryDataModule\(your_datamodule, canaries\).*canaries\.wrap\(train_dataset\)"):
        trainer.fit(module, datamodule=_DigitsData())
    assert trainer.global_step == 0 and _untouched(trainer.optimizers[0])


_AUDITOR_OPTIONS_AT_BUILD = [
    ({"delta": 2.0}, r"`delta`: 2.0; use a finite number in \(0.0, 1.0\)"),
    ({"mode": "pair"}, r"`mode`: 'pair'; valid modes are one-run, paired"),
    ({"canaries_per_step": 0}, r"`canaries_per_step`: 0; use an integer >= 2"),
    ({"canary": "crafted"}, r"'crafted' canaries need a sample of in-distribution inputs: pass `canary_inputs`"),
    ({"seed": -1}, r"`seed`: -1; use an integer >= 0"),
    ({"module": 5}, r"`module`: int; pass the torch.nn.Module"),
    ({"estimator": "GDP-CP"}, r"`estimator`: 'GDP-CP'; valid estimators are"),
    ({"observation_window": 0}, r"`observation_window`: 0"),
    ({"loss_fn": "not callable"}, r"`loss_fn`='not callable' with gradient canaries"),
    ({"per_sample_check_every": -1}, r"`per_sample_check_every`: -1; use an integer >= 0"),
]


@_pytest.mark.parametrize("options,message", _AUDITOR_OPTIONS_AT_BUILD, ids=[str(o) for o, _ in _AUDITOR_OPTIONS_AT_BUILD])
def test_the_callback_checks_the_auditors_options_when_it_is_built_with_the_auditors_message(options, message):
    with _pytest.raises(ValueError, match=message) as at_build:
        DPAuditCallback(**options)
    _, optimizer, _, _ = _private(seed=0)
    with _pytest.raises(ValueError, match=message) as at_attach:
        _Auditor(optimizer, **options)
    assert str(at_build.value) == str(at_attach.value)


def _with_inputs(**options):
    inputs, labels = _holdout(16)
    return {"canary_inputs": inputs, "canary_labels": labels, **options}


@_pytest.mark.parametrize("options,message", [
    ({"canary_inputs": _torch.zeros(16, 1, 8, 8)},
     r"Unexpected option\(s\) `canary_inputs`=<Tensor of shape \(16, 1, 8, 8\)> with gradient canaries \('dirac'\): "
     r"they apply to input canaries \(mislabeled, blank, adversarial, crafted\) only"),
    ({"loss_fn": "not callable"}, r"`loss_fn`='not callable' with gradient canaries \('dirac'\)"),
    ({"recraft_every": -5}, r"`recraft_every`=-5 with gradient canaries \('dirac'\)"),
    ({"canary": "random", "canary_labels": _torch.zeros(16, dtype=_torch.long)}, r"`canary_labels`=.* with gradient canaries \('random'\)"),
    (_with_inputs(canary=_InputCanaries("mislabeled", inputs=_torch.zeros(4, 1, 8, 8), labels=_torch.zeros(4, dtype=_torch.long))),
     r"`canary_inputs`=.*`canary_labels`=.* with an InputCanaries object \('mislabeled'\): pass them to the InputCanaries"),
    (_with_inputs(canary="adversarial", recraft_every=-5), r"`recraft_every`: -5; use an integer >= 1"),
    (_with_inputs(canary="adversarial", loss_fn="not callable"), r"`loss_fn`: 'not callable'; use a callable"),
    ({"estimator": "GDP-CP"}, r"`estimator`: 'GDP-CP'; valid estimators are epsdelta-cp, epsdelta-bayes, gdp-cp, gdp-bayes$"),
])
def test_options_that_do_not_apply_to_the_canary_kind_are_refused_by_name(options, message):
    model, optimizer, _, _ = _private(seed=0)
    with _pytest.raises(ValueError, match=message):
        _Auditor(optimizer, module=model, **options)
    assert _untouched(optimizer)


@_pytest.mark.parametrize("options,message", [
    ({"epsilon": -0.3}, r"`epsilon`: -0.3; use a finite number in \[0.0, inf\)"),
    ({"craft_steps": -10}, r"`craft_steps`: -10; use an integer >= 0"),
    ({"craft_steps": 2.5}, r"`craft_steps`: 2.5"),
    ({"step_size": 0}, r"`step_size`: 0"),
    ({"min_strength": "0.9"}, r"`min_strength`: '0.9'"),
    ({"num_classes": 1}, r"`num_classes`: 1; use an integer >= 2"),
])
def test_input_canaries_refuse_negative_or_malformed_settings(options, message):
    inputs, labels = _holdout(8)
    with _pytest.raises(ValueError, match=message):
        _InputCanaries("crafted", inputs=inputs, labels=labels, **options)


@_pytest.mark.parametrize("attribute,value,message", [
    ("noise_multiplier", _torch.tensor(1.0), r"noise_multiplier: tensor\(1\.\) of type Tensor; it must be a Python float"),
    ("noise_multiplier", "1.0", r"noise_multiplier: '1.0' of type str"),
    ("max_grad_norm", _torch.tensor([1.0, 2.0]), r"max_grad_norm: tensor\(\[1\., 2\.\]\) of type Tensor"),
])
def test_a_claim_that_is_not_a_number_is_named_with_its_type(attribute, value, message):
    _, optimizer, _, _ = _private(seed=0)
    setattr(optimizer, attribute, value)
    with _pytest.raises(ValueError, match=message):
        _Auditor(optimizer)
    assert _untouched(optimizer)


_FEWER_BOUNDS = r"the optimizer's max_grad_norms: 7 bound\(s\) for 8 parameter tensors; per-layer clipping needs one"


def test_per_layer_bounds_that_do_not_match_the_tensors_are_refused_at_attach():
    _, optimizer, _, _ = _private(seed=0, clipping="per_layer")
    optimizer.max_grad_norms = optimizer.max_grad_norms[:-1]
    with _pytest.raises(ValueError, match=_FEWER_BOUNDS):
        _Auditor(optimizer)
    assert _untouched(optimizer)


def test_per_layer_bounds_shortened_mid_run_stop_the_audit_with_a_message_and_the_result_still_reads():
    """Opacus's own per-layer step cannot run with one bound fewer than tensors (it raises, as without the audit);
    the audit stops at that step and says why, and result() reads what it saw before."""
    model, optimizer, loader, _ = _private(seed=0, clipping="per_layer")
    auditor = _Auditor(optimizer, seed=1, canaries_per_step=64)
    _train(model, optimizer, loader, 2)
    optimizer.max_grad_norms = optimizer.max_grad_norms[:-1]
    try:
        _train(model, optimizer, loader, 1)
    except AttributeError:  # Opacus's add_noise: the last tensor was never clipped, so it has no summed_grad
        pass
    result = auditor.result()
    assert re.search(rf"^ValueError: Unexpected value for {_FEWER_BOUNDS}.* at step 3", result.audit_failed)
    assert result.steps == 2 and len(result.layers) == 8 and not result.violation
    assert "AUDIT FAILED: ValueError: Unexpected value for the optimizer's max_grad_norms" in str(result)


@_pytest.mark.parametrize("argv,message", [
    (["demo", "--no-audit", "--final-model", "50"], r"argument --final-model: not allowed with argument --no-audit"),
    (["demo", "--no-audit", "--final-model"], r"argument --final-model: not allowed with argument --no-audit"),
    (["demo", "--no-audit", "--canaries", "8"], r"argument --canaries: not allowed with argument --no-audit"),
    (["demo", "--no-audit", "--final-model-kind", "blank"], r"argument --final-model-kind: not allowed with argument --no-audit"),
    (["demo", "--final-model-kind", "blank"], r"argument --final-model-kind: needs argument --final-model"),
    (["demo", "--final-model", "298", "--final-model-kind", "mislabeled"], r"argument --final-model: 298 is above 297 "
     r"for --final-model-kind mislabeled \(the demo holds 297 digits out of training, one per canary\); use an integer "
     r"in \[2, 297\]"),
    (["demo", "--final-model", "--final-model-kind", "crafted"], r"argument --final-model: 500 is above 297 for "
     r"--final-model-kind crafted"),
    (["demo", "--threads", str(10**6)], rf"--threads: 1000000 is above {4 * (_os.cpu_count() or 1)} \(4 x the \d+ CPUs\)"),
])
def test_cli_refuses_conflicting_flags_and_too_many_threads_with_a_usage_error(argv, message, capsys):
    with _pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "usage: dpaudit demo" in err, err


def test_run_demo_refuses_a_final_model_without_the_audit():
    from lightning_dpaudit.app.demo import run_demo

    with _pytest.raises(ValueError, match=r"`final_model`: 50 with audit=False"):
        run_demo(audit=False, final_model=50)


def _no_huge_allocation(call) -> None:
    """call() raises ValueError before it allocates 64 MB."""
    _tracemalloc.start()
    try:
        call()
    finally:
        peak = _tracemalloc.get_traced_memory()[1]
        _tracemalloc.stop()
        assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MB allocated before the refusal"


def _resource_cases():
    from lightning_dpaudit import FinalModelCanaries
    from lightning_dpaudit.analysis.observations import ObservationLog

    return [
        ("window", lambda: _Auditor(_private(seed=0)[1], observation_window=10**10),
         r"`observation_window`: 10000000000; use an integer in \[1, 67108864\] \(2\*\*26"),
        ("window-callback", lambda: DPAuditCallback(observation_window=10**10), r"`observation_window`: 10000000000"),
        ("window-log", lambda: ObservationLog(["dirac"], window=10**10), r"`window`: 10000000000; it must lie in \[1, 67108864\]"),
        ("final-model", lambda: FinalModelCanaries(10**9), r"`count`: 1000000000; use an integer in \[2, 1000000\] \(10\*\*6"),
        ("final-model-custom", lambda: FinalModelCanaries(inputs=_torch.zeros(10**6 + 1, 1), labels=_torch.zeros(10**6 + 1, dtype=_torch.long)),
         r"`len\(inputs\)`: 1000001; use an integer in \[2, 1000000\]"),
        ("composition", lambda: _est.end_to_end_epsilon(0.5, delta=1e-5, sample_rate=0.001, steps=3 * 10**9, accountant="prv"),
         r"`steps`: 3,000,000,000 steps to compose; at most 100,000,000 \(10\*\*8\)"),
        ("composition-rdp", lambda: _est.end_to_end_epsilon(0.5, delta=1e-5, sample_rate=0.001, steps=3 * 10**9),
         r"at most 100,000,000 \(10\*\*8\)"),
        ("prv-points", lambda: _est.end_to_end_epsilon(0.5, delta=1e-5, sample_rate=0.001, steps=10**8, accountant="prv"),
         r"the PRV accountant would discretise 100,000,000 steps on 3.2e\+08 points .* above the bound of 8,388,608 points"),
        ("one-run", lambda: _est.one_run_epsilon(6 * 10**8, 100, 90), r"`num_canaries`: 600,000,000; at most 10,000,000 \(10\*\*7\)"),
        ("one-run-p", lambda: _est.one_run_p_value(1.0, num_canaries=6 * 10**8, num_guesses=10**8, num_correct=10**8, delta=0),
         r"`num_canaries`: 600,000,000"),
        ("one-run-fdp", lambda: _est.one_run_fdp_epsilon(6 * 10**8, 100, 90, delta=1e-5), r"`num_canaries`: 600,000,000"),
    ]


@_pytest.mark.parametrize("case", range(11), ids=[c[0] for c in _resource_cases()])
def test_resource_bounds_are_checked_before_anything_is_allocated(case):
    _, call, message = _resource_cases()[case]
    with _pytest.raises(ValueError, match=message):
        _no_huge_allocation(call)


def test_one_run_bounds_refuse_more_canaries_than_the_bound():
    included = _np.zeros(10**7 + 1, dtype=bool)
    with _pytest.raises(ValueError, match=r"`included`: 10,000,001 canaries; at most 10,000,000 \(10\*\*7\)"):
        _est.one_run_bounds({"loss": [0.0]}, included, delta=1e-5)


def test_the_end_to_end_lower_bound_is_never_negative_at_a_large_delta():
    """RDP's conversion at delta = 0.5 goes below 0; a lower bound on epsilon there is 0, as end_to_end_epsilon says."""
    from lightning_dpaudit.estimators.live_epsilon import LiveEpsilon

    history = [(1.0, 64 / 1797, 3)]
    assert _est.end_to_end_epsilon(0.5, delta=0.5, history=history) == 0.0
    for accountant in ("rdp", "gdp", "prv"):
        live = LiveEpsilon(accountant, delta=0.5)
        assert live.lower_bound_epsilon(0.5, history) == 0.0
        assert live.lower_bound_epsilon_scaled(0.5, history) == 0.0
    model, optimizer, loader, _ = _private(seed=0)
    auditor = _Auditor(optimizer, seed=1, delta=0.5)
    _train(model, optimizer, loader, 3)
    result = auditor.result()
    assert result.epsilon_lower_bound == 0.0 and result.n_in > 0


@_pytest.mark.parametrize("options", [{"confidence": 0.999999}, {"per_sample_check_every": None}])
def test_the_callback_refuses_what_the_auditor_refuses(options):
    name = next(iter(options))
    with _pytest.raises(ValueError, match=rf"`{name}`: {options[name]}"):
        DPAuditCallback(**options)


@_pytest.mark.parametrize("kind", ["adversarial", "crafted"])
def test_a_crafting_budget_beyond_the_bound_is_refused_at_attach_not_run(kind):
    model, optimizer, _, options = _input_run()
    canaries = _InputCanaries(kind, inputs=options["canary_inputs"], labels=options["canary_labels"], craft_steps=10**12)
    with _pytest.raises(ValueError, match=r"`craft_steps`: 1000000000000; use an integer in \[0, 10000\]"):
        _Auditor(optimizer, module=model, canary=canaries, canaries_per_step=4)
    assert _untouched(optimizer)


def test_the_callback_refuses_an_optimizer_the_trainer_does_not_step_before_any_step(tmp_path):
    other = _private(seed=0)[1]  # a DPOptimizer of another model
    callback = DPAuditCallback(seed=0, optimizer=other)
    module = _automatic_private()
    trainer = _bare_trainer(tmp_path, callback, 4)
    with _pytest.raises(ValueError, match=r"`optimizer`: the DPOptimizer passed is not one of the Trainer's optimizers "
                                          r"\(DPOptimizer\), so no step of this fit would be audited"):
        trainer.fit(module, datamodule=_DigitsData())
    assert trainer.global_step == 0 and _untouched(other) and _untouched(trainer.optimizers[0])


def test_the_callback_audits_the_trainers_optimizer_when_it_is_passed(tmp_path):
    _pl.seed_everything(0, verbose=False)
    module = _automatic_private()
    optimizer = {}

    def configure():
        optimizer["dp"] = _ManualPrivate.configure_optimizers(module)
        return optimizer["dp"]

    class Passing(DPAuditCallback):
        def on_fit_start(self, trainer, pl_module):
            self.optimizer = optimizer["dp"]
            super().on_fit_start(trainer, pl_module)

    module.configure_optimizers = configure
    callback = Passing(seed=0)
    trainer = _bare_trainer(tmp_path, callback, 3)
    trainer.fit(module, datamodule=_DigitsData())
    assert callback.auditor.steps == 3


def _final_model_cases():
    from lightning_dpaudit import CanaryDataModule, FinalModelCanaries
    from lightning_dpaudit.integrations.digits import DigitsCNN

    def wrapped():
        canaries = FinalModelCanaries(20, "ood", seed=1)
        canaries.wrap(_digits())
        return canaries

    nan_inputs = _torch.zeros(4, 1, 8, 8)
    nan_inputs[1, 0, 2, 2] = float("nan")
    return [
        ("custom nan inputs", lambda: FinalModelCanaries(inputs=nan_inputs, labels=_torch.zeros(4, dtype=_torch.long)),
         r"`inputs`: 1 of its 256 input values are not finite"),
        ("held-out inf", lambda: FinalModelCanaries(8, "mislabeled", held_out=(nan_inputs.fill_(float("inf")), _torch.tensor([0, 1, 2, 3]))),
         r"`held_out`: 256 of its 256 input values are not finite"),
        ("wrap None", lambda: FinalModelCanaries(20, "ood", seed=1).wrap(None), r"`dataset`: NoneType; pass a map-style dataset"),
        ("audit None", lambda: wrapped().audit(None, delta=1e-5), r"`model`: NoneType; pass the trained torch.nn.Module"),
        ("score None", lambda: wrapped().score("model"), r"`model`: str"),
        ("record_start None", lambda: wrapped().record_start(None), r"`model`: NoneType"),
        ("audit epoch", lambda: wrapped().audit(DigitsCNN(), delta=1e-5, epoch=-1), r"`epoch`: -1; use an integer >= 0"),
        ("audit step", lambda: wrapped().audit(DigitsCNN(), delta=1e-5, step=2.5), r"`step`: 2.5"),
        ("audit accountant epsilon", lambda: wrapped().audit(DigitsCNN(), delta=1e-5, accountant_epsilon=-1.0),
         r"`accountant_epsilon`: -1.0; use a number >= 0, nan \(not known\) or None"),
        ("datamodule", lambda: CanaryDataModule(5, FinalModelCanaries(20, seed=1)), r"`datamodule`: int; pass the LightningDataModule"),
    ]


@_pytest.mark.parametrize("case", range(10), ids=[c[0] for c in _final_model_cases()])
def test_final_model_canaries_refuse_bad_input_by_name(case):
    _, call, message = _final_model_cases()[case]
    with _pytest.raises(ValueError, match=message):
        call()


def test_a_final_model_audit_without_the_accountants_epsilon_still_runs():
    from lightning_dpaudit import FinalModelCanaries
    from lightning_dpaudit.integrations.digits import DigitsCNN

    canaries = FinalModelCanaries(20, "ood", seed=1)
    canaries.wrap(_digits())
    result = canaries.audit(DigitsCNN(), delta=1e-5, accountant_epsilon=float("nan"), epoch=0, step=0)
    assert all(b.epsilon >= 0 for b in result.bounds.values())


def test_a_noise_multiplier_too_small_for_the_accountants_series_gives_an_infinite_epsilon_not_an_error():
    """Opacus's RDP series divides by sigma**2, which is 0 at sigma = 1e-300 (its get_epsilon raises
    ZeroDivisionError); the claim's epsilon there is inf, and so is mu-GDP's for mu = 1e300. The auditor refuses
    that claim at attach: its noise, 1e-300 in float32, is drawn as 0 (tests/test_causes.py)."""
    from lightning_dpaudit.estimators.live_epsilon import LiveEpsilon

    assert _est.mu_to_epsilon(1e300, 1e-5) == float("inf")
    assert _est.mu_to_epsilon(1e6, 1e-5) < float("inf")
    assert LiveEpsilon("rdp", delta=1e-5).accountant_epsilon([(1e-300, 0.03, 2)]) == float("inf")
    _, optimizer, _, _ = _private(seed=0, noise_multiplier=1e-300)
    with _pytest.raises(ValueError, match=r"noise_multiplier: 1e-300; the noise's std .* below float32's smallest"):
        _Auditor(optimizer, seed=1)
    assert _untouched(optimizer)


@_pytest.mark.parametrize("argv,message", [
    (["demo", "--steps", str(10**30)], r"--steps: 10{30} is above 1000000 \(10\*\*6: .*\); use an integer in \[1, 1000000\]"),
    (["demo", "--canaries", str(10**12)], r"--canaries: 10{12} is above 9802 for --canary dirac \(the demo model's 9802 "
                                          r"parameters, 1 per canary\); use an integer in \[2, 9802\]"),
    (["demo", "--canary", "random", "--canaries", "9000"], r"--canaries: 9000 is above 612 for --canary random"),
    (["demo", "--canary", "crafted", "--canaries", "5000"], r"--canaries: 5000 is above 4096 for --canary crafted"),
    (["demo", "--final-model", str(10**9)], r"--final-model: 10{9} is above 1000000 .*use an integer in \[2, 1000000\]"),
    (["demo", "--seed", str(2**70)], r"--seed: \d+ is above 4294967295 \(2\*\*32 - 1: numpy's largest seed\)"),
    (["demo", "--out", "/proc/forbidden"], r"--out: cannot create the directory /proc/forbidden"),
])
def test_cli_bounds_the_demos_sizes_and_seed_and_refuses_an_output_it_cannot_make(argv, message, capsys):
    with _pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "usage: dpaudit demo" in err, err


def test_cli_output_directory_check_leaves_nothing_behind(tmp_path):
    from lightning_dpaudit.app.cli import build_parser

    out = tmp_path / "a" / "b"
    assert build_parser().parse_args(["demo", "--out", str(out)]).out == str(out)
    assert not (tmp_path / "a").exists()


@_pytest.mark.parametrize("content,message", [
    (json.dumps({"result": {**_GOOD, "mu_lower_bound": float("inf")}}),
     r"`result.mu_lower_bound` is JSON's Infinity, which write_report never writes"),
    (json.dumps({"result": {**_GOOD, "epsilon_accountant": float("-inf")}}), r"`result.epsilon_accountant` is JSON's Infinity"),
    (json.dumps({"result": _GOOD, "history": [{"step": 1, "eps": float("inf")}]}), r"`history\[0\].eps` is JSON's Infinity"),
    ("[" * 100000 + "]" * 100000, r"is nested too deeply to read"),
    ('{"result": {"steps": 1' + "0" * 5000 + "}}", r"holds a number too long to read"),
])
def test_a_report_with_what_the_writer_never_writes_is_refused_in_one_line(tmp_path, content, message, capsys):
    path = tmp_path / "audit_report.json"
    path.write_text(content)
    with _pytest.raises(ReportError, match=message):
        load_report(tmp_path)
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr()
    assert err.out == "" and len(err.err.strip().splitlines()) == 1 and str(path) in err.err


def test_a_report_with_the_infinite_epsilon_the_writer_writes_still_reads(tmp_path, capsys):
    (tmp_path / "audit_report.json").write_text(json.dumps({"result": {**_GOOD, "epsilon_accountant": "inf"}}))
    assert main(["report", str(tmp_path)]) == 0
    assert "OK: no leak beyond the claim detected" in capsys.readouterr().out


def test_a_state_of_more_steps_than_the_accountant_composed_is_refused_and_the_auditor_unchanged():
    from lightning_dpaudit import AuditStateError

    model, optimizer, loader, engine = _private(seed=0)
    saver = _Auditor(optimizer, seed=1)
    _train(model, optimizer, loader, 3)
    state = _copy.deepcopy(saver.state_dict())
    _, optimizer2, _, engine2 = _private(seed=0)
    engine2.accountant.history = _copy.deepcopy(engine.accountant.history)  # a resume restores the accountant
    auditor = _Auditor(optimizer2, seed=1)
    with _pytest.raises(AuditStateError, match=r"`steps` is 1000000000000000000; expected a whole number from 0 to 3, "
                                               r"the steps the accountant's history composes"):
        auditor.load_state_dict({**state, "steps": 10**18})
    assert auditor.steps == 0
    auditor.load_state_dict(state)  # as saved: it loads
    assert auditor.steps == 3


@_pytest.mark.parametrize("value,message", [
    (float("nan"), r"noise_multiplier: nan"), (-1.0, r"noise_multiplier: -1.0"), ("2", r"noise_multiplier: '2' of type str"),
])
def test_a_noise_multiplier_opacus_cannot_draw_with_is_named_by_the_audit_before_opacus_fails(value, message):
    """Mid-run: plain Opacus's add_noise raises on it too (a torch error); the step raises the audit's clear
    ValueError first, and the audit records it."""
    model, optimizer, loader, _ = _private(seed=0)
    auditor = _Auditor(optimizer, seed=1)
    _train(model, optimizer, loader, 1)
    optimizer.noise_multiplier = value
    with _pytest.raises(ValueError, match=message):
        _train(model, optimizer, loader, 1)
    assert "noise_multiplier" in auditor.result(accounting=False).audit_failed
    assert not hasattr(optimizer, "_dpaudit_auditor")  # detached: the optimizer as without the audit


@_pytest.mark.parametrize("value", [float("nan"), -1.0])
def test_a_clipping_bound_opacus_cannot_draw_noise_with_is_named_as_the_clipping_bound(value):
    """max_grad_norm set to NaN or below 0 mid-run: the noise's std sigma * C cannot be drawn; the error names C,
    not the noise multiplier."""
    model, optimizer, loader, _ = _private(seed=0)
    auditor = _Auditor(optimizer, seed=1)
    _train(model, optimizer, loader, 1)
    optimizer.max_grad_norm = value
    with _pytest.raises(ValueError, match=r"the optimizer's max_grad_norm: "):
        _train(model, optimizer, loader, 1)
    failed = auditor.result(accounting=False).audit_failed
    assert "max_grad_norm" in failed and "noise_multiplier: " not in failed


def test_a_noise_multiplier_of_zero_mid_run_does_not_stop_training():
    """Plain Opacus completes a step at noise multiplier 0 (no noise): so does the audited optimizer, and the audit
    goes on, with the violation no_noise (tests/test_void_claim.py)."""
    from lightning_dpaudit.engine.auditor import PrivacyViolationWarning

    model, optimizer, loader, _ = _private(seed=0)
    auditor = _Auditor(optimizer, seed=1)
    _train(model, optimizer, loader, 1)
    optimizer.noise_multiplier = 0.0
    with _pytest.warns(PrivacyViolationWarning, match=r"no_noise"):
        _train(model, optimizer, loader, 1)
    result = auditor.result(accounting=False)
    assert result.audit_failed is None and [f.code for f in result.findings] == ["no_noise"]


@_pytest.mark.parametrize("make", [
    lambda loader: "loader", lambda loader: [next(iter(loader))], lambda loader: {"x": 1},
    lambda loader: _torch.zeros(4, 2), lambda loader: _np.zeros((4, 2)), lambda loader: iter(loader),
    lambda loader: (batch for batch in loader),
], ids=["string", "list", "dict", "tensor", "array", "iterator", "generator"])
def test_a_data_loader_that_cannot_be_watched_is_refused_at_attach(make):
    """Before: a list, a dict, an array or a generator raised a raw TypeError from the class swap, a tensor was
    accepted, and an iterator over the loop's loader was consumed by the audit (the model then differed)."""
    _, optimizer, loader, _ = _private(seed=0)
    with _pytest.raises(ValueError, match=r"Unexpected value for `data_loader`"):
        _Auditor(optimizer, data_loader=make(loader))
    assert _untouched(optimizer)


def test_watch_loader_refuses_an_iterator():
    _, optimizer, loader, _ = _private(seed=0)
    auditor = _Auditor(optimizer, seed=1)
    with _pytest.raises(ValueError, match=r"Unexpected value for `loader`"):
        auditor.watch_loader(iter(loader))


def test_a_one_value_tensor_clipping_bound_set_mid_run_is_the_new_claim():
    """Opacus clips and noises with a 0-d tensor max_grad_norm as with the float; the audit reads it as that number
    (before: the audit stopped with 'it must be a Python float')."""
    def train(model, optimizer, loader):
        for step, (images, labels) in zip(range(4), loader):
            if step == 2:
                optimizer.max_grad_norm = _torch.tensor(2.0)
            optimizer.zero_grad()
            _torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()

    plain_model, plain_optimizer, plain_loader, _ = _private(seed=0)
    train(plain_model, plain_optimizer, plain_loader)
    model, optimizer, loader, _ = _private(seed=0)
    auditor = _Auditor(optimizer, seed=1)
    train(model, optimizer, loader)
    result = auditor.result()
    assert result.audit_failed is None and result.steps == 4 and result.n_in > 0
    assert set(auditor.kind.probe.clip_bounds) == {2.0}  # the canaries are sized by the new bound
    for p, q in zip(model.parameters(), plain_model.parameters()):  # equal but for the canaries' float32 rounding
        _torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
