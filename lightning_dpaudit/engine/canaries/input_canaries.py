"""Input-space canaries: real examples whose gradient the auditor watches (Tight Auditing, App. C.3).

Kinds, each a batch of (input, label) pairs built from a few in-distribution examples
the auditor may see (held out from training):

    mislabeled   held-out examples with a different label
    blank        all-zero inputs, labels cycling through the classes
    adversarial  held-out examples pushed by PGD to raise their own loss (L-inf ball)
    crafted      Algorithm 3: from held-out examples x, Adam steps on x that minimise
                 |cos(grad_theta l(theta; x, y), g_dist)|, g_dist the mean gradient of
                 the in-distribution sample, so each canary's gradient is nearly
                 orthogonal to what the data pushes; here also to each other's, and
                 with a wrong label, so that the gradient stays above the clipping bound

Everything here reads the model's parameters and never changes them. A model wrapped by
Opacus (a GradSampleModule, or a module whose submodules carry its hooks) has its
per-sample-gradient hooks switched off while canaries are built.

Crafting takes seconds before the first step; when asked (InputCanaries(progress=True), or
show_progress from a run with a progress bar) the first build of "adversarial" and
"crafted" canaries shows its progress on stdout: a tqdm bar on a terminal, otherwise one
line as it starts and one as it ends. Library calls print nothing unless asked.
"""

from __future__ import annotations

import contextlib
import numbers
import sys
import time
from typing import Callable, Iterator, Optional, Tuple, Union

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

INPUT_KINDS = ("mislabeled", "blank", "adversarial", "crafted")
RECRAFT_EVERY = {"adversarial": 100, "crafted": 20}  # recraft_every="auto": noised steps between rebuilds
SPREAD = 5.0  # weight of mutual orthogonality (log det) in crafting; see docs/results.md, "Input canaries", for the measurements


def plain_module(model: nn.Module) -> nn.Module:
    """The user's module inside an Opacus GradSampleModule (the module itself otherwise)."""
    return getattr(model, "_module", model)


def grad_sample_wrapper(model: nn.Module):
    """The Opacus GradSampleModule whose hooks compute per-sample gradients for `model`, or None.

    make_private may wrap the module (the plain-PyTorch pattern returns the wrapper) or
    hook it in place and drop the wrapper (the Lightning pattern); both are found.
    """
    from opacus.grad_sample import GradSampleModule

    if isinstance(model, GradSampleModule):
        return model
    for module in model.modules():
        for hook in module._forward_hooks.values():
            owner = getattr(hook, "__self__", None)
            if isinstance(owner, GradSampleModule):
                return owner
    return None


def progress_steps(steps: int, description: str, show: bool = True) -> Iterator[int]:
    """range(steps), showing progress on stdout if `show`: a tqdm bar (cleared when done) on a
    terminal, otherwise one line as it starts and one as it ends."""
    if not show or steps <= 0:
        yield from range(steps)
        return
    stream = sys.stdout
    if stream.isatty():
        from tqdm import tqdm

        yield from tqdm(range(steps), desc=description, unit="step", file=stream, leave=False, dynamic_ncols=True)
        return
    start = time.perf_counter()
    print(f"{description}: {steps} optimisation steps ...", file=stream, flush=True)
    yield from range(steps)
    print(f"{description}: done in {time.perf_counter() - start:.1f} s", file=stream, flush=True)


def _owner(hook):
    return getattr(getattr(hook, "func", hook), "__self__", None)


@contextlib.contextmanager
def hooks_disabled(model: nn.Module):
    """Take Opacus's per-sample-gradient hooks off `model` for the block, put them back after.

    Plain autograd and torch.func then see the user's module alone (torch.func cannot
    trace through full backward hooks). Other hooks stay in place.
    """
    from opacus.grad_sample import GradSampleModule

    saved = []
    for module in plain_module(model).modules():
        for name in ("_forward_hooks", "_backward_hooks"):
            hooks = getattr(module, name)
            if any(isinstance(_owner(h), GradSampleModule) for h in hooks.values()):
                saved.append((module, name, hooks))
                setattr(module, name, type(hooks)((k, h) for k, h in hooks.items() if not isinstance(_owner(h), GradSampleModule)))
    try:
        yield
    finally:
        for module, name, hooks in saved:
            setattr(module, name, hooks)


