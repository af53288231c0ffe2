"""The patches that put each of Opacus's historical privacy bugs back (opacus_history.py lists the bugs).

Each `_patches_*` function returns the (owner, key, new value) triples that reinstate one bug's logic, rewritten for
Opacus 1.6.0's structure; opacus_history.HistoricalBug.patch applies them and puts back what it found.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

ADAPTER_PREFIX = "lora_"  # PEFT's prefix for adapter submodules (lora_A, lora_B, lora_embedding_A, ...)

# (owner, key, new value): owner is a class or module (attribute key) or a dict (item key)
Patch = Tuple[object, str, object]


# --- opacus-664 ---------------------------------------------------------------------------

def patches_664() -> List[Patch]:
    from opacus import PrivacyEngine

    fixed = vars(PrivacyEngine)["_prepare_model"]

    def _prepare_model(self, module, *, max_grad_norm=1.0, **kwargs):
        # reverts f2a591ae: make_private's max_grad_norm never reached the ghost module,
        # which kept GradSampleModuleFastGradientClipping's default max_grad_norm=1
        return fixed(self, module, **kwargs)

    return [(PrivacyEngine, "_prepare_model", _prepare_model)]


# --- opacus-751 ---------------------------------------------------------------------------

def _linear_norm_sample_before_751(layer, activations, backprops):
    """opacus/grad_sample/linear.py compute_linear_norm_sample as of v1.5.3 (before 7264cd73)."""
    import torch

    activations = activations[0].to(backprops.dtype)
    ret = {}
    if backprops.dim() == 2:
        if layer.weight.requires_grad:
            g = torch.einsum("n...i,n...i->n", backprops, backprops)
            a = torch.einsum("n...j,n...j->n", activations, activations)
            ret[layer.weight] = torch.sqrt((g * a).flatten())
        if layer.bias is not None and layer.bias.requires_grad:
            ret[layer.bias] = torch.sqrt(torch.einsum("n...i,n...i->n", backprops, backprops).flatten())
    elif backprops.dim() == 3:
        if layer.weight.requires_grad:
            ggT = torch.einsum("nik,njk->nij", backprops, backprops)
            aaT = torch.einsum("nik,njk->nij", activations, activations)
            ret[layer.weight] = torch.sqrt(torch.einsum("n...i,n...i->n", ggT, aaT).clamp(min=0))
        if layer.bias is not None and layer.bias.requires_grad:
            ggT = torch.einsum("nik,njk->nij", backprops, backprops)
            gg = torch.einsum("n...i,n...i->n", ggT, ggT).clamp(min=0)  # the bug: <G, G>, not <G, 1>
            ret[layer.bias] = torch.sqrt(gg)
    return ret


def patches_751() -> List[Patch]:
    import torch.nn as nn
    from opacus.grad_sample import linear
    from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
        GradSampleHooksFastGradientClipping,
    )

    # the registry every ghost-clipping module (and the FSDP one) reads at backward time
    return [
        (GradSampleHooksFastGradientClipping.NORM_SAMPLERS, nn.Linear, _linear_norm_sample_before_751),
        (linear, "compute_linear_norm_sample", _linear_norm_sample_before_751),
    ]


# --- opacus-accumulation-1.5.3 -----------------------------------------------------------

def _accumulate_before_53b3c254(self):
    """DPOptimizerFastGradientClipping.accumulate as of v1.5.2: summed_grad aliases p.grad."""
    for p in self.params:
        if p.summed_grad is not None:
            p.summed_grad += p.grad
        else:
            p.summed_grad = p.grad


def patches_accumulation() -> List[Patch]:
    from opacus.optimizers import DPOptimizerFastGradientClipping

    return [(DPOptimizerFastGradientClipping, "accumulate", _accumulate_before_53b3c254)]


# --- opacus-807 ---------------------------------------------------------------------------

def _adjusted(sigma: float, unclipped_num_std: float) -> float:
    return (sigma ** (-2) - (2 * unclipped_num_std) ** (-2)) ** (-1 / 2)


def patches_807() -> List[Patch]:
    from opacus.optimizers import AdaClipDPOptimizer, DPOptimizer
    from opacus.optimizers.optimizer import _generate_noise
    from opacus.utils.adaptive_clipping.adaptive_clipping_utils import (
        DPTensorFastGradientAdaptiveClipping,
    )

    fixed_init = vars(AdaClipDPOptimizer)["__init__"]
    fixed_backward = vars(DPTensorFastGradientAdaptiveClipping)["backward"]

    def __init__(self, *args, **kwargs):
        fixed_init(self, *args, **kwargs)
        # reverts 9d3c2b01: Theorem 1's adjustment overwrote the noise_multiplier the accountant reads
        if self.noise_multiplier > 0:
            self.noise_multiplier = _adjusted(self.noise_multiplier, self.unclipped_num_std)

    def add_noise(self):
        DPOptimizer.add_noise(self)  # v1.5.4: super().add_noise() with the (adjusted) noise_multiplier
        noise = _generate_noise(
            std=self.unclipped_num_std,
            reference=self.unclipped_num.float(),  # .float() is #779's crash fix, kept
            generator=self.generator,
        )
        self.unclipped_num = float(self.unclipped_num) + noise

    def backward(self):
        fixed_backward(self)
        # v1.5.4 set optimizer.noise_multiplier = new_noise_multiplier (now _adjusted_noise_multiplier)
        self.optimizer.noise_multiplier = self.optimizer._adjusted_noise_multiplier

    return [
        (AdaClipDPOptimizer, "__init__", __init__),
        (AdaClipDPOptimizer, "add_noise", add_noise),
        (DPTensorFastGradientAdaptiveClipping, "backward", backward),
    ]


# --- opacus-820 ---------------------------------------------------------------------------

def _is_adapter(qualified_name: str) -> bool:
    return any(part.startswith(ADAPTER_PREFIX) for part in qualified_name.split("."))


def patches_820() -> List[Patch]:
    from opacus.grad_sample.grad_sample_module import GradSampleHooks
    from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
        GradSampleHooksFastGradientClipping,
    )
    from opacus.utils.module_utils import trainable_parameters

    fixed_iterate = vars(GradSampleHooks)["iterate_submodules"]
    fixed_init = vars(GradSampleHooksFastGradientClipping)["__init__"]
    adapters: Dict[int, set] = {}

    def iterate_submodules(self, module):
        # the walk recurses through this method: compute the adapter set once, at the root
        if module is self._module or id(self) not in adapters:
            adapters[id(self)] = {id(m) for n, m in self._module.named_modules() if _is_adapter(n)}
        skip = adapters[id(self)]
        for m in fixed_iterate(self, module):
            if id(m) not in skip:  # adapters: no grad-sample hooks registered
                yield m

    def __init__(self, m, **kwargs):
        fixed_init(self, m, **kwargs)
        # ... and not among the parameters whose per-sample norms make the clipping coefficient
        self.trainable_parameters = [p for n, p in trainable_parameters(self._module) if not _is_adapter(n)]

    return [
        (GradSampleHooks, "iterate_submodules", iterate_submodules),
        (GradSampleHooksFastGradientClipping, "__init__", __init__),
    ]


# --- opacus-598 ---------------------------------------------------------------------------

def patches_598() -> List[Patch]:
    import torch.nn as nn
    from opacus.layers import DPMultiheadAttention
    from opacus.validators import multihead_attention
    from opacus.validators.module_validator import ModuleValidator

    def fix(module: nn.MultiheadAttention) -> DPMultiheadAttention:
        # opacus/validators/multihead_attention.py as of v1.4.0 (before da05f778): no batch_first
        dp_attn = DPMultiheadAttention(
            embed_dim=module.embed_dim,
            num_heads=module.num_heads,
            dropout=module.dropout,
            bias=module.in_proj_bias is not None,
            add_bias_kv=module.bias_k is not None,
            add_zero_attn=module.add_zero_attn,
            kdim=module.kdim,
            vdim=module.vdim,
        )
        dp_attn.load_state_dict(module.state_dict())
        return dp_attn

    return [
        (ModuleValidator.FIXERS, nn.MultiheadAttention, fix),
        (multihead_attention, "fix", fix),
    ]


# --- opacus-541 ---------------------------------------------------------------------------

def patches_541() -> List[Patch]:
    from opacus.accountants import GaussianAccountant
    from opacus.accountants.analysis import gdp as privacy_analysis

    def get_epsilon(self, delta: float, poisson: bool = True, **kwargs) -> float:
        compute_eps = privacy_analysis.compute_eps_poisson if poisson else privacy_analysis.compute_eps_uniform
        noise_multiplier, sample_rate, num_steps = self.history.pop()  # before 0b200590: pop, not [-1]
        return compute_eps(steps=num_steps, noise_multiplier=noise_multiplier, sample_rate=sample_rate, delta=delta)

    return [(GaussianAccountant, "get_epsilon", get_epsilon)]
