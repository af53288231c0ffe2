"""The exact per-sample check (engine/checks/exact/per_sample.py): quiet on correct Opacus, a named finding on a wrong one.

Deterministic: a finding is a mismatch beyond floating-point tolerance, so these tests
have no false-failure rate beyond float rounding (tolerance 1e-3 relative)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from opacus import PrivacyEngine
from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
from torch import nn

from lightning_dpaudit import PrivacyAuditor

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")


class Mixed(nn.Module):
    """Every layout the check must follow: Linear on 2-D and on sequences (biases too), Embedding,
    LayerNorm, Conv1d and dropout."""

    def __init__(self, sequence: bool, dropout: float = 0.25):
        super().__init__()
        self.sequence = sequence
        self.embed = nn.Embedding(20, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.drop = nn.Dropout(dropout)
        self.hidden = nn.Linear(8, 12)
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 3)

    def forward(self, tokens):
        h = self.embed(tokens)  # (B, T, 8)
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = self.norm(torch.relu(self.hidden(self.drop(h))))  # Linear on sequences
        if not self.sequence:
            return self.head(h.mean(dim=1))  # Linear on 2-D inputs
        return self.head(h).sum(dim=1)  # Linear on sequences whose positions add up


def setup(mode: str, *, sequence: bool = True, max_grad_norm: float = 1.0, seed: int = 0, every: int = 1,
          dropout: float = 0.25):
    torch.manual_seed(seed)
    model = Mixed(sequence, dropout)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 20, (96, 6), generator=g)
    y = torch.randint(0, 3, (96,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    kwargs = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
                  noise_multiplier=1.0, max_grad_norm=max_grad_norm, poisson_sampling=False,
                  noise_generator=torch.Generator().manual_seed(seed + 1), grad_sample_mode=mode)
    if mode == "ghost":
        kwargs["criterion"] = nn.CrossEntropyLoss()
        module, optimizer, criterion, loader = PrivacyEngine().make_private(**kwargs)
    else:
        module, optimizer, loader = PrivacyEngine().make_private(**kwargs)
        criterion = nn.CrossEntropyLoss()
    return module, optimizer, criterion, loader


def train(module, optimizer, criterion, loader, steps: int, auditor_kwargs=None):
    auditor = None if auditor_kwargs is None else PrivacyAuditor(optimizer, seed=3, **auditor_kwargs)
    torch.manual_seed(11)  # dropout
    done = 0
    while done < steps:
        for x, y in loader:
            optimizer.zero_grad()
            criterion(module(x), y).backward()
            optimizer.step()
            done += 1
            if done == steps:
                break
    return auditor


EVERY_STEP = dict(per_sample_check_every=1, per_sample_check_budget=1.0)  # every step checked, whatever it costs
MODES = [("hooks", False), ("hooks", True), ("functorch", True), ("ew", True), ("ghost", False), ("ghost", True)]


@pytest.mark.parametrize("mode,sequence", MODES)
def test_correct_opacus_is_quiet_and_checked(mode, sequence):
    auditor = train(*setup(mode, sequence=sequence), steps=6, auditor_kwargs=EVERY_STEP)
    check = auditor.per_sample_check
    assert check.stopped is None and check.skipped is None
    assert check.checked == 5  # steps 1..5 (the model is found at step 0's forward pass)
    assert auditor.problems == []
    assert [code for code, _ in auditor.checks.notes()] == ["normalisation"]  # loss_reduction="mean": found at attach
    result = auditor.result()
    assert result.data_path.startswith("5 step(s) compared, every 1 from step 1") and not result.violation
    assert result.notes[0].startswith("normalisation: the update is divided by expected_batch_size = 32")


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_the_check_leaves_training_as_plain_opacus(mode):
    """With dropout in the model: the replay restores the RNG. The canaries' removal leaves float
    rounding (R - K), so plain Opacus is matched to 1e-6 and the audit without the check exactly."""
    trained = []
    for auditor_kwargs in (None, dict(per_sample_check_every=0), EVERY_STEP):
        module, *rest = setup(mode)
        train(module, *rest, steps=5, auditor_kwargs=None if auditor_kwargs is None else
              dict(canaries_per_step=64, **auditor_kwargs))
        trained.append(list(module.parameters()))
    plain, unchecked, checked = trained
    for p, q, r in zip(plain, unchecked, checked):
        assert torch.equal(q, r)
        torch.testing.assert_close(p, r, rtol=0, atol=1e-6)


def _scaled(sampler, which: str, factor: float, only_sequences: bool):
    def wrong(layer, activations, backprops):
        out = sampler(layer, activations, backprops)
        if not only_sequences or backprops.dim() == 3:
            p = getattr(layer, which)
            out[p] = out[p] * factor
        return out

    return wrong


def test_a_wrong_ghost_bias_norm_on_sequences_is_named(monkeypatch):
    samplers = dict(GradSampleModuleFastGradientClipping.NORM_SAMPLERS)
    samplers[nn.Linear] = _scaled(samplers[nn.Linear], "bias", 0.04, only_sequences=True)
    monkeypatch.setattr(GradSampleModuleFastGradientClipping, "NORM_SAMPLERS", samplers)
    auditor = train(*setup("ghost", sequence=True), steps=3, auditor_kwargs={})
    findings = {code: (message, step) for code, message, step in auditor.problems}
    message, step = findings["per_sample_gradients"]
    assert step == 1 and "bias`" in message and "ghost clipping" in message
    assert auditor.result().violation
    assert auditor.result().data_path.startswith("1 step(s) compared")  # a step with a mismatch was compared


def test_a_wrong_per_sample_gradient_under_hooks_is_named(monkeypatch):
    samplers = dict(GradSampleModule.GRAD_SAMPLERS)
    samplers[nn.Conv1d] = _scaled(samplers[nn.Conv1d], "weight", 0.5, only_sequences=False)
    monkeypatch.setattr(GradSampleModule, "GRAD_SAMPLERS", samplers)
    auditor = train(*setup("hooks"), steps=3, auditor_kwargs={})
    message = next(m for code, m, _ in auditor.problems if code == "per_sample_gradients")
    assert "`conv.weight`" in message and "plain autograd" in message


def test_a_clipping_coefficient_from_another_bound_is_named():
    module, optimizer, criterion, loader = setup("ghost", max_grad_norm=0.1)
    module.max_grad_norm = 1.0  # the module clips at 1 while the noise is calibrated to 0.1
    auditor = train(module, optimizer, criterion, loader, steps=3, auditor_kwargs={})
    message = next(m for code, m, _ in auditor.problems if code == "per_sample_gradients")
    assert "clipping coefficient" in message and "leaks" in message and "C = 0.1" in message


def test_a_trained_tensor_without_per_sample_gradients_is_named():
    """An adapter added after make_private (as a PEFT adapter can be) carries no Opacus hooks."""
    module, optimizer, criterion, loader = setup("ghost")
    torch.manual_seed(5)
    module._module.adapter = nn.Linear(12, 12)
    optimizer.add_param_group({"params": list(module._module.adapter.parameters())})
    forward = module._module.forward

    def with_adapter(tokens):
        inner = module._module
        h = inner.embed(tokens)
        h = inner.conv(h.transpose(1, 2)).transpose(1, 2)
        h = inner.norm(torch.relu(inner.hidden(inner.drop(h))))
        return inner.head(h + inner.adapter(h)).sum(dim=1)

    module._module.forward = with_adapter
    auditor = train(module, optimizer, criterion, loader, steps=3, auditor_kwargs={})
    message = next(m for code, m, _ in auditor.problems if code == "per_sample_gradients")
    assert "`adapter.weight`" in message and "never clipped" in message
    assert auditor.result().violation and forward is not with_adapter


def test_options_are_checked_and_zero_turns_the_check_off():
    module, optimizer, criterion, loader = setup("hooks")
    with pytest.raises(ValueError, match="per_sample_check_every"):
        PrivacyAuditor(optimizer, per_sample_check_every=-1)
    with pytest.raises(ValueError, match="per_sample_check_examples"):
        PrivacyAuditor(optimizer, per_sample_check_examples=0)
    auditor = train(module, optimizer, criterion, loader, steps=3, auditor_kwargs=dict(per_sample_check_every=0))
    assert auditor.per_sample_check.checked == 0 and not auditor.per_sample_check.handles
    from lightning_dpaudit.analysis.report import summary_table

    assert "  exact checks           off" in summary_table({"result": auditor.result().to_dict()})


@pytest.mark.parametrize("budget", [1e-9, 1.0])
def test_the_time_budget_skips_due_steps_after_the_first_check(budget):
    """Checks at every step: a budget no check fits in leaves step 1 alone checked, and says so; 1.0 checks all."""
    module, optimizer, criterion, loader = setup("hooks")
    with pytest.raises(ValueError, match="per_sample_check_budget"):
        PrivacyAuditor(optimizer, per_sample_check_budget=0.0)
    auditor = train(module, optimizer, criterion, loader, steps=6,
                    auditor_kwargs=dict(per_sample_check_every=1, per_sample_check_budget=budget))
    check = auditor.per_sample_check
    assert (check.checked, check.budget.skipped) == ((1, 4) if budget < 1 else (5, 0))  # steps 1..5 are due
    said = auditor.result().data_path
    assert ("4 due step(s) skipped to keep the checks within 0.0% of the run's time" in said) == (budget < 1)
    assert check.budget.spent > 0


# ------------------------------------------------------------------ physical batches and Lightning


def train_in_physical_batches(module, optimizer, criterion, loader) -> PrivacyAuditor:
    """One epoch in physical batches of 8 (BatchMemoryManager), exact checks at every step."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    auditor = PrivacyAuditor(optimizer, seed=3, **EVERY_STEP)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=8, optimizer=optimizer) as physical:
        for x, y in physical:
            optimizer.zero_grad()
            criterion(module(x), y).backward()
            optimizer.step()
    return auditor


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_physical_batches_are_checked_against_the_last_one(mode):
    auditor = train_in_physical_batches(*setup(mode))
    assert auditor.steps == 3 and auditor.per_sample_check.checked == 2
    assert auditor.per_sample_check.skipped is None
    assert not [code for code, *_ in auditor.problems if code in ("per_sample_gradients", "clipped_sum")]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_training_step_unchanged_is_checked(tmp_path, accumulate):
    from test_callback import Digits, Private, _fit

    from lightning_dpaudit import DPAuditCallback

    callback = DPAuditCallback(per_sample_check_every=2, per_sample_check_budget=1.0)
    data = Digits(shuffle=False) if accumulate > 1 else None  # Opacus refuses Poisson sampling with accumulation
    _fit(tmp_path, steps=5, callback=callback, datamodule=data, accumulate_grad_batches=accumulate)
    check = callback.auditor.per_sample_check
    assert check.checked == 2 and check.skipped is None and check.stopped is None  # steps 1 and 3
    assert not [code for code, *_ in callback.auditor.problems if code == "per_sample_gradients"]
    assert Private is not None


