"""The checks' one interface and its runner (engine/checks/): a user's own check, and one check's fault kept its own.

Every run here is deterministic (fixed seeds); none is statistical.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning_modules import DigitsClassifier

from lightning_dpaudit import Check, CheckStoppedWarning, PrivacyAuditor, default_checks
from lightning_dpaudit.datasets import make_private_digits, train_steps
from lightning_dpaudit.engine.checks import MECHANISM
from lightning_dpaudit.engine.checks.mechanism.accountant import AccountantCheck
from lightning_dpaudit.engine.checks.mechanism.setup import SetupCheck

STEPS = 12


class LearningRateCeiling(Check):
    """A check written outside the package: the learning rate never exceeds `ceiling`."""

    name = "learning rate ceiling"
    scope = "pipeline"
    codes = ("learning_rate",)

    def __init__(self, ceiling: float):
        self.ceiling, self.compared = ceiling, 0

    def step(self, seen) -> None:
        self.compared += 1
        rate = max(group["lr"] for group in self.run.optimizer.param_groups)
        if rate > self.ceiling:
            self.run.report("learning_rate", f"the learning rate is {rate:g} at step {seen.step}, above the "
                            f"ceiling {self.ceiling:g} the claim was made for", seen.step)

    def status(self) -> str:
        return f"learning rate ceiling ({self.compared} steps compared)"


def audited_run(checks, steps=STEPS, lr_at=None, **options):
    model, optimizer, loader, _ = make_private_digits(seed=0)
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=3, checks=checks,
                             per_sample_check_every=5, per_sample_check_budget=1.0, on_violation=lambda result: None, **options)
    done = 0
    while done < steps:
        for images, labels in loader:
            if lr_at is not None and done == lr_at:
                optimizer.param_groups[0]["lr"] = 1.0
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
            done += 1
            if done == steps:
                break
    result = auditor.result()
    auditor.detach()
    return model, result


def plain_model(steps=STEPS):
    model, optimizer, loader, _ = make_private_digits(seed=0)
    train_steps(model, optimizer, loader, steps)
    return model


def same_parameters(a, b) -> bool:
    """Equal up to the float rounding of adding and removing the canaries (tests/test_training_unchanged.py)."""
    return all(torch.allclose(p, q, rtol=0, atol=1e-6) for p, q in zip(a.parameters(), b.parameters()))


def test_a_check_from_outside_the_package_reports_a_pipeline_finding():
    _, result = audited_run([*default_checks(), LearningRateCeiling(0.5)], lr_at=6)
    assert result.violation
    # the certain finding alone: the canaries' noise and clipping tests, whose error bound holds only after the
    # canaries' own alarm, name no cause on this correct optimizer
    assert [f.code for f in result.findings] == ["learning_rate"]
    found = result.findings[0]
    assert found.scope == "pipeline" and found.first_step == 7
    assert "does not describe this run (learning_rate)" in str(result)
    assert "learning rate ceiling (12 steps compared)" in result.pipeline


def test_a_quiet_check_from_outside_the_package_adds_its_status_and_nothing_else():
    _, result = audited_run([*default_checks(), LearningRateCeiling(0.5)])
    assert not result.violation and not result.findings
    assert result.pipeline.endswith("learning rate ceiling (12 steps compared)")
    assert result.pipeline.startswith("sampling (loader: poisson")
    assert "compared, every 5 from step 1" in result.data_path


def test_checks_replace_the_defaults():
    _, result = audited_run([LearningRateCeiling(0.5)])
    assert result.pipeline == "learning rate ceiling (12 steps compared)"
    assert result.data_path == "off"


@pytest.mark.parametrize("checks", [LearningRateCeiling(1.0), [object()], "sampling"])
def test_checks_that_are_not_a_list_of_checks_are_refused(checks):
    model, optimizer, loader, _ = make_private_digits(seed=0)
    with pytest.raises(ValueError, match="`checks`|in `checks`"):
        PrivacyAuditor(optimizer, module=model, checks=checks)


class Faulty(Check):
    """Raises in one hook (and, for around_step, before or after running the step)."""

    name = "faulty"

    def __init__(self, hook: str, after: bool = False):
        self.hook, self.after = hook, after

    def _maybe(self, hook):
        if hook == self.hook:
            raise RuntimeError(f"broken {hook}")

    def attach(self, run):
        super().attach(run)
        self._maybe("attach")

    def loader(self, loader):
        self._maybe("loader")

    def batch(self, batch):
        self._maybe("batch")

    def accumulate(self):
        self._maybe("accumulate")

    def step(self, seen):
        if seen.step >= 3:
            self._maybe("step")

    def around_step(self, step, run_step):
        if self.hook == "around_step" and step >= 3:
            if self.after:
                run_step()
            raise RuntimeError("broken around_step")
        run_step()

    def status(self):
        self._maybe("status")
        return "faulty (ran)"

    def notes(self):
        self._maybe("notes")
        return []


HOOK_CASES = [("attach", False), ("loader", False), ("batch", False), ("accumulate", False), ("step", False),
              ("around_step", False), ("around_step", True), ("status", False), ("notes", False)]


@pytest.mark.parametrize("hook,after", HOOK_CASES, ids=[f"{h}{'-after' if a else ''}" for h, a in HOOK_CASES])
def test_a_check_that_raises_is_stopped_alone_and_training_is_plain_opacus(hook, after):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, result = audited_run([*default_checks(), Faulty(hook, after)])
    assert same_parameters(model, plain_model())  # training exactly as without the audit
    assert [name for name, _ in result.checks_stopped] == ["faulty"]
    assert f"RuntimeError: broken {hook}" in result.checks_stopped[0][1]
    assert "faulty (stopped at step" in result.pipeline
    assert "check(s) stopped: faulty (stopped at step" in str(result)
    assert any(issubclass(w.category, CheckStoppedWarning) for w in caught)
    # the other checks ran to the end
    assert "rows per record (12 steps compared)" in result.pipeline
    assert "3 step(s) compared, every 5 from step 1" in result.data_path
    assert result.audit_failed is None and not result.violation


def test_the_exact_check_stopping_leaves_the_rows_check_comparing(monkeypatch):
    from lightning_dpaudit.engine.checks.exact.per_sample import PerSampleCheck

    def broken(self, calls, step):
        raise TypeError("Float did not match BFloat16")

    monkeypatch.setattr(PerSampleCheck, "_compare", broken)
    with pytest.warns(RuntimeWarning, match="per-sample gradient check stopped at step 2:"):
        model, result = audited_run(None)
    assert same_parameters(model, plain_model())
    assert result.data_path.startswith("stopped at step 2: TypeError: Float did not match BFloat16")
    assert ("per-sample gradients", result.data_path.split("; compared")[0]) in result.checks_stopped
    assert "rows per record (12 steps compared)" in result.pipeline
    # its replays stopped with it: those of step 2 (before its comparison failed) are all the status counts
    assert "independence of examples (1 replays with the others replaced" in result.pipeline


def test_an_alarm_raised_by_the_users_handler_passes_through_a_check():
    class Stop(Exception):
        pass

    def on_violation(result):
        raise Stop(result.findings[0].code)

    model, optimizer, loader, _ = make_private_digits(seed=0)
    PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=3, on_violation=on_violation,
                   checks=[*default_checks(), LearningRateCeiling(0.01)])
    with pytest.raises(Stop, match="learning_rate"):
        train_steps(model, optimizer, loader, 3)


def test_a_check_that_does_not_run_the_step_has_it_run_for_it():
    class Skips(Check):
        name = "skips"

        def around_step(self, step, run_step):
            return None

    with pytest.warns(CheckStoppedWarning, match="around_step returned without running the step"):
        model, result = audited_run([*default_checks(), Skips()])
    assert same_parameters(model, plain_model())
    assert result.checks_stopped[0][0] == "skips" and result.steps == STEPS


def lightning_run(precision: str, **options):
    import pytorch_lightning as pl

    from lightning_dpaudit import DPAuditCallback

    model, optimizer, loader, _ = make_private_digits(seed=0)

    callback = DPAuditCallback(seed=3, per_sample_check_every=5, per_sample_check_budget=1.0, report=False,
                               alert=lambda result: None, **options)
    trainer = pl.Trainer(max_steps=STEPS, callbacks=[callback], precision=precision, enable_progress_bar=False,
                         logger=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(DigitsClassifier(model, optimizer), loader)
    return callback.auditor.result()


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_under_each_precision_plugin_every_replay_runs_in_the_steps_own_precision(precision):
    """Lightning's precision plugins on this CPU: bf16-mixed and 16-mixed autocast the step (to bfloat16 here),
    bf16-true casts the model; the replays run in the step's own context, compare, and nothing stops."""
    result = lightning_run(precision)
    assert result.checks_stopped == () and not result.violation
    assert result.data_path.startswith("3 step(s) compared, every 5 from step 1")
    assert "independence of examples (3 replays with the others replaced, through the training step)" in result.pipeline
    assert "rows per record (12 steps compared)" in result.pipeline


