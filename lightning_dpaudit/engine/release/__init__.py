"""Release paths: one per family of Opacus optimizers, chosen in one place (`release_path_for`),
as opacus.optimizers.get_optimizer_class maps a set-up to its optimizer class.

    DPOptimizer, DPPerLayerOptimizer, ghost clipping, ... on one process     PerSampleRelease
    AdaClipDPOptimizer (clipping="adaptive")                                AdaClipRelease (adaptive.py)
    DistributedDPOptimizer, SimpleDistributedPerLayer..., ghost under DDP    ReducedRelease (several processes)
    FSDPOptimizerFastGradientClipping (FSDP2, ghost clipping)                ShardedRelease (tensors sharded)

Families the audit cannot read yet are refused here, each with what to use instead.
"""

from __future__ import annotations

from . import distributed as dist
from .base import PathSettings
from .per_sample import PerSampleRelease
from .reduced import ReducedRelease
from .sharded import ShardedRelease

__all__ = ["PathSettings", "PerSampleRelease", "ReducedRelease", "ShardedRelease", "release_path_for"]


def release_path_for(optimizer) -> type:
    """The release path class for this optimizer, or a TypeError naming why it cannot be audited."""
    from opacus.optimizers import DPOptimizer

    if not isinstance(optimizer, DPOptimizer):
        raise TypeError(
            f"PrivacyAuditor needs an Opacus DPOptimizer, got {type(optimizer).__name__}: pass the optimizer "
            "returned by `PrivacyEngine.make_private(...)`"
        )
    dist.check_supported(optimizer)
    families = {c.__name__ for c in type(optimizer).__mro__}
    if "FSDPOptimizerFastGradientClipping" in families:
        return ShardedRelease
    if "AdaClipDPOptimizer" in families:  # PerSampleRelease that keeps the canaries out of its count
        from ..claims.adaptive import AdaClipRelease

        return AdaClipRelease
    if dist.is_reducing(optimizer) and dist.world_size() > 1:
        return ReducedRelease
    return PerSampleRelease
