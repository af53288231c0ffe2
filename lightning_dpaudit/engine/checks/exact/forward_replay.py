"""What the exact per-sample check keeps of a forward pass, and how it replays one.

A forward pass of the checked module is kept as its inputs, torch's RNG state (CPU and
CUDA) and autocast regions, the chosen examples' output rows, and the gradient the loss
sent to those rows in the first backward pass. A replay runs the module again from that
state, on the chosen examples alone (when that gives their outputs back) or on the batch.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

EPS32 = float(torch.finfo(torch.float32).eps)
FULL_GRADIENT = 1 << 20  # elements of an output gradient kept whole at a checked step (records of several views)

# A replay's backward pass runs through Opacus's switched-off full backward hooks, and torch warns about them once
# per location, at the replay's own line: a warning about the audit's internals, not the user's run. Ignored where it
# is attributed to this package only (a filter set once, at import: warnings.catch_warnings around each replay would
# reset the once-per-location registry and show the user's own warnings again).
IGNORED_HERE = dict(message="Full backward hook is firing", category=UserWarning, module=r"lightning_dpaudit\.")
warnings.filterwarnings("ignore", **IGNORED_HERE)


@dataclass
class Call:
    """One forward pass of the checked module: its inputs, RNG state, chosen examples and output gradients."""

    args: tuple
    kwargs: dict
    rng_state: torch.Tensor
    cuda_states: list
    batch: int = 0
    chosen: Optional[np.ndarray] = None
    grads: dict = field(default_factory=dict)  # output leaf index -> gradient rows of the chosen examples
    backward: Optional[int] = None  # the backward pass that brought them
    outputs: dict = field(default_factory=dict)  # output leaf index -> the chosen examples' rows of the output
    autocast: list = field(default_factory=list)  # (device type, dtype) of the autocast regions the forward ran in
    buffers: list = field(default_factory=list)  # the module's buffers before the forward pass (when replays need them)
    full_grads: dict = field(default_factory=dict)  # output leaf index -> its whole gradient, when small (views.py)


def buffer_values(module: torch.nn.Module) -> list:
    """A copy of the module's buffers, to put back with set_buffers."""
    return [b.detach().clone() for b in module.buffers()]


def set_buffers(module: torch.nn.Module, values: list) -> None:
    """The module's buffers set to `values` (buffer_values of the same module), in place."""
    with torch.no_grad():
        for b, value in zip(module.buffers(), values):
            b.copy_(value)


@contextlib.contextmanager
def samples_set_aside(params):
    """The step's per-sample gradients set aside while a replay runs, then put back: expanded weights write
    p.grad_sample from any backward pass through the module, and refuse to while it holds the step's."""
    held = [(p, p.grad_sample) for p in params if getattr(p, "grad_sample", None) is not None]
    for p, _ in held:
        p.grad_sample = None
    try:
        yield
    finally:
        for p, samples in held:
            p.grad_sample = samples


def captured(args, kwargs) -> Call:
    """A forward pass about to run on (args, kwargs): its inputs, torch's RNG states and autocast regions."""
    devices = sorted({t.device.index for t in tensors((args, kwargs)) if t.device.type == "cuda"})
    cuda_states = [(d, torch.cuda.get_rng_state(d)) for d in devices]
    autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    return Call(args, kwargs, torch.get_rng_state(), cuda_states, autocast=autocast)


def autocast_regions(call: Call) -> contextlib.ExitStack:
    """The autocast regions the call's forward ran in (the run's own mixed precision), entered anew."""
    regions = contextlib.ExitStack()
    for device_type, dtype in call.autocast:
        regions.enter_context(torch.autocast(device_type, dtype=dtype))
    return regions


def replay_forward(module: torch.nn.Module, call: Call, args, kwargs) -> list:
    """The output leaves (tensors requiring grad, of at least one dimension) of module(*args, **kwargs) run from the
    call's RNG states and autocast regions; torch's own RNG state is put back after."""
    with contextlib.ExitStack() as regions:
        regions.enter_context(torch.random.fork_rng(devices=[d for d, _ in call.cuda_states]))
        regions.enter_context(torch.enable_grad())
        regions.enter_context(autocast_regions(call))  # the forward's own mixed precision
        torch.set_rng_state(call.rng_state)
        for d, state in call.cuda_states:
            torch.cuda.set_rng_state(state, d)
        output = module(*args, **kwargs)
    return [t for t in tensors(output) if t.requires_grad and t.dim() > 0]