def test_lightning_run_with_a_wrong_conv_sampler_is_flagged(tmp_path, monkeypatch):
    from test_callback import _fit

    from lightning_dpaudit import DPAuditCallback

    samplers = dict(GradSampleModule.GRAD_SAMPLERS)
    samplers[nn.Conv2d] = _scaled(samplers[nn.Conv2d], "bias", 3.0, only_sequences=False)
    monkeypatch.setattr(GradSampleModule, "GRAD_SAMPLERS", samplers)
    callback = DPAuditCallback(per_sample_check_every=2, per_sample_check_budget=1.0, alert="warn")
    with pytest.warns(UserWarning, match="per_sample_gradients"):
        _fit(tmp_path, steps=3, callback=callback)
    message = next(m for code, m, _ in callback.auditor.problems if code == "per_sample_gradients")
    assert ".bias`" in message and "at step 1" in message


def test_a_physical_batch_counted_twice_is_named():
    from lightning_dpaudit.integrations.opacus_history import historical_bug

    with historical_bug("opacus-accumulation-1.5.3").patch():
        auditor = train_in_physical_batches(*setup("ghost"))
    message = next(m for code, m, _ in auditor.problems if code == "clipped_sum")
    assert "4 physical batch(es)" in message and "each batch's clipped sum" in message and "counted twice" in message
    assert auditor.result().violation


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_an_accountant_that_forgets_steps_is_named(mode):
    from lightning_dpaudit.integrations.opacus_history import historical_bug

    with historical_bug("opacus-541").patch():
        module, optimizer, criterion, loader = setup(mode)
        from opacus.accountants import GaussianAccountant

        accountant = GaussianAccountant()
        optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=0.25))
        auditor = PrivacyAuditor(optimizer, seed=3, accountant=accountant, per_sample_check_every=0)
        for step, (x, y) in enumerate([*loader, *loader]):
            optimizer.zero_grad()
            criterion(module(x), y).backward()
            optimizer.step()
            if step == 1:
                accountant.get_epsilon(1e-5)  # a running epsilon, as a training loop logs it
    message = next(m for code, m, _ in auditor.problems if code == "claim_unaccounted")
    assert "composes 0 step(s) where 2 were released" in message and "too low" in message


