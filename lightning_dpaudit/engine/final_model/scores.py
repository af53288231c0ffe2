"""Per-canary scores from a model: larger = more likely trained on.

For canary i with input x_i, label y_i, model outputs z = f(x_i) and per-example loss
l_i = loss_fn(z, y_i) (default cross-entropy, -log softmax(z)_{y_i}):

    loss          -l_i
    logit_margin  z_{y_i} - max_{j != y_i} z_j
    loss_change   l_i(theta_0) - l_i(theta), theta_0 the model at record_start
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..canaries.input_canaries import hooks_disabled


def cross_entropy(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-example cross-entropy (reduction="none")."""
    return F.cross_entropy(outputs, labels, reduction="none")


@contextlib.contextmanager
def evaluating(model: nn.Module):
    """The model in eval mode, no gradients, no Opacus per-sample hooks; each submodule's mode restored after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), hooks_disabled(model):
            yield
    finally:
        for module, training in modes:
            module.training = training


def _placement(model: nn.Module):
    param = next(iter(model.parameters()), None)
    if param is None:
        return torch.device("cpu"), None
    return param.device, param.dtype if param.is_floating_point() else None


def outputs_and_losses(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, *, loss_fn: Optional[Callable],
                       batch_size: int):
    """(outputs (m, C), losses (m,)) on the CPU in float64, the model called in batches of batch_size."""
    loss_fn = loss_fn or cross_entropy
    device, dtype = _placement(model)
    outputs, losses = [], []
    with evaluating(model):
        for start in range(0, len(inputs), batch_size):
            x = inputs[start : start + batch_size].to(device)
            if dtype is not None and x.is_floating_point():
                x = x.to(dtype)
            y = labels[start : start + batch_size].to(device)
            z = model(x)
            if not torch.is_tensor(z) or z.dim() != 2 or len(z) != len(x):
                got = tuple(z.shape) if torch.is_tensor(z) else type(z).__name__
                raise ValueError(
                    f"the model must map {len(x)} canary inputs to logits of shape ({len(x)}, classes); got {got}"
                )
            if z.shape[1] < 2 or int(y.max()) >= z.shape[1]:
                raise ValueError(f"canary labels reach {int(y.max())} but the model has {z.shape[1]} outputs")
            loss = loss_fn(z, y)
            if not torch.is_tensor(loss) or loss.shape != (len(x),):
                got = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
                raise ValueError(
                    f"Unexpected value for `loss_fn`: it returned {got} for {len(x)} canaries; it must return one "
                    "loss per example (reduction='none')"
                )
            outputs.append(z.detach().to("cpu", torch.float64))
            losses.append(loss.detach().to("cpu", torch.float64))
    return torch.cat(outputs), torch.cat(losses)


def logit_margin(outputs: torch.Tensor, labels: torch.Tensor) -> np.ndarray:
    """z_y - max_{j != y} z_j per row."""
    rows = torch.arange(len(labels))
    own = outputs[rows, labels]
    others = outputs.clone()
    others[rows, labels] = -torch.inf
    return (own - others.max(dim=1).values).numpy()


def score_canaries(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, *, loss_fn: Optional[Callable],
                   batch_size: int, start_losses: Optional[np.ndarray] = None) -> Dict[str, np.ndarray]:
    """{"loss", "logit_margin"[, "loss_change"]}: float64 arrays (m,), in canary order."""
    outputs, losses = outputs_and_losses(model, inputs, labels, loss_fn=loss_fn, batch_size=batch_size)
    scores = {"loss": -losses.numpy(), "logit_margin": logit_margin(outputs, labels)}
    if start_losses is not None:
        scores["loss_change"] = start_losses - losses.numpy()
    return scores


def canary_losses(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, *, loss_fn: Optional[Callable],
                  batch_size: int) -> np.ndarray:
    """Per-canary losses l_i (float64, (m,))."""
    return outputs_and_losses(model, inputs, labels, loss_fn=loss_fn, batch_size=batch_size)[1].numpy()