def keep_output(call: Call, output, rng: np.random.Generator, examples: int) -> bool:
    """At the end of the call's forward pass: choose `examples` of its batch (the generator's draw), keep their
    output rows and hook the first gradient each batched output leaf receives; False when the output holds no
    tensor that requires grad (nothing to compare)."""
    leaves = [t for t in tensors(output) if t.requires_grad and t.dim() > 0]
    if not leaves:
        return False
    call.batch = leaves[0].shape[0]
    call.chosen = np.sort(rng.choice(call.batch, size=min(examples, call.batch), replace=False))
    rows = torch.as_tensor(call.chosen, device=leaves[0].device)
    for j, leaf in enumerate(leaves):
        if leaf.shape[0] == call.batch:
            leaf.register_hook(first_gradient(call, j, rows))
            call.outputs[j] = leaf.detach()[rows].clone()  # what a replay of the chosen examples must give
    return True


def first_gradient(call: Call, j: int, rows: torch.Tensor):
    """A tensor hook keeping the chosen examples' rows of the first gradient that reaches output leaf j."""
    task = getattr(torch._C, "_current_graph_task_id", lambda: None)

    def keep(grad):
        if j not in call.grads:
            call.grads[j] = grad.detach()[rows].clone()
            call.backward = task()
            if grad.numel() <= FULL_GRADIENT:  # every row's, for records made of several views (views.py)
                call.full_grads[j] = grad.detach().clone()

    return keep


def own_gradients(leaves: list, i: int, totals: dict) -> dict:
    """The gradient the loss sends to each output's row i directly, from the total ones the tensor hooks kept.

    When an output is computed from another (an encoder's state and the logits decoded from it), the total
    gradient T_a of the inner one already holds what flows back from the outer one, and summing <o_j, T_j> over
    the outputs would count that twice. The direct parts p satisfy T_a = p_a + sum_k p_k do_k/do_a (total
    derivatives through the graph), solved from the outputs nothing depends on inwards: one pass per level."""
    own = dict(totals)
    for _ in range(len(totals)):
        changed = False
        for j in totals:
            others = [k for k in own if k != j]
            if not others:
                break
            back = torch.autograd.grad([leaves[k][i] for k in others], leaves[j], grad_outputs=[own[k] for k in others],
                                       retain_graph=True, allow_unused=True)[0]
            if back is None:
                continue
            direct = totals[j] - back[i]
            changed = changed or not torch.equal(direct, own[j])
            own[j] = direct
        if not changed:
            break
    return own


def smallest_module_holding(module: torch.nn.Module, params) -> torch.nn.Module:
    """The deepest submodule of `module` that holds every module using a tensor of `params` as its own.

    A tensor shared by two modules (an embedding tied to the output layer) is used by both: the replay must run
    both, so the module holding it once (the embedding's parent) is not enough. A ModuleList or ModuleDict never
    runs a forward pass of its own (adapters spread over a model's blocks): its parent is taken instead."""
    wanted = {id(p) for p in params}
    users = {id(m) for _, m in module.named_modules(remove_duplicate=False)
             if any(id(p) in wanted for p in m.parameters(recurse=False))}
    best, found = module, ""
    for name, m in module.named_modules():
        if name.count(".") + 1 > (found.count(".") + 1 if found else 0) and \
                users <= {id(sub) for _, sub in m.named_modules(remove_duplicate=False)}:
            best, found = m, name
    modules = dict(module.named_modules())
    while found and isinstance(best, (torch.nn.ModuleList, torch.nn.ModuleDict)):  # containers never run forward
        found = found.rsplit(".", 1)[0] if "." in found else ""
        best = modules[found]
    return best


def precision(tensors, dtypes=()) -> float:
    """The unit roundoff of the lowest floating precision among these tensors and dtypes (float32's at least):
    mixed precision (bf16 autocast) computes per-sample gradients to about 1e-2, not 1e-6."""
    found = [t.dtype for t in tensors if t is not None] + list(dtypes)
    return max([EPS32] + [float(torch.finfo(d).eps) for d in found if d.is_floating_point])


def sliced(value, chosen: np.ndarray, batch: int):
    """(args, kwargs) with every tensor whose first dimension is the batch cut to the chosen rows; None if none is."""
    cut = []

    def walk(v):
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch:
            cut.append(True)
            return v[torch.as_tensor(chosen, device=v.device)]
        if isinstance(v, (tuple, list)):
            return type(v)(walk(x) for x in v)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        return v

    args, kwargs = walk(value)
    return (args, kwargs) if cut else None


def same_rows(replayed: torch.Tensor, recorded: torch.Tensor) -> bool:
    """A replay's output rows equal the recorded ones up to float rounding (relative 1e-4 of the largest)."""
    if replayed.shape != recorded.shape:
        return False
    scale = float(recorded.abs().max()) if recorded.numel() else 0.0
    return bool(torch.allclose(replayed.detach(), recorded, rtol=1e-4, atol=1e-5 * scale + 1e-12))


def tensors(value):
    """The tensors in a forward's inputs or output (tensors, tuples, lists, dicts, dataclass-like outputs)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors(v)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            yield from tensors(getattr(value, name))