@pytest.mark.parametrize("version,refused", [("1.5.4", True), ("1.5.2", True), ("1.4.1", True), ("1.6.0", False),
                                             ("1.6.1+cu121", False), ("2.0", False)])
def test_opacus_releases_before_1_6_are_refused_with_the_reason(version, refused):
    from lightning_dpaudit.engine.options import check_opacus_version

    if refused:
        with pytest.raises(RuntimeError, match=r"needs Opacus >= 1.6.0; this is Opacus .*opacus-751.*pip install"):
            check_opacus_version(version)
    else:
        check_opacus_version(version)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_deterministic_model_replays_the_chosen_examples_alone_and_still_sees_a_bug(mode, monkeypatch):
    """Without dropout the chosen examples' outputs come back exactly from a replay of them alone (cheap);
    with dropout they do not, and the whole batch is replayed from its RNG state."""
    quiet = train(*setup(mode, dropout=0.0), steps=4, auditor_kwargs=EVERY_STEP)
    assert quiet.per_sample_check.replays == {"examples": 3, "batch": 0} and quiet.problems == []
    noisy = train(*setup(mode), steps=4, auditor_kwargs=EVERY_STEP)
    assert noisy.per_sample_check.replays == {"examples": 0, "batch": 3} and noisy.problems == []
    if mode == "ghost":
        samplers = dict(GradSampleModuleFastGradientClipping.NORM_SAMPLERS)
        samplers[nn.Linear] = _scaled(samplers[nn.Linear], "bias", 0.04, only_sequences=True)
        monkeypatch.setattr(GradSampleModuleFastGradientClipping, "NORM_SAMPLERS", samplers)
    else:
        samplers = dict(GradSampleModule.GRAD_SAMPLERS)
        samplers[nn.Conv1d] = _scaled(samplers[nn.Conv1d], "weight", 0.5, only_sequences=False)
        monkeypatch.setattr(GradSampleModule, "GRAD_SAMPLERS", samplers)
    broken = train(*setup(mode, dropout=0.0), steps=3, auditor_kwargs={})
    assert broken.per_sample_check.replays["examples"] == 1
    # under ghost clipping the canaries' rows are clipped with the same wrong norms: that is found too
    expected = {"per_sample_gradients", "canary_clipping"} if mode == "ghost" else {"per_sample_gradients"}
    assert {code for code, *_ in broken.problems} == expected


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_mixed_precision_is_replayed_under_its_autocast_and_judged_at_its_precision(mode, monkeypatch):
    """bf16 autocast: per-sample values agree with autograd to about 1e-2, not 1e-6; the check replays
    under the same autocast and allows 4 bf16 unit roundoffs. A bias norm at 4% of the truth still fails."""

    def run(steps):
        module, optimizer, criterion, loader = setup(mode, dropout=0.0)
        auditor = PrivacyAuditor(optimizer, seed=3, **EVERY_STEP)
        for _, (x, y) in zip(range(steps), loader):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = module(x)
            criterion(out.float(), y).backward()
            optimizer.step()
        return auditor

    quiet = run(3)
    assert quiet.problems == [] and quiet.per_sample_check.checked == 2
    assert quiet.per_sample_check.eps == float(torch.finfo(torch.bfloat16).eps)
    samplers = dict(GradSampleModuleFastGradientClipping.NORM_SAMPLERS if mode == "ghost" else GradSampleModule.GRAD_SAMPLERS)
    samplers[nn.Linear] = _scaled(samplers[nn.Linear], "bias", 0.04, only_sequences=True)
    owner = GradSampleModuleFastGradientClipping if mode == "ghost" else GradSampleModule
    monkeypatch.setattr(owner, "NORM_SAMPLERS" if mode == "ghost" else "GRAD_SAMPLERS", samplers)
    expected = {"per_sample_gradients", "canary_clipping"} if mode == "ghost" else {"per_sample_gradients"}
    assert {code for code, *_ in run(2).problems} == expected  # ghost: the canaries' norms are wrong too


