"""Training that diverged: a parameter, a gradient or a release (the noised gradient the optimizer applies) holding
a NaN or an infinity.

From that step on every comparison the audit makes (canary observations, exact checks, replays) compares
non-finite values and says nothing about privacy: the audit records `training_diverged` at the first such step
(a fault, no alarm) and observes nothing after it. Per step nothing is added: the step's readings, moved to the
host at the next check (readings.py), are tested there.
"""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
import torch

from ...analysis.results import DIVERGED as CODE


def finite_flag(tensors: Iterable) -> torch.Tensor:
    """A 0-d bool tensor on the first tensor's device: every value of every tensor is finite (no host sync; a
    sharded tensor's own shard, with no collective)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if torch.is_tensor(t)]
    flags = [torch.isfinite(t).all() for t in local]
    if not flags:
        return torch.tensor(True)
    device = flags[0].device
    return torch.stack([f if f.device == device else f.to(device) for f in flags]).all()


def release_finite(view) -> bool:
    """Whether a release read on the host is finite at the pool (a kind that reads on the host: numpy, no sync)."""
    return bool(np.isfinite(np.asarray(view.centered)).all())


def reading_finite(reading) -> bool:
    """Whether a step's readings (its canaries' observations and sentinel noise, on the host) are finite. A NaN or an
    infinity anywhere in a release reaches the parameters, and through them every value of the next step's release:
    read this way divergence is seen at most a step late, at no cost per step. Before a problem is recorded,
    `training_finite` tests everything (the pipeline)."""
    return bool(np.isfinite(reading.value).all()) and (reading.noise is None or bool(np.isfinite(reading.noise).all()))


def nonfinite_steps(readings) -> list:
    """The steps (from 1) of the readings that are not finite (reading_finite), all of them tested at once first."""
    parts = [part for r in readings for part in (r.value, r.noise) if part is not None]
    if not parts or bool(np.isfinite(np.concatenate([part.ravel() for part in parts])).all()):
        return []
    return [r.step + 1 for r in readings if not reading_finite(r)]


def training_finite(params) -> bool:
    """The parameters, their gradients and the data's clipped sums are finite now (one host sync)."""
    params = list(params)
    return bool(finite_flag(params + [getattr(p, name, None) for p in params for name in ("grad", "summed_grad")]))


def message(step: int) -> str:
    return (f"training diverged at step {step}: a parameter, a gradient or the release (the noised gradient the "
            "optimizer applies) is NaN or inf (a learning rate, clipping bound or noise too large for the model's "
            "precision?); comparisons of non-finite values say nothing about privacy, so nothing from this step on "
            "is observed or checked")


def diverged_step(problems) -> Optional[int]:
    """The step of a `training_diverged` record among an audit's problems (a resumed audit stays stopped)."""
    return next((f.first_step for f in problems if f.code == CODE), None)
