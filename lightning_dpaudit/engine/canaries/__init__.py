"""Canary kinds, one interface (base.py), chosen in one place (`canary_kind_for`):

    dirac, constant, random                          GradientCanaries (gradient.py)
    mislabeled, blank, adversarial, crafted          InputCanaryKind  (input.py)
"""

from __future__ import annotations

from ..release.ghost import GhostClipping, ModuleRef, grad_sample_module_in, is_ghost
from ..support.tensor_names import layer_names
from .base import sentinel_positions
from .gradient import GradientCanaries, layer_claims_of
from .gradient_canaries import DEFAULT_POOL, KINDS, CanarySampler, choose_pool
from .gradient_probe import GradientProbe
from .input import InputCanaryKind
from .input_canaries import INPUT_KINDS
from .input_probe import InputProbe

ALL_KIND_NAMES = KINDS + INPUT_KINDS


def canary_kind_for(optimizer, mechanism, options, model, rng):
    """The canary kind of `options`, with the pool reader it shares with the release path."""
    params, clip = mechanism.params, mechanism.clip_bounds
    sigma, C = mechanism.noise_multiplier, mechanism.max_grad_norm
    sizes = [p.numel() for p in params]
    if options.input:
        probe = GradientProbe(params, choose_pool(sizes, DEFAULT_POOL, rng), clip, options.canary_scale)
        input_probe = InputProbe(
            params, model, options.canary, clip, per_layer=mechanism.per_layer, max_grad_norm=C,
            loss_reduction=optimizer.loss_reduction, pool=probe.pool,
        )
        options.canary.options["norm_floor"] = C
        kind = InputCanaryKind(
            options.canary, input_probe, probe, model=model, per_step=options.canaries_per_step, mode=options.mode,
            rng=rng, mu_claimed=1.0 / sigma, sentinels=sentinel_positions(len(probe.pool)), noise_std=sigma * C,
        )
        kind.module_ref = ModuleRef()
        kind.module_ref.set(grad_sample_module_in(model, params) or model)
        return kind
    sampler = CanarySampler(
        sizes, kind=options.canary, per_step=options.canaries_per_step, moving=options.moving, support=options.support,
        rng=rng,
    )
    probe = GradientProbe(params, sampler.pool, clip, options.canary_scale)
    owner = ModuleRef()
    names = layer_names(params, model, optimizer, owner)
    found = None if model is None else grad_sample_module_in(model, params)
    if found is not None:
        owner.set(found)
    if is_ghost(optimizer):
        probe.ghost = GhostClipping(params, owner, names)
    kind = GradientCanaries(
        sampler, probe, layer_names=names,
        layer_claims=layer_claims_of(mechanism),
        sentinels=sentinel_positions(len(probe.pool)), noise_std=sigma * C,
    )
    kind.module_ref = owner  # the GradSampleModule, once known (the per-sample check needs it)
    return kind
