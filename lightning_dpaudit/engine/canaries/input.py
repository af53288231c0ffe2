"""Input canaries (mislabeled, blank, adversarial, crafted): examples whose per-sample gradients,
from the model's own Opacus hooks, enter the step as rows (see input_probe for the reading).

All canaries form one observation group ("all parameters"): their gradients span every
tensor. Each step computes the canaries' per-sample gradients and their Gram matrix on
the host (the decorrelation needs it), so this kind reads on the host every step; its
own forward and backward pass dominate its cost.
"""

from __future__ import annotations

import numpy as np
import torch

from ...analysis.schema import Field, Section
from .base import Planted, Reading, ReleaseView, sentinel_noise
from .gradient import POOL
from .gradient_probe import GradientProbe
from .input_canaries import InputCanaries
from .input_probe import InputProbe

ALL_LAYERS = "all parameters"


def _canaries(saved, ctx):
    """One label per canary input."""
    x, y = np.asarray(saved["x"]), np.asarray(saved["y"])
    if x.ndim < 1 or y.shape != (len(x),):
        return "x", f"has inputs {x.shape} and labels {y.shape}; expected one label per input"
    return None


# The kind's part of the auditor's state: the canaries' generator, the built canaries (None before the first build), the pool.
INPUT_STATE = Section(
    "input canaries",
    Field("sampler", Section("sampler", Field("rng", "map"))),  # numpy checks the bit generator's state when it is set
    Field("input_canaries", Section("input_canaries", Field("x", "array", dtype="real"), Field("y", "array", dtype="int"),
                                    Field("builds", "int", low=0), rules=(_canaries,)), null=True),
    POOL,
)


class InputCanaryKind:
    reads_on_device = False  # the decorrelation reads the canaries' Gram matrix every step
    def __init__(self, spec: InputCanaries, input_probe: InputProbe, pool: GradientProbe, *, model, per_step, mode, rng,
                 mu_claimed, sentinels, noise_std):
        self.name = spec.kind
        self.spec, self.input_probe, self.probe = spec, input_probe, pool
        self.model, self.per_step, self.mode, self.rng = model, per_step, mode, rng
        self.layer_names, self.layer_claims = [ALL_LAYERS], {0: mu_claimed}
        self.sentinels, self.noise_std = sentinels, float(noise_std)
        # the canaries' forward passes (dropout, crafting) draw from torch's generators seeded from here, restored after
        self.forward_seed = int(np.random.default_rng(rng.bit_generator.seed_seq.spawn(1)[0]).integers(2**62))

    def plant(self, step: int, *, all_in: bool = False) -> Planted:
        probe, spec = self.input_probe, self.spec
        cuda = sorted({p.device for p in probe.params if p.device.type == "cuda"}, key=str)
        with torch.random.fork_rng(devices=cuda):  # training's random state is left as it was
            torch.manual_seed((self.forward_seed + step) % 2**62)
            if spec.due(step):
                spec.build(self.model, self.per_step, torch.Generator().manual_seed(int(self.rng.integers(2**62))))
            probe.prepare(probe.gradients())
        k = len(spec.x)
        is_in = np.ones(k, dtype=bool)
        if not all_in:
            is_in[:] = False
            is_in[self.rng.permutation(k)[: k // 2]] = True
        return Planted(is_in, lambda which: (probe.canary_rows(which), [None] * len(probe.params)))

    def read(self, planted: Planted, view: ReleaseView) -> Reading:
        observed, values = self.input_probe.project(view.released, view.data, view.is_in)
        noise = sentinel_noise(view, self.sentinels, self.noise_std)
        return Reading(np.zeros(len(values), dtype=int), view.is_in[observed], values, noise)

    def finish_step(self) -> None:
        self.input_probe.release()

    def set_claim(self, mechanism) -> None:
        """Clip, weigh and read the canaries of the next steps by the optimizer's new bounds and noise."""
        bounds = np.array(mechanism.clip_bounds, dtype=float)
        self.probe.clip_bounds = self.input_probe.clip_bounds = bounds
        self.input_probe.max_grad_norm = mechanism.max_grad_norm
        self.spec.options["norm_floor"] = mechanism.max_grad_norm
        self.layer_claims = {0: 1.0 / mechanism.noise_multiplier}
        self.noise_std = mechanism.noise_multiplier * mechanism.max_grad_norm

    def state_dict(self) -> dict:
        spec = self.spec
        saved = None
        if spec.x is not None:
            saved = {"x": spec.x.detach().cpu().numpy(), "y": spec.y.detach().cpu().numpy(), "builds": spec.builds}
        return INPUT_STATE.dump({
            "sampler": {"rng": self.rng.bit_generator.state},
            "input_canaries": saved,
            "pool": [p.cpu().numpy() for p in self.probe.pool_local],
        })

    def load_state_dict(self, state: dict) -> None:
        """A state INPUT_STATE.check passed (engine/state.py)."""
        self.rng.bit_generator.state = state["sampler"]["rng"]
        saved = state.get("input_canaries")
        if saved:
            self.spec.x, self.spec.y = torch.as_tensor(saved["x"]), torch.as_tensor(saved["y"])
            self.spec.builds = int(saved["builds"])
        if "pool" in state:
            self.probe.set_pool(state["pool"])
