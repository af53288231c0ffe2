"""examples/transformer_ghost.py: a transformer trained with ghost clipping under Lightning, audited and not."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import transformer_ghost as example  # noqa: E402
from _transformer import SIZES, build_model, count_parameters, markov_tokens  # noqa: E402

STEPS_TO_CATCH = 8  # one check of the audit's pending readings
# about 1 M parameters; sigma 0.5 and Adam at 1e-2 so that 30 noisy steps visibly learn
TINY = dict(size="1M", steps=30, batch_size=32, seq_len=32, noise_multiplier=0.5, seed=0, lr=1e-2, progress_bar=False)


def test_sizes_are_about_their_names_and_untied():
    for name, target in [("1M", 1e6), ("10M", 10e6), ("25M", 25e6), ("40M", 40e6)]:
        model = build_model(name)
        assert abs(count_parameters(model) - target) <= 0.1 * target, name
        assert model.unembed.weight.data_ptr() != model.tokens.weight.data_ptr()
        assert not any(isinstance(m, torch.nn.MultiheadAttention) for m in model.modules())
        del model


def test_markov_tokens_are_seeded_and_follow_few_transitions():
    a, b = markov_tokens(64, 200, 20, seed=1), markov_tokens(64, 200, 20, seed=1)
    assert a.shape == (200, 21) and torch.equal(a, b)
    assert not torch.equal(a, markov_tokens(64, 200, 20, seed=2))
    successors = {}
    for row in a.tolist():
        for x, y in zip(row, row[1:]):
            successors.setdefault(x, set()).add(y)
    assert max(len(s) for s in successors.values()) <= 4  # a chain of 4 successors per token
    assert len(successors) > 32  # and not stuck in a few tokens


@pytest.fixture(scope="module")
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def plain(single_thread, tmp_path_factory):
    """The tiny run, un-audited."""
    return example.train(**TINY, audit=False, log_dir=str(tmp_path_factory.mktemp("plain")))[0]


@pytest.fixture(scope="module")
def audited(single_thread, tmp_path_factory):
    """The same seeded run under DPAuditCallback: the module, the callback and the log directory."""
    log_dir = tmp_path_factory.mktemp("audited")
    module, callback = example.train(**TINY, audit=True, log_dir=str(log_dir), log_every_n_steps=10)
    return module, callback, log_dir


def test_ghost_clipped_training_learns(plain):
    assert len(plain.losses) == TINY["steps"]
    assert type(plain.trainer.optimizers[0]).__name__ == "DPOptimizerFastGradientClipping"
    first, last = sum(plain.losses[:5]) / 5, sum(plain.losses[-5:]) / 5
    assert last < first - 0.15, plain.losses


def test_the_audit_leaves_the_update_unchanged(plain, audited):
    audited = audited[0]
    assert audited.losses == pytest.approx(plain.losses, abs=1e-5)
    for (name, p), q in zip(plain.model.named_parameters(), audited.model.parameters()):
        assert torch.allclose(p, q, atol=1e-5), name


def test_correct_run_is_quiet_and_logs_epsilons(audited):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, callback, log_dir = audited
    result = callback.auditor.result()
    assert result.steps == TINY["steps"] and not result.violation and not callback.alerted
    assert result.n_in > 0 and result.n_out > 0
    assert 0 < result.epsilon_accountant < float("inf")
    run_dir = log_dir / "transformer_ghost" / "version_0"
    assert (run_dir / "audit_report.json").exists()
    scalars = EventAccumulator(str(run_dir), size_guidance={"scalars": 0}).Reload()
    for tag in ["dpaudit/mu_claimed", "dpaudit/n_observations"]:
        assert [v.step for v in scalars.Scalars(tag)] == [10, 20, 30], tag
    n_observations = [v.value for v in scalars.Scalars("dpaudit/n_observations")]
    assert n_observations == sorted(n_observations) and n_observations[-1] == result.n_in + result.n_out
    # the epsilons at least at the end (a log step may skip them for the logging budget)
    ends = {"dpaudit/eps_lower_bound": result.epsilon_lower_bound, "dpaudit/eps_accountant": result.epsilon_accountant}
    for tag, value in ends.items():
        logged = scalars.Scalars(tag)
        assert {v.step for v in logged} <= {10, 20, 30} and logged[-1].step == 30, tag
        assert logged[-1].value == pytest.approx(value, rel=1e-5), tag


def _fit(module, steps, batch_size=16, callbacks=()):
    """`steps` steps of `module` on the example's Markov tokens, Poisson-sampled; no logger."""
    import pytorch_lightning as pl
    from opacus.lightning import DPLightningDataModule

    trainer = pl.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", callbacks=list(callbacks))
    data = example.MarkovText(SIZES[module.hparams.size][0], module.hparams.seq_len, batch_size, seed=0)
    trainer.fit(module, datamodule=DPLightningDataModule(data))
    return module


