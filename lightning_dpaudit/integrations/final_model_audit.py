"""The final-model audit inside DPAuditCallback: score the canaries, log and keep the bounds.

At the start of training the canaries' losses are recorded (the "loss_change" score);
every `every_n_epochs` epochs, and at the end of fit, the model scores them and the
one-run estimators bound epsilon (analysis/final_model.py). Only the end-of-fit bound is
compared with the accountant's epsilon; the bounds during training draw a curve.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger

from ..analysis.final_model import FinalModelResult
from ..analysis.schema import Field, Section
from ..engine.final_model.canaries import FINAL_MODEL
from .logged_values import _add_histogram

# FinalModelTracker's state: the canaries' (FINAL_MODEL) and the bounds logged during training.
FINAL_MODEL_TRACKER = Section(
    "final_model", Field("canaries", FINAL_MODEL),
    Field("history", "list", items=Field("entry", "map", items=Field("value", "real", low=0.0, finite=False, null=True)),
          optional=True),
)

PREFIX = "dpaudit/final_model"


class FinalModelTracker:
    """Holds a FinalModelCanaries for the callback: when to score, what to log and save."""

    def __init__(self, canaries, every_n_epochs: Optional[int] = None, selection: str = "union"):
        from ..engine.final_model import FinalModelCanaries

        if not isinstance(canaries, FinalModelCanaries):
            raise ValueError(
                f"Unexpected value for `final_model_canaries`: {type(canaries).__name__}; pass a FinalModelCanaries "
                "whose wrap() made the training data"
            )
        self.canaries = canaries
        self.every_n_epochs = every_n_epochs
        self.selection = selection
        self.history: list = []
        self.result: Optional[FinalModelResult] = None
        self.model = None

    def start(self, model) -> None:
        """Score through `model` from now on; the canaries' losses before the first step (kept
        from a checkpoint on resume). Called at train start, when the training data loader is built:
        canaries that wrap() never added to the training data are refused here, before any step."""
        if not self.canaries.wrapped:
            raise ValueError(
                "Unexpected value for `final_model_canaries`: its wrap() made no training dataset, so no canary "
                "is trained on and the final-model bound would measure nothing; train on "
                "CanaryDataModule(your_datamodule, canaries) (lightning_dpaudit.CanaryDataModule), or on a DataLoader "
                "over canaries.wrap(train_dataset)"
            )
        if type(model).forward in (torch.nn.Module.forward, pl.LightningModule.forward):
            raise ValueError(
                f"final-model canaries are scored through the model's forward, and {type(model).__name__} defines none: "
                "add forward() to the LightningModule or pass DPAuditCallback(module=<the model>)"
            )
        self.model = model
        if self.canaries.start_losses is None:
            self.canaries.record_start(model)

    def share_seed(self, strategy) -> None:
        """Every process trains on the same canaries: rank 0's secret seed, set before the data is first read."""
        state = self.canaries.state_dict()
        seed = strategy.broadcast(state["seed"], src=0)
        if seed != state["seed"]:
            self.canaries.load_state_dict({**state, "seed": seed})

    def due(self, epoch: int) -> bool:
        return bool(self.every_n_epochs) and (epoch + 1) % self.every_n_epochs == 0

    def audit(self, trainer, step: int, step_audit) -> FinalModelResult:
        """Score the canaries with the model as it is at optimizer step `step`, bound epsilon at the
        step audit's delta and confidence against its accountant's epsilon, add the point to the
        curve and log it (rank 0). A second call at the same step (the last epoch's end was the
        end of fit) returns the first result."""
        if self.result is not None and self.result.step == step:
            return self.result
        claim = step_audit.epsilon_accountant if math.isfinite(step_audit.epsilon_accountant) else None
        epoch = trainer.current_epoch
        result = self.canaries.audit(
            self.model, delta=step_audit.delta, confidence=step_audit.confidence, accountant_epsilon=claim,
            epoch=epoch, step=step, selection=self.selection,
        )
        self.result = result
        self.history = [h for h in self.history if h["step"] != step]  # a resumed run may repeat a step
        self.history.append({
            "epoch": epoch, "step": step, "eps_lower_bound": result.epsilon_lower_bound,
            "eps_lower_bound_fdp_if_gaussian": result.bounds["fdp"].epsilon, "eps_accountant": claim,
        })
        if trainer.is_global_zero:
            self.log(trainer, result)
        return result

    def log(self, trainer, result: FinalModelResult) -> None:
        """Both bounds as scalars (the f-DP one tagged "_if_gaussian": it assumes a Gaussian trade-off
        curve) and the included / excluded score histograms in TensorBoard."""
        metrics = {f"{PREFIX}/eps_lower_bound": result.epsilon_lower_bound,
                   f"{PREFIX}/eps_lower_bound_fdp_if_gaussian": result.bounds["fdp"].epsilon}
        metrics = {k: float(v) for k, v in metrics.items() if math.isfinite(v)}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=result.step)
            if isinstance(logger, TensorBoardLogger):
                score = result.bounds["steinke"].score
                edges, ins, outs = result.histograms[score]
                edges = np.concatenate([[-np.inf], edges, [np.inf]])  # no under- or overflow: the bins span all scores
                for name, counts in (("scores_trained_on", ins), ("scores_not_trained_on", outs)):
                    _add_histogram(logger.experiment, f"{PREFIX}/{name}", edges, np.concatenate([[0], counts, [0]]), result.step)

    def report_section(self) -> Optional[dict]:
        if self.result is None:
            return None
        return {**self.result.to_dict(), "history": list(self.history)}

    def state_dict(self) -> dict:
        return FINAL_MODEL_TRACKER.dump({"canaries": self.canaries.state_dict(), "history": list(self.history)})

    def load_state_dict(self, state: dict) -> None:
        self.canaries.load_state_dict(state["canaries"])
        self.history = list(state.get("history", []))
