"""What DPAuditCallback writes while and after it audits: metrics through the Trainer's loggers,
TensorBoard's charts, histograms, figures and texts, and the report at the end of fit.

AuditLogging is a mixin of DPAuditCallback: it reads the callback's `auditor`, `history`,
`log_every_n_steps`, `budget` (the share of wall time the slow logging may take),
`final_model` and `auditor_options`.
"""

from __future__ import annotations

import math
from pathlib import Path

from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from ..analysis.monitor import POOLED
from ..analysis.results import AuditResult
from .logged_values import (
    EPSILON_STEPS_TAG,
    _add_histogram,
    _finite,
    _plain,
    _versions,
    chart_layout,
    epsilon_steps_text,
)
from .trainer_lookup import log_dir


class AuditLogging:
    """The callback's logging: each log step's metrics, the epsilon curves, the figure, the end-of-fit report."""

    @rank_zero_only
    def _add_chart_layout(self, trainer) -> None:
        """TensorBoard's Custom Scalars tab: both epsilons on one chart, both mus on another; and, once, where
        TensorBoard shows the run."""
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_custom_scalars(chart_layout(self.log_every_n_steps, self.budget.share))
                if not getattr(self, "_pointed", False):
                    self._pointed = True
                    print(f"DP audit: see it in TensorBoard with  tensorboard --logdir {logger.log_dir}")

    def _log_end(self, trainer, pl_module, result: AuditResult) -> None:
        if result.audit_failed:
            self._log_failure(trainer, result.audit_failed)
        if self.auditor.steps != self._last_logged():
            self._log(trainer, pl_module, result, progress_bar=False)
        elif not self.history or self.history[-1]["step"] != result.steps:
            self._log_epsilons(trainer, result)  # the last log step skipped them for the budget
        self._log_epsilon_steps(trainer, result.steps)

    @rank_zero_only
    def _log_epsilon_steps(self, trainer, last_step: int) -> None:
        steps = [int(h["step"]) for h in self.history]
        text = epsilon_steps_text(steps, self.log_every_n_steps, last_step, self.budget.share)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(EPSILON_STEPS_TAG, text, last_step)

    @rank_zero_only
    def _log_failure(self, trainer, cause: str) -> None:
        """The audit's failure as text in TensorBoard, once."""
        if self._logged_failure:
            return
        self._logged_failure = True
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("dpaudit/audit_failed", cause, self.auditor.steps)

    def _last_logged(self) -> int:
        return getattr(self, "_logged_step", -1)

    def _log(self, trainer, pl_module, result: AuditResult, progress_bar: bool = True) -> None:
        step = result.steps
        if math.isfinite(result.epsilon_accountant):
            self._remember_epsilons(result)
        self._logged_step = step
        metrics = {
            "dpaudit/eps_lower_bound": result.epsilon_lower_bound,
            "dpaudit/eps_accountant": result.epsilon_accountant,
            "dpaudit/eps_sampling": result.epsilon_sampling,  # under the sampling used, where not the accountant's
            "dpaudit/mu_lower_bound": result.mu_lower_bound,
            "dpaudit/mu_claimed": result.mu_claimed,
            "dpaudit/n_observations": float(result.n_in + result.n_out),
            "dpaudit/violation": float(result.violation),
        }
        for layer in result.layers:
            metrics[f"dpaudit/layers/{layer.name}/mu_lower_bound"] = layer.mu_lower_bound
        self._write_metrics(trainer, _finite(metrics), step)
        if progress_bar:
            # the epsilons are from the last step they were computed at, not the bar's: eps_step says which, and
            # moves only with them (a step whose accounting the time budget skipped leaves all three as they were)
            bar = {"eps_low": result.epsilon_lower_bound, "eps_acc": result.epsilon_accountant}
            if all(math.isfinite(v) for v in bar.values()):
                pl_module.log_dict({**bar, "eps_step": float(step)}, prog_bar=True, logger=False)

    def _remember_epsilons(self, result: AuditResult) -> None:
        self.history.append(
            {"step": result.steps, "eps_lower_bound": result.epsilon_lower_bound, "eps_accountant": result.epsilon_accountant}
        )

    def _log_epsilons(self, trainer, result: AuditResult) -> None:
        self._remember_epsilons(result)
        metrics = _finite({"dpaudit/eps_lower_bound": result.epsilon_lower_bound, "dpaudit/eps_accountant": result.epsilon_accountant})
        if metrics:
            self._write_metrics(trainer, metrics, result.steps, histograms=False)

    @rank_zero_only
    def _write_metrics(self, trainer, metrics: dict, step: int, histograms: bool = True) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        if not histograms:
            return
        edges, ins, outs = self.auditor.log.histogram()
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and ins.any():
                _add_histogram(logger.experiment, "dpaudit/observations_in", edges, ins, step)
                _add_histogram(logger.experiment, "dpaudit/observations_out", edges, outs, step)

    @rank_zero_only
    def _log_figure(self, trainer) -> None:
        loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers:
            return
        from ..analysis.report import tradeoff_figure

        mu_lower = self.auditor.recorded().monitor.bounds.get(POOLED)
        histogram = self.auditor.log.histogram()
        figure = tradeoff_figure(histogram=histogram, mu_claimed=self.auditor.results.claim.mu_claimed, mu_lower=mu_lower)
        for logger in loggers:  # report figures are not registered with pyplot: nothing to close
            logger.experiment.add_figure("dpaudit/tradeoff", figure, self.auditor.steps, close=False)

    @rank_zero_only
    def _write_report(self, trainer, result: AuditResult) -> None:
        from ..analysis.report import summary_table, write_report

        directory = Path(log_dir(trainer))
        section = self.final_model.report_section() if self.final_model is not None else None
        json_path, png_path = write_report(
            directory,
            result,
            settings={"alert": self.alert if isinstance(self.alert, str) else "callable", **_plain(self.auditor_options)},
            versions=_versions(),
            history=self.history,
            histogram=self.auditor.log.histogram(),
            final_model=section,
        )
        self.report_paths = (json_path, png_path)
        bar = trainer.progress_bar_callback  # a live bar (Rich) would redraw its last numbers below the summary
        if bar is not None:
            bar.teardown(trainer, trainer.lightning_module, "fit")  # stops it as Lightning's teardown does, once
        print(summary_table({"result": result.to_dict(), **({"final_model": section} if section else {})}))
        print(f"audit report: {json_path} and {png_path}")
