"""The exact checks' replays under FSDP2: the model run as one plain module, from its gathered tensors.

Under FSDP2 each rank holds row shards of the tensors, and the model's forward pass gathers
them through FSDP's hooks: collectives every rank must join in the same order. The exact
checks replay a rank's own examples, so their forward passes must not enter those hooks.
At a checked step every rank gathers every sharded tensor of the model once
(DTensor.full_tensor, the same collectives on every rank, in the model's parameter order);
the replays then run with FSDP's forward hooks set aside and the gathered tensors in place
of the shards, as leaves of their own:

    replay(x) = f(x; W)   with W the full tensors, what FSDP gathers for the training step

Under a mixed-precision policy FSDP computes from tensors cast to a lower precision, which
this replay does not; there it declines and says so. It declines a step too where the
gathered model would take more than half of a GPU's free memory on some rank (the ranks
agree on it in one small all-reduce).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

MEMORY_SHARE = 0.5  # of a GPU's free memory the gathered tensors may take


def over_memory(need: int, device: torch.device) -> bool:
    """`need` bytes would take more than MEMORY_SHARE of the device's free memory (a GPU's; no bound elsewhere)."""
    return device.type == "cuda" and need > MEMORY_SHARE * torch.cuda.mem_get_info(device)[0]


def fsdp_states(root: torch.nn.Module) -> list:
    """FSDP2's states of the modules under `root` (empty when FSDP2 does not wrap it)."""
    from torch.distributed.fsdp import FSDPModule

    return [m._get_fsdp_state() for m in root.modules() if isinstance(m, FSDPModule)]


def _is_fsdp_hook(hook, states) -> bool:
    owner = getattr(hook, "__self__", None) or getattr(getattr(hook, "__wrapped__", None), "__self__", None)
    return any(owner is s for s in states)


def module_norms(gsm) -> dict:
    """id(tensor) -> its per-sample norms, where Opacus's FSDP module keeps them: on each submodule (norm_sample),
    in the order of that module's trainable tensors."""
    from opacus.utils.module_utils import trainable_parameters

    out = {}
    for holder in gsm.iterate_submodules(gsm._module):
        for (_, p), norms in zip(trainable_parameters(holder), getattr(holder, "norm_sample", None) or []):
            out[id(p)] = norms.reshape(-1)
    return out


class ShardedReplay:
    """Gathers the model's sharded tensors at a checked step and runs replays on them, FSDP's hooks aside."""

    def __init__(self, root: torch.nn.Module):
        self.root = root
        self.states = fsdp_states(root)
        self.full: Optional[dict] = None  # id(registered tensor) -> its gathered leaf, for the step being checked

    @property
    def declined(self) -> Optional[str]:
        """Why replays cannot give FSDP's values, or None."""
        for state in self.states:
            policy = getattr(state, "_mp_policy", None)
            if policy is not None and (policy.param_dtype is not None or policy.reduce_dtype is not None):
                return ("FSDP computes under a mixed-precision policy "
                        f"(param_dtype={policy.param_dtype}, reduce_dtype={policy.reduce_dtype}), which a replay "
                        "from the gathered tensors does not reproduce")
        return None

    def gather(self) -> Optional[str]:
        """Every rank, at every checked step, before anything that can differ between ranks: the full tensors.
        None once gathered, else why not, the same on every rank: a mixed-precision policy (no collective), or the
        gathered model taking more than half of a GPU's free memory on some rank (agreed in one all-reduce)."""
        from torch.distributed.tensor import DTensor

        if self.declined is not None:
            return self.declined
        params = list(self.root.parameters())
        need = sum(p.numel() * p.element_size() for p in params)
        device = params[0].device if params else torch.device("cpu")
        short = torch.tensor([1.0 if over_memory(need, device) else 0.0], device=device)
        torch.distributed.all_reduce(short, op=torch.distributed.ReduceOp.MAX)
        if float(short) > 0:
            return (f"the gathered model ({need / 2**30:.2f} GiB) would take more than {MEMORY_SHARE:.0%} of a GPU's "
                    "free memory on some rank")
        self.full = {}
        for p in params:
            whole = p.full_tensor() if isinstance(p, DTensor) else p
            self.full[id(p)] = whole.detach().clone().requires_grad_(p.requires_grad)
        return None

    def leaf(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor a replay differentiates for the registered (sharded) tensor p."""
        return p if self.full is None else self.full.get(id(p), p)

    def release(self) -> None:
        self.full = None

    @contextlib.contextmanager
    def plain(self):
        """The model as one plain module while the block runs: gathered leaves in place of the shards, FSDP's
        forward hooks set aside (the hooks' dicts are edited in place, so their handles stay valid)."""
        if self.full is None:
            yield
            return
        swapped, hidden = [], []
        try:
            for module in self.root.modules():
                for name, p in list(module._parameters.items()):
                    if p is not None and id(p) in self.full:
                        swapped.append((module, name, p))
                        module._parameters[name] = self.full[id(p)]
                for hooks in (module._forward_pre_hooks, module._forward_hooks):
                    items = list(hooks.items())
                    if any(_is_fsdp_hook(h, self.states) for _, h in items):
                        hidden.append((hooks, items))
                        hooks.clear()
                        hooks.update((k, h) for k, h in items if not _is_fsdp_hook(h, self.states))
            yield
        finally:
            for module, name, p in swapped:
                module._parameters[name] = p
            for hooks, items in hidden:
                hooks.clear()
                hooks.update(items)