def test_the_callback_takes_a_users_check():
    result = lightning_run("32-true", checks=[*default_checks(), LearningRateCeiling(0.01)])
    assert result.violation and [f.code for f in result.findings] == ["learning_rate"]
    assert "learning rate ceiling (12 steps compared)" in result.pipeline


def _audited_codes(checks, *, clear_history: bool):
    """Codes of the findings of a 5-step digits run whose accountant forgets its history after step 3 (or not)."""
    model, optimizer, loader, engine = make_private_digits(seed=0)
    auditor = PrivacyAuditor(optimizer, module=model, seed=0, per_sample_check_every=0, checks=checks,
                             on_violation=lambda result: None)
    train_steps(model, optimizer, loader, 3)
    if clear_history:
        engine.accountant.history.clear()
    train_steps(model, optimizer, loader, 2)
    codes = [f.code for f in auditor.result().findings]
    status = auditor.checks.status(MECHANISM)
    auditor.detach()
    return codes, status


def test_the_accountants_history_is_compared_by_its_check_and_by_nothing_else():
    """The accountant check is the one unit comparing the history: with it a forgotten history is claim_unaccounted
    at the next step, without it (a user's own list) nothing else reports it; its status counts the comparisons."""
    codes, status = _audited_codes(None, clear_history=True)
    assert codes == ["claim_unaccounted"] and status == "accountant (4 steps' composition compared)"
    assert _audited_codes(None, clear_history=False) == ([], "accountant (4 steps' composition compared)")
    without = [c for c in default_checks() if not isinstance(c, AccountantCheck)]
    assert _audited_codes(without, clear_history=True) == ([], "")


