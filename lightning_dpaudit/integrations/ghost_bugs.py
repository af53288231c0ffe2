"""Bugs in ghost clipping's own code, injected into the ghost-clipping GradSampleModule (FSDP's too).

Under grad_sample_mode="ghost" the clipping lives in the module, not the optimizer: its
hooks compute per-sample norms (a norm sampler per layer type) and get_clipping_coef
turns them into c_i = min(1, C / (||g_i|| + 1e-6)). These bugs replace one of the two
on the module instance (the class and every other module are left alone):

    halved-linear-norms      nn.Linear's norm sampler returns half the norm: large
                             gradients of linear layers pass clipped to 2 C
    unclamped-coefficients   c_i = C / (||g_i|| + 1e-6) without the clamp at 1: every
                             gradient is scaled to norm C (normalized, not clipped);
                             its norm stays below C, so no privacy is lost, but the update
                             is not the algorithm's
"""

from __future__ import annotations

from typing import Dict

import torch

GHOST_BUGS: Dict[str, str] = {
    "halved-linear-norms": "Ghost clipping: nn.Linear's per-sample norms halved, so its large gradients pass under-clipped.",
    "unclamped-coefficients": "Ghost clipping: coefficients C / norm without the clamp at 1 (small gradients scaled up).",
}


def inject_ghost_bug(optimizer, module, name: str):
    """Break `module` (the GradSampleModuleFastGradientClipping training `optimizer`'s parameters) in place."""
    from opacus.grad_sample import GradSampleHooksFastGradientClipping as GhostHooks

    if name not in GHOST_BUGS:
        raise ValueError(f"unknown ghost-clipping bug {name!r}; valid names: {', '.join(GHOST_BUGS)}")
    if module is None:
        raise TypeError(f"{name!r} breaks the ghost-clipping module: pass module= (the module make_private returned)")
    from ..engine.release.ghost import grad_sample_module_in

    gsm = module if isinstance(module, GhostHooks) else grad_sample_module_in(module, optimizer.params)
    if not isinstance(gsm, GhostHooks):
        raise TypeError(f"{name!r} needs a module trained with grad_sample_mode='ghost'; got {type(module).__name__}")
    if name == "halved-linear-norms":
        samplers = dict(type(gsm).NORM_SAMPLERS)
        linear = samplers[torch.nn.Linear]
        samplers[torch.nn.Linear] = lambda layer, a, b: {p: n / 2 for p, n in linear(layer, a, b).items()}
        gsm.NORM_SAMPLERS = samplers
    else:
        gsm.get_clipping_coef = lambda: gsm.max_grad_norm / (gsm.get_norm_sample() + 1e-6)
    optimizer.injected_bug = name
    return optimizer
