"""Progress and threads: the demo's and the examples' output when it is not a terminal, their `--threads`,
and the progress of crafting input canaries (shown when a run asks for it, silent in library calls)."""

import io
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_dpaudit.app.cli import DEMO_THREADS, build_parser, main
from lightning_dpaudit.engine.canaries.input_canaries import InputCanaries, show_progress
from lightning_dpaudit.integrations.digits import DigitsCNN, digits_holdout

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
DEMO_STEPS = 60
DEMO_MAX_BYTES = 10_000  # measured 3.8 KB (1.6 KB of it the summary table); Lightning's bar wrote 21 KB for these 60 steps
DEMO_MAX_LINES = 80  # measured 48


def test_demo_output_is_compact_when_not_a_terminal(tmp_path):
    """Through pipes (not a terminal): a few progress lines, no redrawn bar, whatever the steps."""
    done = subprocess.run(
        [sys.executable, "-m", "lightning_dpaudit.app.cli", "demo", "--steps", str(DEMO_STEPS), "--out", str(tmp_path)],
        capture_output=True, timeout=600, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:].decode(errors="replace")
    text = output.decode()
    assert b"\r" not in output  # no bar redrawn in place
    assert len(output) <= DEMO_MAX_BYTES and text.count("\n") <= DEMO_MAX_LINES, (len(output), text.count("\n"))
    progress = [line for line in text.splitlines() if line.startswith("step ")]
    assert 5 <= len(progress) <= 11 and progress[-1].startswith(f"step {DEMO_STEPS}/{DEMO_STEPS}, epoch ")
    shown = [line for line in progress if "eps_low" in line]
    assert shown and all("eps_step" not in line for line in shown)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent)).Reload()
    accountant = {e.step: e.value for e in logs.Scalars("dpaudit/eps_accountant")}
    for line in shown:  # each line's epsilons are those TensorBoard holds for the step they name, never a later one
        at = re.search(r"^step (\d+)/\d+.*; audit at step (\d+): eps_low [\d.e+-]+, eps_acc ([\d.e+-]+)", line)
        assert at and int(at.group(2)) <= int(at.group(1)), line
        assert float(at.group(3)) == pytest.approx(accountant[int(at.group(2))], rel=1e-3), line
    assert "torch threads: 1 (--threads)" in text and "OK: no leak beyond the claim detected" in text


def test_demo_threads_default_to_one_and_say_why():
    assert DEMO_THREADS == 1 and build_parser().parse_args(["demo"]).threads == 1
    demo = build_parser()._subparsers._group_actions[0].choices["demo"]
    (threads,) = [a for a in demo._actions if "--threads" in a.option_strings]
    assert "default 1" in threads.help and "small" in threads.help and "shared" in threads.help


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_each_example_takes_threads_and_sets_them_before_any_work(script, monkeypatch, capsys):
    """The script's own __main__ with `--threads 3`: torch.set_num_threads(3) comes first (stopped there);
    without the flag, 1; --help and the module docstring state it."""

    class SetThreads(Exception):
        pass

    def set_num_threads(n):
        raise SetThreads(n)

    monkeypatch.setattr(torch, "set_num_threads", set_num_threads)
    def work(*args, **kwargs):
        pytest.fail("work before torch.set_num_threads")

    monkeypatch.setattr(torch.nn.Module, "__init__", work)  # a model built
    monkeypatch.setattr(torch.distributed, "init_process_group", work)  # a process group started
    monkeypatch.syspath_prepend(str(script.parent))
    for argv, threads in ((["--threads", "3"], 3), ([], 1)):
        monkeypatch.setattr(sys, "argv", [str(script), *argv])
        with pytest.raises(SetThreads) as raised:
            runpy.run_path(str(script), run_name="__main__")
        assert raised.value.args == (threads,)
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    with pytest.raises(SystemExit):
        runpy.run_path(str(script), run_name="__main__")
    assert "--threads" in capsys.readouterr().out
    doc = runpy.run_path(str(script))["__doc__"]
    assert "--threads" in doc and "default 1" in doc


def test_an_example_says_how_many_threads_it_sets(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "plain_pytorch.py"), "--steps", "3", "--threads", "1"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})  # torch's own choice would be 2
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("torch threads: 1 (--threads)\n")


# ------------------------------------------------------------------ crafting progress


@pytest.fixture(scope="module")
def sample():
    torch.manual_seed(0)
    return DigitsCNN(), *digits_holdout(64)