def flat_gradient(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor):
    """grad_theta loss_fn(model(x), y) as one flat vector (loss_fn sums over the batch)."""
    module = plain_module(model)
    params = [p for p in module.parameters() if p.requires_grad]
    with hooks_disabled(model), torch.enable_grad():
        loss = loss_fn(module(x), y)
        grads = torch.autograd.grad(loss, params)
    return torch.cat([g.reshape(-1) for g in grads])


def mean_gradient(model: nn.Module, loss_fn: Callable, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """g_dist: the mean per-example gradient of the in-distribution sample."""
    return flat_gradient(model, loss_fn, inputs, labels).detach() / len(inputs)


def per_example_gradients(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(k, d) matrix of flat per-example gradients, differentiable in x (torch.func)."""
    module = plain_module(model)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}

    def loss_one(theta, xi, yi):
        return loss_fn(functional_call(module, theta, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    # randomness="different": each example its own dropout mask, as in a batch
    grads = vmap(grad(loss_one), in_dims=(None, 0, 0), randomness="different")(params, x, y)
    return torch.cat([grads[n].reshape(len(x), -1) for n in names], dim=1)


def check_sample(inputs: torch.Tensor, labels: torch.Tensor, num_classes: int) -> None:
    """Clear errors for an unusable in-distribution sample."""
    if inputs is None or len(inputs) == 0:
        raise ValueError("input canaries need a sample of in-distribution inputs (`inputs`), got none")
    if labels is None or len(inputs) != len(labels):
        raise ValueError(f"`inputs` has {len(inputs)} examples but `labels` has {0 if labels is None else len(labels)}")
    if not torch.is_tensor(labels) or labels.dim() != 1:
        shape = tuple(labels.shape) if torch.is_tensor(labels) else type(labels).__name__
        raise ValueError(f"`labels` must be a 1-D tensor of class indices (not one-hot); got {shape}")
    if labels.dtype not in (torch.int64, torch.int32) or labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"`labels` must be integers in [0, {num_classes}); got {labels.dtype} in [{labels.min()}, {labels.max()}]")


def make_input_canaries(
    kind: str,
    model: nn.Module,
    inputs: Optional[torch.Tensor],
    labels: Optional[torch.Tensor],
    *,
    count: int,
    num_classes: int,
    loss_fn: Optional[Callable] = None,
    steps: int = 50,
    step_size: float = 0.05,
    epsilon: float = 0.3,
    norm_floor: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    progress: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """`count` canaries (inputs of shape (count, *inputs.shape[1:]), labels) of one kind.

    inputs/labels: in-distribution examples the auditor may see (held out from training);
    "blank" needs only their shape. Source examples are drawn without replacement while
    the sample lasts. steps/step_size: the optimisation of "adversarial" (PGD within an
    L-inf ball of radius epsilon) and "crafted" (Algorithm 3, Adam); norm_floor: the
    gradient norm crafting keeps each canary above (the clipping bound C; None: no floor).
    progress: show the optimisation's progress on stdout (progress_steps).
    """
    if kind not in INPUT_KINDS:
        raise ValueError(f"Unexpected value for `canary`: {kind!r}; input canary kinds are {', '.join(INPUT_KINDS)}")
    if kind == "blank":  # the sample's shape is all it needs
        start = int(torch.randint(num_classes, (1,), generator=generator))
        return torch.zeros((count, *inputs.shape[1:]), dtype=inputs.dtype), (start + torch.arange(count)) % num_classes
    check_sample(inputs, labels, num_classes)
    loss_fn = loss_fn or nn.CrossEntropyLoss(reduction="sum")
    n = len(inputs)
    order = torch.cat([torch.randperm(n, generator=generator) for _ in range(-(-count // n))])[:count]
    x, y = inputs[order].clone(), labels[order].clone()
    if kind == "adversarial":
        return _pgd(model, loss_fn, x, y, steps=steps, step_size=step_size, radius=epsilon, progress=progress), y
    y = (y + torch.randint(1, num_classes, (count,), generator=generator)) % num_classes  # a wrong label
    if kind == "mislabeled":
        return x, y
    reference = mean_gradient(model, loss_fn, inputs, labels)
    x = craft(model, loss_fn, x, y, reference, steps=steps, step_size=step_size, norm_floor=norm_floor, progress=progress)
    return x, y


def _pgd(model, loss_fn, x, y, *, steps, step_size, radius, progress=False):
    """Signed-gradient ascent on each example's own loss, projected to the L-inf ball."""
    module = plain_module(model)
    start = x.detach()
    x = start.clone()
    with hooks_disabled(model), torch.enable_grad():
        for _ in progress_steps(steps, f"building {len(x)} adversarial input canaries", progress):
            x.requires_grad_(True)
            (step,) = torch.autograd.grad(loss_fn(module(x), y), x)
            x = (x.detach() + step_size * step.sign()).clamp(start - radius, start + radius)
    return x.detach()


def craft(model, loss_fn, x, y, reference, *, steps, step_size, spread: float = SPREAD, norm_floor=None, progress=False):
    """Algorithm 3 for a batch: Adam steps on x minimising sum_i |cos(g_i, g_dist)|.

    g_i = grad_theta l(theta; x_i, y_i). With spread > 0 the objective also has
    -spread * log det(U U^T + 1e-4 I), U the rows g_i / ||g_i||: the log determinant is
    at most 0, reached when the gradients are mutually orthogonal, and it is the sum of
    2 log of each canary's share of its direction beyond the others' (Cholesky of
    U U^T); canaries observed in the same step keep more of their strength (input_probe).
    With norm_floor C, also spread * sum_i relu(1 - ||g_i|| / C)^2: a gradient shorter
    than the clipping bound is a weaker canary. progress: show the steps' progress (progress_steps).
    """
    reference = reference / reference.norm()
    k = len(x)

    def objective(inputs):
        g = per_example_gradients(model, loss_fn, inputs, y)
        unit = g / g.norm(dim=1, keepdim=True).clamp_min(1e-12)
        value = (unit @ reference).abs().sum()
        if spread and k > 1:
            gram = unit @ unit.T + 1e-4 * torch.eye(k, dtype=unit.dtype, device=unit.device)
            value = value - spread * torch.linalg.slogdet(gram)[1]
        if norm_floor:
            value = value + spread * torch.relu(1.0 - g.norm(dim=1) / norm_floor).pow(2).sum()
        return value

    x = x.detach().clone()
    optimizer = torch.optim.Adam([x.requires_grad_(True)], lr=step_size)
    with hooks_disabled(model):
        for _ in progress_steps(steps, f"crafting {k} input canaries", progress):
            optimizer.zero_grad()
            x.grad = grad(objective)(x.detach())
            optimizer.step()
    return x.detach()


class InputCanaries:
    """Input canaries for `PrivacyAuditor(canary=...)`: which kind, from what, rebuilt when.

    kind: one of INPUT_KINDS. inputs/labels: a sample of in-distribution examples the
    auditor may see, held out from training (for "blank" only the input shape and dtype
    are used). loss_fn(outputs, labels): the training loss summed over the batch
    (default: cross-entropy). recraft_every: noised steps between rebuilds of
    "adversarial" and "crafted" canaries from the current parameters ("auto": 100 and
    20, RECRAFT_EVERY; None: build once);
    craft_steps/step_size/epsilon: their optimisation (see make_input_canaries; the
    auditor sets options["norm_floor"] to the optimizer's clipping bound); a rebuild
    of "crafted" starts from the previous canaries and takes craft_steps // 5 steps.
    num_classes: labels lie in [0, num_classes) (default: the model's output width).
    min_strength: a canary is observed in a step only if its strength F_mm / C, the share
    of its clipped direction left to it beside the other canaries' (input_probe), is at
    least this.
    progress: show the progress of the first build of "adversarial" and "crafted" canaries, the
    seconds before the first step (progress_steps); None (default): not asked, so off, unless a
    run with a progress bar turns it on (show_progress); True / False: the user's choice.
    """

    def __init__(
        self,
        kind: str,
        *,
        inputs: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        loss_fn: Optional[Callable] = None,
        recraft_every: Union[int, str, None] = "auto",
        craft_steps: int = 100,
        step_size: float = 0.2,
        epsilon: float = 0.3,
        num_classes: Optional[int] = None,
        min_strength: float = 0.9,
        progress: Optional[bool] = None,
    ):
        from ..values import integer, real

        if kind not in INPUT_KINDS:
            raise ValueError(f"Unexpected value for `canary`: {kind!r}; input canary kinds are {', '.join(INPUT_KINDS)}")
        if isinstance(recraft_every, str) and recraft_every == "auto":
            recraft_every = RECRAFT_EVERY.get(kind)
        if recraft_every is not None and (isinstance(recraft_every, bool) or not isinstance(recraft_every, numbers.Integral)
                                          or recraft_every < 1):
            raise ValueError(f"Unexpected value for `recraft_every`: {recraft_every!r}; use an integer >= 1, 'auto' or None")
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError(
                f"Unexpected value for `loss_fn`: {loss_fn!r}; use a callable (outputs, labels) -> the loss summed "
                "over the batch, or None for cross-entropy"
            )
        craft_steps = integer("craft_steps", craft_steps, 0)
        step_size = real("step_size", step_size, low=0.0)
        epsilon = real("epsilon", epsilon, low=0.0, low_open=False)
        min_strength = real("min_strength", min_strength, low=0.0, high=1.0, high_open=False)
        if num_classes is not None:
            num_classes = integer("num_classes", num_classes, 2)
        if progress is not None and not isinstance(progress, bool):
            raise ValueError(f"Unexpected value for `progress`: {progress!r}; use True, False or None")
        if inputs is None or len(inputs) == 0:
            raise ValueError(
                f"{kind!r} canaries need a sample of in-distribution inputs: pass `canary_inputs` and `canary_labels` "
                "(examples held out from training)"
            )
        self.kind = kind
        self.inputs, self.labels = inputs, labels
        self.loss_fn = loss_fn or nn.CrossEntropyLoss(reduction="sum")
        self.recraft_every = None if recraft_every is None else int(recraft_every)
        self.options = {"steps": craft_steps, "step_size": step_size, "epsilon": epsilon, "norm_floor": None}
        self.num_classes = num_classes
        self.min_strength = min_strength
        self.progress = progress
        self.x: Optional[torch.Tensor] = None
        self.y: Optional[torch.Tensor] = None
        self.builds = 0

    @property
    def rebuilds(self) -> bool:
        return self.kind in ("adversarial", "crafted") and self.recraft_every is not None

    def build(self, model: nn.Module, count: int, generator: torch.Generator) -> None:
        """(Re)build `count` canaries from the model's current parameters."""
        if self.kind == "crafted" and self.x is not None and len(self.x) == count:
            reference = mean_gradient(model, self.loss_fn, self.inputs, self.labels)
            steps = max(1, self.options["steps"] // 5)
            self.x = craft(
                model, self.loss_fn, self.x, self.y, reference, steps=steps, step_size=self.options["step_size"],
                norm_floor=self.options["norm_floor"],
            )
            self.builds += 1
            return
        self.x, self.y = make_input_canaries(
            self.kind, model, self.inputs, self.labels, count=count, num_classes=self.num_classes,
            loss_fn=self.loss_fn, generator=generator, progress=bool(self.progress), **self.options,
        )
        self.builds += 1

    def due(self, step: int) -> bool:
        """True when the canaries should be rebuilt before noised step `step` (0-based)."""
        return self.x is None or (self.rebuilds and step > 0 and step % self.recraft_every == 0)


def show_progress(canary, show: bool) -> None:
    """Show the first build's progress of `canary` (a PrivacyAuditor's options.canary) if `show`, unless
    the user chose (InputCanaries(progress=True or False)); gradient canaries (a kind's name) have none.

    A run with a progress bar calls it, e.g. DPAuditCallback with the Trainer's progress bar on rank zero.
    """
    if isinstance(canary, InputCanaries) and canary.progress is None:
        canary.progress = bool(show)
