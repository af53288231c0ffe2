"""DPAuditCallback: the PrivacyAuditor inside a Lightning Trainer, with logging and alerts.

Add it to `pl.Trainer(callbacks=[DPAuditCallback()])`. At fit start it finds the Opacus
DPOptimizer among the Trainer's optimizers (and the accountant that make_private hooked
to it), attaches a PrivacyAuditor, then logs the running audit every
`log_every_n_steps` optimizer steps through the Trainer's loggers, alerts once when the
anytime-valid alarm fires, and at the end of fit checks once more (a violation recorded
since the last check alerts then) and writes audit_report.json/.png. An error of the
audit's own code during training (the pipeline's, or a hook's here) never ends the fit:
one AuditFailedWarning, and the result's `audit_failed` names it.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Optional, Union

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.utilities.rank_zero import rank_zero_only, rank_zero_warn

from ..analysis.results import AuditResult, violation_message
from ..engine.auditor import PrivacyAuditor, PrivacyViolationWarning
from ..engine.canaries.input_canaries import show_progress
from ..engine.checks.runner import check_checks
from ..engine.options import SETTINGS, check_accountant, check_settings, flag, integer, one_argument_callable, real
from ..engine.step.pipeline import AuditFailedWarning
from ..engine.support.user_warning import warn_at_user_code
from .budget import TimeBudget
from .callback_logging import AuditLogging
from .callback_state import AuditCheckpointing
from .final_model_audit import FinalModelTracker
from .trainer_lookup import (
    batches_per_epoch,
    check_accountant_matches,
    find_dp_optimizer,
    module_accountant,
    other_optimizers,
    step_replay,
    training_loader,
)

ALERTS = ("warn", "raise", "stop")
LOG = logging.getLogger("lightning_dpaudit")  # the alert's one line under alert="stop", at WARNING
ALERT_TAG = "dpaudit/alert"  # the alert's line as TensorBoard text


_warn_at_user_code = rank_zero_only(warn_at_user_code)


def check_optimizer_trained(optimizer, optimizers) -> None:
    """The optimizer passed must be one the Trainer steps: an audit of another optimizer would watch no step of
    this fit and report on it all the same."""
    from ..engine.options import unwrapped_optimizer

    inner = unwrapped_optimizer(optimizer)
    if not any(unwrapped_optimizer(o) is inner for o in optimizers):
        names = ", ".join(type(o).__name__ for o in optimizers) or "none"
        raise ValueError(
            f"Unexpected value for `optimizer`: the {type(inner).__name__} passed is not one of the Trainer's "
            f"optimizers ({names}), so no step of this fit would be audited; pass the optimizer that "
            "configure_optimizers returns, or None to find it"
        )


def check_optimizer(optimizer) -> None:
    """None (found among the Trainer's optimizers at fit start), or an Opacus DPOptimizer, in Lightning's wrapper or not."""
    if optimizer is None:
        return
    from opacus.optimizers import DPOptimizer

    from ..engine.options import unwrapped_optimizer

    if not isinstance(unwrapped_optimizer(optimizer), DPOptimizer):
        raise TypeError(
            f"Unexpected value for `optimizer`: {type(optimizer).__name__}; pass the Opacus DPOptimizer returned by "
            "PrivacyEngine.make_private, or None to find it among the Trainer's optimizers at fit start"
        )


class PrivacyViolationError(RuntimeError):
    """Raised by DPAuditCallback(alert="raise") when the audit finds a leak."""


class DPAuditCallback(AuditLogging, AuditCheckpointing, Callback):
    """Audit the Trainer's Opacus DPOptimizer while it trains.

    alert: "warn" (one PrivacyViolationWarning), "raise" (PrivacyViolationError), "stop" (end
    training cleanly) or a callable receiving the AuditResult; each fires once. "warn" is one
    line, "DP AUDIT VIOLATION found at step N (first violating step M): <cause>; <numbers>",
    attributed to the user's code that runs the Trainer (the findings on the lines below it);
    "stop" logs that line, and that training stopped, through the `logging` logger
    "lightning_dpaudit". Both also write it, with a TensorBoard logger, as text under
    "dpaudit/alert".
    logging_budget: the share of wall time the epsilon curves and figures may take; the
    accountant's epsilon (slow with PRV) and the trade-off figure are skipped at a log
    step when they would exceed it, and logged at the next step that fits.
    optimizer / accountant: pass them when the callback cannot find them.
    checkpoint_noise_generator: save the optimizer's noise generator (the torch.Generator
    given to make_private as noise_generator) in the callback's checkpoint state and
    restore it on resume, so that a resumed run does not replay earlier noise. Without
    such a generator (the noise comes from torch's global generator, or from the OS in
    secure mode) it warns once and saves nothing (docs/resuming.md).
    final_model_canaries: a FinalModelCanaries whose wrap() made the training data: the
    trained model scores them at the end of fit (and every `final_model_every_n_epochs`
    epochs) for the final-model bound, logged and reported beside the step audit's.
    auditor_options: passed to PrivacyAuditor (delta, confidence, canary, mode, ...). Input
    canaries go through the LightningModule's forward unless `module=` names another model.
    """

    def __init__(
        self,
        *,
        alert: Union[str, Callable[[AuditResult], Any]] = "warn",
        log_every_n_steps: int = 50,
        accountant=None,
        optimizer=None,
        report: bool = True,
        logging_budget: float = 0.02,
        checkpoint_noise_generator: bool = False,
        final_model_canaries=None,
        final_model_every_n_epochs: Optional[int] = None,
        **auditor_options,
    ):
        if callable(alert):
            one_argument_callable("alert", alert)
        elif alert not in ALERTS:
            raise ValueError(f"Unexpected value for `alert`: {alert!r}; use one of {', '.join(ALERTS)} or a callable")
        if "on_violation" in auditor_options:
            raise ValueError("Unexpected option(s) for DPAuditCallback: on_violation; use `alert` (a callable is called with the AuditResult)")
        unknown = sorted(set(auditor_options) - set(inspect.signature(PrivacyAuditor).parameters))
        if unknown:
            raise ValueError(
                f"Unexpected option(s) for DPAuditCallback: {', '.join(unknown)}; it takes alert, "
                "log_every_n_steps, accountant, optimizer, report, logging_budget, checkpoint_noise_generator, "
                "final_model_canaries, final_model_every_n_epochs and PrivacyAuditor's options"
            )
        check_accountant(accountant)
        check_optimizer(optimizer)
        defaults = {name: p.default for name, p in inspect.signature(PrivacyAuditor).parameters.items() if name in SETTINGS}
        settings = {name: value for name, value in auditor_options.items() if name in SETTINGS}
        check_settings(**{**defaults, **settings})  # PrivacyAuditor's own checks, now rather than at fit start
        if auditor_options.get("checks") is not None:
            check_checks(auditor_options["checks"])
        self.alert = alert
        self.log_every_n_steps = integer("log_every_n_steps", log_every_n_steps, 1)
        self.budget = TimeBudget(real("logging_budget", logging_budget, low=0.0, high=1.0, high_open=False))
        self.accountant = accountant
        self.optimizer = optimizer
        self.report = flag("report", report)
        self.checkpoint_noise_generator = flag("checkpoint_noise_generator", checkpoint_noise_generator)
        self._warned_generator = False
        self.auditor_options = auditor_options
        every = None if final_model_every_n_epochs is None else integer("final_model_every_n_epochs", final_model_every_n_epochs, 1)
        self.final_model = None if final_model_canaries is None else FinalModelTracker(final_model_canaries, every)
        self.auditor: Optional[PrivacyAuditor] = None
        self.history: list = []
        self.alerted = False
        self._pending_state: Optional[dict] = None
        self._trainer: Optional[pl.Trainer] = None
        self._passed: Optional[BaseException] = None  # raised by the alert: passed on
        self._warned_failure = False
        self._logged_failure = False

    @property
    def state_key(self) -> str:
        """One key whatever the options: a run has one audit, and a resume with other settings must
        be told so by name (the auditor's state records its set-up) rather than start over silently."""
        return "DPAuditCallback"

    # ------------------------------------------------------------------ set-up

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.final_model is not None and stage == "fit" and trainer.world_size > 1:
            self.final_model.share_seed(trainer.strategy)  # before configure_optimizers builds the data loader

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = self.optimizer if self.optimizer is not None else find_dp_optimizer(trainer.optimizers)
        if self.optimizer is not None:
            check_optimizer_trained(self.optimizer, trainer.optimizers)
        accountant = self.accountant if self.accountant is not None else module_accountant(pl_module)
        check_accountant_matches(accountant, optimizer)
        self._trainer = trainer
        options = dict(self.auditor_options)
        module = options.pop("module", pl_module)  # input canaries go through its forward
        self.auditor = PrivacyAuditor(
            optimizer, accountant=accountant, module=module, on_violation=self._on_violation,
            other_optimizers=other_optimizers(trainer.optimizers, optimizer), **options
        )
        show_progress(self.auditor.options.canary, trainer.progress_bar_callback is not None and trainer.is_global_zero)
        if self._pending_state is not None:
            try:
                self._restore(self._pending_state)
            except Exception:
                self.auditor.detach()  # the resumed fit stops here, with the optimizer as it was
                self.auditor = None
                raise
            self._pending_state = None
        self._add_chart_layout(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Leave the optimizer as it was, whatever ended the fit (PrivacyViolationError included)."""
        if self.auditor is not None:
            self.auditor.detach()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.auditor is not None and trainer.world_size > 1:
            self.auditor.check_sample_rate(batches_per_epoch(trainer))
        if self.auditor is not None:
            self._safely("on_train_start", self.auditor.loader, training_loader(trainer))
        if self.final_model is not None:
            self.final_model.start(self.auditor_options.get("module", pl_module))  # the model that scores the canaries

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.auditor is not None and stage == "fit":
            self.auditor.detach()

    # ------------------------------------------------------------------ during training

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.auditor is not None and not trainer.sanity_checking:
            self._safely("on_train_batch_start", self.auditor.batch, batch, step_replay(pl_module, batch_idx))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.auditor is None or trainer.sanity_checking:
            return
        self._safely("on_train_batch_end", self._batch_end, trainer, pl_module)

    def _batch_end(self, trainer, pl_module) -> None:
        if self.auditor.failed:
            self._log_failure(trainer, self.auditor.failed)
        if self.auditor.steps and self.auditor.steps % self.log_every_n_steps == 0 and self.auditor.steps != self._last_logged():
            with self.budget.spend("epsilon") as allowed:
                result = self.auditor.result(accounting=allowed)
                self._log(trainer, pl_module, result)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.auditor is not None:
            self._safely("on_train_epoch_end", self._epoch_end, trainer)

    def _epoch_end(self, trainer) -> None:
        if self.final_model is not None and self.final_model.due(trainer.current_epoch):
            self.final_model.audit(trainer, self.auditor.steps, self.auditor.result())
        if self.auditor.steps:
            with self.budget.spend("figure") as allowed:
                if allowed:
                    self._log_figure(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.auditor is None or not self.auditor.steps:
            return
        try:  # the last steps' violation, recorded since the last check, alerts as `alert` says
            self._safely("the final check", self.auditor.check)
        finally:  # the report is written whatever the alert does
            result = self._safely("on_fit_end", self.auditor.result)
            if result is not None:
                self._safely("on_fit_end", self._log_end, trainer, pl_module, result)
                self._safely("the final-model audit", self._final_model_end, trainer, result)
                if self.report:
                    self._safely("the report", self._write_report, trainer, result)

    def _final_model_end(self, trainer, result: AuditResult) -> None:
        if self.final_model is None:
            return
        final = self.final_model.audit(trainer, self.auditor.steps, result)
        if final.violation and not self.alerted:
            if self.alert == "raise":
                raise PrivacyViolationError(final.violation_message())
            rank_zero_warn(final.violation_message(), category=PrivacyViolationWarning)

    # ------------------------------------------------------------------ alerts

    def _on_violation(self, result: AuditResult) -> None:
        if self.alerted:
            return
        self.alerted = True
        try:
            self._alert(result)
        except BaseException as error:
            self._passed = error
            raise

    def _alert(self, result: AuditResult) -> None:
        message = violation_message(result)
        if callable(self.alert):
            self.alert(result)
        elif self.alert == "warn":
            self._announce(message, result.steps, log=False)  # the warning is the one line shown
            _warn_at_user_code(message, PrivacyViolationWarning)
        elif self.alert == "raise":
            raise PrivacyViolationError(message)
        else:
            trainer = self._trainer
            if trainer is not None:
                trainer.should_stop = True
            self._announce(message, result.steps, log=True)

    @rank_zero_only
    def _announce(self, message: str, step: int, *, log: bool) -> None:
        """The alert's headline as TensorBoard text with the findings below it, and with `log` as one log record:
        the headline saying that training stops, the findings below it."""
        headline, *findings = message.splitlines()
        if log:
            LOG.warning("\n".join([f"{headline}; training stopped by DPAuditCallback(alert=\"stop\")", *findings]))
        trainer = self._trainer
        for logger in trainer.loggers if trainer is not None else ():
            if isinstance(logger, TensorBoardLogger):
                text = "**" + headline + "**" + "".join(f"\n\n{line.strip()}" for line in findings)
                logger.experiment.add_text(ALERT_TAG, text, step)

    # ------------------------------------------------------------------ faults

    def _safely(self, where: str, hook, *args):
        """hook(*args); an error of the audit's own code is warned once and recorded, never raised (the
        alert's own errors, and the user's, are); then None."""
        try:
            return hook(*args)
        except Exception as error:
            if error is self._passed or isinstance(error, PrivacyViolationError):
                raise
            cause = f"{where}: {type(error).__name__}: {error} at step {self.auditor.steps}"
            self.auditor.note_failure(cause)
            if not self._warned_failure:
                self._warned_failure = True
                rank_zero_warn(f"the privacy audit's {cause}; training goes on, the audit's record may be incomplete",
                               category=AuditFailedWarning)
