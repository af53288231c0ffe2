"""Gradient canaries (dirac, constant, random): chosen per-sample gradients on a few coordinates.

Canary i of a step sits in tensor l_i on a support of pool coordinates with unit direction
w_i; its row is scale * C_l * w_i. Its observation is <w_i, R - S> / C_l, read at its
support: computed on the parameters' device, so a step moves nothing to the host.
"""

from __future__ import annotations

import numpy as np
import torch

from ...analysis.schema import Field, Section
from .base import Planted, Reading, ReleaseView, sentinel_noise
from .canary_plan import PlannedStep, plan
from .gradient_canaries import SAMPLER, CanarySampler, _pool
from .gradient_probe import GradientProbe

POOL = Field("pool", "list", items=Field("coordinates", "array", dtype="int", low=0), rule=_pool)

# The kind's part of the auditor's state (ctx: "sizes", "per_step"); a 0.1.0 state also holds input_canaries=None.
GRADIENT_STATE = Section("gradient canaries", Field("sampler", SAMPLER), POOL)


class GradientCanaries:
    reads_on_device = True
    def __init__(self, sampler: CanarySampler, probe: GradientProbe, *, layer_names, layer_claims, sentinels, noise_std):
        self.name = sampler.kind
        self.sampler, self.probe = sampler, probe
        self.layer_names, self.layer_claims = layer_names, layer_claims
        self.sentinels, self.noise_std = sentinels, float(noise_std)
        self._sentinels_device = None if sentinels is None else torch.as_tensor(sentinels, device=probe.pool.device)
        self._planned: list = []  # PlannedSteps of the sampler's current block, the next step's first

    def plant(self, step: int, *, all_in: bool = False) -> Planted:
        planned = self._next_planned(all_in)
        canaries = planned.canaries

        def preclipped(which):
            added = planned.preclipped_for(which)
            return self.probe.preclipped(canaries, which) if added is None else added

        return Planted(canaries.is_in, lambda which: self.probe.canary_rows(canaries, which), canaries,
                       preclipped=preclipped, device=planned)

    def _next_planned(self, all_in: bool) -> PlannedStep:
        """The next step's PlannedStep, the rest of its block planned at once when the plan does not hold it."""
        upcoming = self.sampler.upcoming(all_in=all_in)
        if not self._planned or self._planned[0].canaries.pool_index is not upcoming[0][0]:
            self._planned = plan(self.probe, [self.sampler.canaries_of(entry) for entry in upcoming], self.sentinels)
        self.sampler.hand_out(all_in=all_in)  # the step planned, taken out of the sampler's block
        return self._planned.pop(0)

    def read(self, planted: Planted, view: ReleaseView) -> Reading:
        canaries = planted.canaries
        values = self.probe.project_on_device(view.centered, canaries, planted.device)
        noise = sentinel_noise(view, self._sentinels_device if torch.is_tensor(view.centered) else self.sentinels, self.noise_std)
        return Reading(canaries.tensor, view.is_in, values, noise)

    def finish_step(self) -> None:
        pass

    def set_claim(self, mechanism) -> None:
        """Size and read the canaries of the next steps by the optimizer's new bounds and noise."""
        self.probe.clip_bounds = np.array(mechanism.clip_bounds, dtype=float)
        self.layer_claims = layer_claims_of(mechanism)
        self.noise_std = mechanism.noise_multiplier * mechanism.max_grad_norm
        self._planned = []  # planned with the old bounds

    def state_dict(self) -> dict:
        return GRADIENT_STATE.dump({"sampler": self.sampler.state_dict(), "pool": [p.cpu().numpy() for p in self.probe.pool_local]})

    def load_state_dict(self, state: dict) -> None:
        """A state GRADIENT_STATE.check passed (engine/state.py)."""
        self.sampler.load_state_dict(state["sampler"])
        self._planned = []
        if "pool" in state:
            self.probe.set_pool(state["pool"])


def layer_claims_of(mechanism) -> dict:
    """Claimed mu per tensor: a canary clipped to C_l under noise sigma * C is C_l / (sigma C)-GDP."""
    scale = mechanism.noise_multiplier * mechanism.max_grad_norm
    return {i: float(c / scale) for i, c in enumerate(mechanism.clip_bounds)}