@pytest.mark.parametrize("exact_check", [True, False])
def test_the_audit_catches_a_ghost_clipping_bug_in_the_transformer(single_thread, exact_check):
    """nn.Linear's ghost norms halved in this model's clipping module: the exact per-sample check names it
    at step 1; without it, the canaries' first check raises the alarm."""
    from lightning_dpaudit import DPAuditCallback
    from lightning_dpaudit.integrations.ghost_bugs import inject_ghost_bug

    class HalvedLinearNorms(example.GhostClippedLM):
        def configure_optimizers(self):
            optimizer = super().configure_optimizers()
            inject_ghost_bug(optimizer, self.criterion.module, "halved-linear-norms")
            return optimizer

    alarms = []
    callback = DPAuditCallback(alert=alarms.append, seed=0, report=False, per_sample_check_every=100 if exact_check else 0)
    module = HalvedLinearNorms(size="1M", seq_len=16, noise_multiplier=0.5, lr=1e-2, seed=0)
    _fit(module, steps=STEPS_TO_CATCH, callbacks=[callback])
    assert len(alarms) == 1 and alarms[0].violation and alarms[0].first_violation_step <= STEPS_TO_CATCH
    if exact_check:  # the halved norm seen on real data at the check's first step, before any statistics
        exact = [f for f in alarms[0].findings if f.code == "per_sample_gradients"]
        assert exact and exact[0].first_step == 1 and ".weight` has norm" in exact[0].message
        assert "ghost clipping" in exact[0].message
    else:
        layer = [f for f in alarms[0].findings if f.code == "layer"]
        assert layer and "attention.qkv.weight 2." in layer[0].message  # linear weights released at about 2 C


def test_automatic_optimization_refuses_the_ghost_loss_but_takes_it_in_a_dict(tmp_path):
    """What the docs say of automatic optimization: a bare loss is refused; {"loss": loss} steps as manual does."""
    from lightning_fabric.utilities.exceptions import MisconfigurationException

    class Automatic(example.GhostClippedLM):
        def __init__(self, wrap, **kwargs):
            super().__init__(**kwargs)
            self.automatic_optimization, self.wrap = True, wrap

        def training_step(self, batch, batch_idx):
            (tokens,) = batch
            logits = self.model(tokens[:, :-1])
            b, t, v = logits.shape
            loss = self.criterion(logits.reshape(-1, v), tokens[:, 1:].reshape(-1), shape=(b, t))
            return {"loss": loss} if self.wrap else loss

    options = dict(size="1M", seq_len=16, noise_multiplier=0.5, lr=1e-2, seed=0)
    with pytest.raises(MisconfigurationException, match="must return a Tensor"):
        _fit(Automatic(wrap=False, **options), steps=3)
    torch.manual_seed(0)
    automatic = _fit(Automatic(wrap=True, **options), steps=3)
    torch.manual_seed(0)
    manual = _fit(example.GhostClippedLM(**options), steps=3)
    start = build_model("1M", 16, seed=0)
    for p, q, p0 in zip(automatic.model.parameters(), manual.model.parameters(), start.parameters()):
        assert torch.equal(p, q) and not torch.equal(p, p0)


def test_example_script_runs(tmp_path):
    args = ["--size", "1M", "--steps", "6", "--batch-size", "16", "--seq-len", "16", "--log-dir", str(tmp_path)]
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "transformer_ghost.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"parameters: {count_parameters(build_model('1M', 16)):,} (1M); 6 steps" in done.stdout
    assert "OK: no leak beyond the claim detected" in done.stdout and "violation: False" in done.stdout
    assert (tmp_path / "transformer_ghost" / "version_0" / "audit_report.json").exists()
