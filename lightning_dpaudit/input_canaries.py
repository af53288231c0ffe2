"""Input-space canaries: real examples whose gradient the auditor watches (Tight Auditing, App. C.3).

Kinds, each a (input, label) pair built from a few in-distribution examples the auditor
may see:

    mislabeled   a held-out example with a different label
    blank        an all-zero input with a chosen label
    adversarial  a held-out example pushed by PGD to raise its own loss (L-inf ball)
    crafted      Algorithm 3: from example x, gradient steps on x that minimise
                 |cos(grad_theta l(theta; x, y), g_dist)|, g_dist the mean gradient of
                 the in-distribution sample, so the canary's gradient is nearly
                 orthogonal to what the data pushes

The model used here is a plain nn.Module (an Opacus GradSampleModule is unwrapped); the
parameters are not changed.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import nn

INPUT_KINDS = ("mislabeled", "blank", "adversarial", "crafted")


def _plain(model: nn.Module) -> nn.Module:
    return getattr(model, "_module", model)


def flat_gradient(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, *, create_graph=False):
    """grad_theta loss(model(x), y) as one flat vector (sum over the batch)."""
    params = [p for p in _plain(model).parameters() if p.requires_grad]
    loss = loss_fn(_plain(model)(x), y)
    grads = torch.autograd.grad(loss, params, create_graph=create_graph)
    return torch.cat([g.reshape(-1) for g in grads])


def gradient_cosine(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, reference: torch.Tensor) -> float:
    """cos(grad_theta l(x, y), reference) for one example."""
    g = flat_gradient(model, loss_fn, x, y)
    return float(torch.nn.functional.cosine_similarity(g, reference, dim=0))


def mean_gradient(model: nn.Module, loss_fn: Callable, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """g_dist: the mean per-example gradient of the in-distribution sample."""
    return flat_gradient(model, loss_fn, inputs, labels).detach() / len(inputs)


def _check_sample(inputs: torch.Tensor, labels: torch.Tensor, num_classes: int) -> None:
    if inputs is None or len(inputs) == 0:
        raise ValueError("input canaries need a sample of in-distribution inputs (`inputs`), got none")
    if len(inputs) != len(labels):
        raise ValueError(f"`inputs` has {len(inputs)} examples but `labels` has {len(labels)}")
    if labels.dtype not in (torch.int64, torch.int32) or labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"`labels` must be integers in [0, {num_classes}); got {labels.dtype} in [{labels.min()}, {labels.max()}]")


def make_input_canary(
    kind: str,
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_classes: int,
    loss_fn: Optional[Callable] = None,
    steps: int = 50,
    step_size: float = 0.05,
    epsilon: float = 0.3,
    generator: Optional[torch.Generator] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One canary (input of shape inputs[0].shape, label) of the given kind.

    inputs/labels: in-distribution examples the auditor may see; the canary is built
    from one of them (held out from training by the caller). steps/step_size: the
    optimisation of "adversarial" (PGD within an L-inf ball of radius epsilon) and
    "crafted" (Algorithm 3).
    """
    if kind not in INPUT_KINDS:
        raise ValueError(f"Unexpected value for `canary`: {kind!r}; input canary kinds are {', '.join(INPUT_KINDS)}")
    _check_sample(inputs, labels, num_classes)
    loss_fn = loss_fn or nn.CrossEntropyLoss(reduction="sum")
    pick = int(torch.randint(len(inputs), (1,), generator=generator))
    x, y = inputs[pick : pick + 1].clone(), labels[pick : pick + 1].clone()
    if kind == "blank":
        return torch.zeros_like(x[0]), y[0]
    if kind == "mislabeled":
        shift = int(torch.randint(1, num_classes, (1,), generator=generator))
        return x[0], (y[0] + shift) % num_classes
    if kind == "adversarial":
        return _pgd(model, loss_fn, x, y, steps=steps, step_size=step_size, radius=epsilon)[0], y[0]
    reference = mean_gradient(model, loss_fn, inputs, labels)
    return _craft(model, loss_fn, x, y, reference, steps=steps, step_size=step_size)[0], y[0]


def _pgd(model, loss_fn, x, y, *, steps, step_size, radius):
    start = x.detach()
    x = start.clone()
    for _ in range(steps):
        x.requires_grad_(True)
        (grad,) = torch.autograd.grad(loss_fn(_plain(model)(x), y), x)
        x = (x.detach() + step_size * grad.sign()).clamp(start - radius, start + radius)
    return x.detach()


def _craft(model, loss_fn, x, y, reference, *, steps, step_size):
    """Algorithm 3: x <- x - eta * grad_x |cos(grad_theta l(x, y), g_dist)| (Adam steps)."""
    x = x.detach().clone().requires_grad_(True)
    optimizer = torch.optim.Adam([x], lr=step_size)
    for _ in range(steps):
        g = flat_gradient(model, loss_fn, x, y, create_graph=True)
        objective = torch.nn.functional.cosine_similarity(g, reference, dim=0).abs()
        optimizer.zero_grad()
        objective.backward(inputs=[x])
        optimizer.step()
    return x.detach()