def _build(sample, kind="crafted", **options):
    model, inputs, labels = sample
    canaries = InputCanaries(kind, inputs=inputs, labels=labels, craft_steps=5, num_classes=10, **options)
    canaries.build(model, 4, torch.Generator().manual_seed(0))
    return canaries


def test_crafting_reports_progress_when_asked(sample, capsys):
    canaries = _build(sample, progress=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "crafting 4 input canaries: 5 optimisation steps ..."
    assert lines[1].startswith("crafting 4 input canaries: done in ") and len(lines) == 2
    canaries.build(sample[0], 4, torch.Generator().manual_seed(0))  # a recraft during training: no lines
    assert capsys.readouterr().out == ""
    _build(sample, kind="adversarial", progress=True)
    assert capsys.readouterr().out.startswith("building 4 adversarial input canaries: 5 optimisation steps ...\n")


def test_crafting_shows_a_bar_on_a_terminal(sample, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    _build(sample, progress=True)
    shown = terminal.getvalue()
    assert shown.startswith("\rcrafting 4 input canaries:   0%|") and "| 0/5 [" in shown
    assert shown.endswith(" " * 20 + "\r")  # the bar is cleared when done: the training's own bar follows


def test_crafting_is_silent_unless_asked(sample, capsys):
    _build(sample)  # a library call: not asked
    _build(sample, progress=False)
    assert capsys.readouterr().out == ""
    canaries = InputCanaries("crafted", inputs=sample[1], labels=sample[2])
    show_progress(canaries, True)  # a run with a progress bar turns it on
    assert canaries.progress is True
    chosen = InputCanaries("crafted", inputs=sample[1], labels=sample[2], progress=False)
    show_progress(chosen, True)  # but not against the user's choice
    assert chosen.progress is False
    show_progress("dirac", True)  # gradient canaries: nothing to show
    with pytest.raises(ValueError, match="progress"):
        InputCanaries("crafted", inputs=sample[1], labels=sample[2], progress="yes")


def test_crafted_demo_shows_the_crafting(tmp_path, capsys):
    assert main(["demo", "--canary", "crafted", "--canaries", "4", "--steps", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "crafting 4 input canaries: 100 optimisation steps ...\n" in out
    assert out.index("crafting 4 input canaries: done in") < out.index("step 2/2, epoch 0")
    assert main(["demo", "--canary", "crafted", "--canaries", "4", "--steps", "2", "--out", str(tmp_path),
                 "--no-progress-bar"]) == 0
    assert "crafting" not in capsys.readouterr().out


def test_the_callback_shows_the_crafting_under_a_progress_bar(tmp_path, capsys):
    """DPAuditCallback with crafted input canaries, under the Trainer's progress bar: the first build's line."""
    import warnings

    import pytorch_lightning as pl
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, Subset

    from lightning_dpaudit import DPAuditCallback
    from lightning_dpaudit.integrations.digits import digits_dataset

    class Private(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = DigitsCNN()

        def forward(self, x):
            return self.model(x)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.model(batch[0]), batch[1])

        def train_dataloader(self):
            return DataLoader(Subset(digits_dataset(), range(128)), batch_size=64)

        def configure_optimizers(self):
            _, optimizer, _ = PrivacyEngine().make_private(
                module=self, optimizer=torch.optim.SGD(self.parameters(), lr=0.1),
                data_loader=self.train_dataloader(), noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False)
            return optimizer

    inputs, labels = digits_holdout(16)
    callback = DPAuditCallback(canary="crafted", canaries_per_step=2, canary_inputs=inputs, canary_labels=labels,
                               seed=0, report=False)
    trainer = pl.Trainer(max_steps=2, callbacks=[callback], logger=False, default_root_dir=tmp_path,
                         enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Private())
    assert "crafting 2 input canaries: " in capsys.readouterr().out


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_quiet_test_run_names_each_module_and_its_slowest_tests(workers):
    """`pytest -q` (the README's command) prints each test module's name, with its worker under xdist, and the
    slowest tests."""
    modules = ["tests/test_public_api.py", "tests/test_verdict.py"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", workers, "-p", "no:cacheprovider", *modules, "-k",
         "documented_names or counts_only_layers"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-2000:]
    lines = done.stdout.splitlines()
    for module in modules:
        named = [line for line in lines if line.endswith(module)]
        assert named and all(line in (module, f"[gw0] {module}", f"[gw1] {module}") for line in named), lines
    assert "slowest 15 durations" in done.stdout