def test_the_set_up_check_holds_the_normalisation_note():
    model, optimizer, loader, _ = make_private_digits(seed=0)  # loss_reduction="mean": the update's scale is noted
    auditor = PrivacyAuditor(optimizer, module=model, seed=0, per_sample_check_every=0)
    assert [code for code, _ in auditor.checks.notes()] == ["normalisation"]
    assert any(n.startswith("normalisation: ") for n in auditor.result().notes)
    auditor.detach()
    model, optimizer, loader, _ = make_private_digits(seed=0)
    checks = [c for c in default_checks() if not isinstance(c, SetupCheck)]
    auditor = PrivacyAuditor(optimizer, module=model, seed=0, per_sample_check_every=0, checks=checks)
    assert not any(n.startswith("normalisation: ") for n in auditor.result().notes)
    auditor.detach()


def test_a_check_with_nothing_to_do_in_this_run_is_left_out_of_its_hooks():
    """On one process the replicas' check is idle: no hook of the run calls it; the others are called."""
    from lightning_dpaudit.engine.checks.mechanism.replicas import ReplicaCheck

    model, optimizer, _, _ = make_private_digits(seed=0)
    auditor = PrivacyAuditor(optimizer, module=model, seed=0, per_sample_check_every=0)
    replicas, accountant = auditor.checks.find(ReplicaCheck), auditor.checks.find(AccountantCheck)
    assert replicas.idle and not accountant.idle
    assert all(replicas not in auditor.checks.hooks[hook] for hook in ("loader", "batch", "accumulate", "step",
                                                                       "around_step"))
    assert replicas in auditor.checks.hooks["status"]  # what it did (nothing) is still its own to say
    assert accountant in auditor.checks.hooks["step"]
    auditor.detach()


ATTACHING = [type(check) for check in default_checks() if "attach" in vars(type(check))]


@pytest.mark.parametrize("kind", ATTACHING, ids=[kind.__name__ for kind in ATTACHING])
def test_a_default_check_whose_attach_raises_is_stopped_alone(kind, monkeypatch):
    def broken(self, run):
        raise RuntimeError(f"broken attach of {type(self).__name__}")

    monkeypatch.setattr(kind, "attach", broken)  # before the auditor binds the checks' hooks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, result = audited_run(None)
    assert same_parameters(model, plain_model())
    assert result.audit_failed is None and not result.violation  # the canaries and the other checks went on
    assert [detail for _, detail in result.checks_stopped] == [f"stopped at step 0: RuntimeError: broken attach of "
                                                                f"{kind.__name__}"]
    assert result.steps == STEPS and result.n_in + result.n_out > 0
