"""A checkpoint written by version 0.1.0 (tests/data/v0_1_checkpoint.ckpt, made by
tests/data/make_v0_1_checkpoint.py) still resumes: its audit state loads into today's
auditor with every count intact, and the audit goes on from it."""

import json
import warnings
from pathlib import Path

import pytest
import torch
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, Subset

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.integrations.logged_values import _from_checkpoint
from lightning_dpaudit.integrations.digits import digits_dataset, train_steps

DATA = Path(__file__).parent / "data"
SAVED = json.loads((DATA / "v0_1_checkpoint.json").read_text())

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _linear_run():
    """The set-up the checkpoint was written on: Linear(64, 10), sigma 1, C 1, batch 64."""
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    loader = DataLoader(Subset(digits_dataset(), range(512)), batch_size=64, shuffle=True)
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
    )
    return model, optimizer, loader


def _saved_auditor_state():
    checkpoint = torch.load(DATA / "v0_1_checkpoint.ckpt", weights_only=True)
    (state,) = [v for k, v in checkpoint["callbacks"].items() if k.startswith("DPAuditCallback")]
    return _from_checkpoint(state["auditor"])


def test_a_0_1_0_audit_state_loads_with_its_counts_and_goes_on():
    model, optimizer, loader = _linear_run()
    auditor = PrivacyAuditor(optimizer, seed=5)
    auditor.load_state_dict(_saved_auditor_state())
    before = auditor.result(accounting=False)
    assert (before.steps, before.n_in, before.n_out) == (SAVED["steps"], SAVED["n_in"], SAVED["n_out"])
    assert before.mu_lower_bound == pytest.approx(SAVED["mu_lower_bound"], rel=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_steps(model, optimizer, loader, 8)
    after = auditor.result(accounting=False)
    assert after.steps == SAVED["steps"] + 8 and after.n_in > before.n_in and not after.violation


def test_a_0_1_0_state_is_refused_by_an_auditor_on_another_model():
    from lightning_dpaudit.integrations.digits import make_private_digits

    _, optimizer, _, _ = make_private_digits(seed=0)  # the digits CNN: other tensors
    auditor = PrivacyAuditor(optimizer, seed=5)
    with pytest.raises(ValueError, match=r"saved on another set-up: parameter tensors \(saved 2, here 8\).*start a new audit"):
        auditor.load_state_dict(_saved_auditor_state())
    assert auditor.steps == 0 and auditor.result(accounting=False).n_in == 0


def test_a_damaged_0_1_0_state_is_refused_by_field_and_the_auditor_is_unchanged():
    import copy

    import numpy as np

    from lightning_dpaudit import AuditStateError

    for corrupt, message in [
        (lambda s: s["log"]["moments"].__setitem__((0, 1, 1), np.nan), r"`log.moments` holds nan at \[0, 1, 1\]"),
        (lambda s: s["monitor"]["counts"].update({0: [5, -1, 0, 0]}), r"monitor counts for group 0 are \[5, -1, 0, 0\]"),
        (lambda s: s["sampler"]["order"][0].__setitem__(0, -3), r"`sampler.order\[0\]` holds -3 at 0"),
        (lambda s: s.update(format=True), r"audit state format True is not one this version reads"),
    ]:
        state = copy.deepcopy(_saved_auditor_state())
        corrupt(state)
        _, optimizer, _ = _linear_run()
        auditor = PrivacyAuditor(optimizer, seed=5)
        before = auditor.state_dict()
        with pytest.raises(AuditStateError, match=message):
            auditor.load_state_dict(state)
        after = auditor.state_dict()
        assert after["steps"] == before["steps"] == 0 and after["monitor"]["counts"] == before["monitor"]["counts"]


def test_a_checkpoint_holding_two_0_1_0_states_does_not_restart_the_audit(tmp_path):
    import sys

    import pytorch_lightning as pl

    from lightning_dpaudit import AuditStateError, DPAuditCallback

    sys.path.insert(0, str(DATA))
    try:
        from make_v0_1_checkpoint import Digits, Linear
    finally:
        sys.path.remove(str(DATA))
    checkpoint = torch.load(DATA / "v0_1_checkpoint.ckpt", weights_only=True)
    (key,) = checkpoint["callbacks"]
    checkpoint["callbacks"][key.replace("'canary': None", "'canary': 'random'")] = checkpoint["callbacks"][key]
    torch.save(checkpoint, tmp_path / "two.ckpt")
    callback = DPAuditCallback(seed=0, report=False)
    trainer = pl.Trainer(max_epochs=3, callbacks=[callback], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(AuditStateError, match=r"the checkpoint holds 2 audit states of version 0.1.0"):
            trainer.fit(Linear(), datamodule=Digits(), ckpt_path=tmp_path / "two.ckpt")
    assert callback.auditor is None or callback.auditor.steps == 0