def _tick():
    warnings.warn("a warning of the user's own, shown once per location", UserWarning)


def test_the_check_does_not_show_the_users_once_per_location_warnings_again():
    """Python shows a default-filtered warning once per location; an exact check at every step must not reset
    that (warnings.catch_warnings would), nor add warnings of its own beyond torch's once-per-location ones."""
    module, optimizer, criterion, loader = setup("hooks")
    auditor = PrivacyAuditor(optimizer, seed=3, **EVERY_STEP)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for step, (x, y) in zip(range(3), loader):
            _tick()
            optimizer.zero_grad()
            criterion(module(x), y).backward()
            optimizer.step()
    assert auditor.per_sample_check.checked == 2
    assert sum("of the user's own" in str(w.message) for w in caught) == 1


USERS_LOOP = """
import torch
from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.integrations.digits import make_private_digits
model, optimizer, loader, _ = make_private_digits(seed=0)
auditor = PrivacyAuditor(optimizer, seed=1, per_sample_check_every=1, per_sample_check_budget=1.0)
for step, (images, labels) in zip(range(4), loader):
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()
print("checked", auditor.per_sample_check.checked)
"""


def test_torch_s_warning_about_opacus_hooks_is_not_shown_from_the_check_s_own_lines(tmp_path):
    """Opacus's switched-off full backward hooks make torch warn in the check's replay, at the package's own line:
    not shown (the user's own backward pass shows it at the user's line, as without the audit)."""
    script = tmp_path / "users_loop.py"
    script.write_text(USERS_LOOP)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "checked 3" in done.stdout  # steps 2 to 4 (the check's hooks come with the first step)
    shown = [line for line in done.stderr.splitlines() if "Warning:" in line]
    assert any("users_loop.py" in line and "Full backward hook" in line for line in shown), shown
    assert not [line for line in shown if "lightning_dpaudit" in line], shown
