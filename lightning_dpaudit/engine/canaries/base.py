"""What a canary kind is to the step pipeline: what it plants, and how a release is read for it.

A kind plants a step's canaries (`plant`), leaving the path to put them through the
optimizer's own clipping and noise; it then reads each release the path makes
(`read`): one normalized observation per canary, N(0, s^2) when out and N(1, s^2) when
in for a correct optimizer (s the noise multiplier), and the release's noise at the
sentinel coordinates. Readings stay on the parameters' device until a check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Protocol, Sequence, Tuple, Union

import numpy as np
import torch

from ...analysis.record import SENTINELS

Array = Union[np.ndarray, torch.Tensor]


@dataclass
class Planted:
    """A step's canaries, as the release path needs them.

    is_in   (k,) the canaries that enter the optimizer's release (one-run design)
    rows    rows(which) -> (rows, columns): per-sample gradient rows of the selected
            canaries, per tensor (columns[l] the flat coordinates they cover, None for
            parameter-shaped rows)
    preclipped  preclipped(which) -> the selected canaries' sum as a correct clipping leaves
            it (gradient_probe.py), planted without the optimizer's clipping between the steps it is
            verified at; None for kinds whose rows are not known in advance (input canaries)
    """

    is_in: np.ndarray
    rows: Callable[[np.ndarray], Tuple[List[torch.Tensor], list]]
    canaries: object = None  # the kind's own record of what it planted
    preclipped: Optional[Callable[[np.ndarray], object]] = None  # which -> CanarySum as correct clipping leaves them
    device: object = None  # what the kind made ready on the device to read them with (None: nothing)


@dataclass
class ReleaseView:
    """One release, as the kind reads it.

    released / data   R and S per tensor (None where the path reads at the pool only)
    centered          R - S at the pool coordinates (float64)
    added             K, the canaries' clipped sum, at the pool coordinates (None: no canaries, or K known at
                      the sentinels only, as canary_sum.at_sentinels)
    canary_sum        K per tensor (a probe.CanarySum; None: no canaries, or not kept by the path)
    is_in             (k,) the canaries this release carries
    own               True for the optimizer's own release (its noise is fingerprinted)
    """

    released: Optional[Sequence[torch.Tensor]]
    data: Optional[Sequence[torch.Tensor]]
    centered: Array
    added: Optional[Array]
    is_in: np.ndarray
    own: bool
    canary_sum: object = None


@dataclass
class Reading:
    """One release's observations: host-side layer and is_in, values and sentinel noise wherever they were computed."""

    layer: np.ndarray
    is_in: np.ndarray
    value: Array
    noise: Optional[Array]


class CanaryKind(Protocol):
    name: str
    reads_on_device: bool  # a step's reading moves nothing to the host
    layer_names: List[str]
    layer_claims: dict  # observation group -> claimed mu

    def plant(self, step: int, *, all_in: bool) -> Planted: ...

    def read(self, planted: Planted, view: ReleaseView) -> Reading: ...

    def finish_step(self) -> None: ...

    def set_claim(self, mechanism) -> None:
        """The optimizer's bounds or noise changed: plant and read the next steps in the new units (and claims)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def sentinel_noise(view: ReleaseView, sentinels, noise_std: float) -> Optional[Array]:
    """R - S - K at the sentinels, in units of sigma*C, for the optimizer's own release (else None)."""
    if sentinels is None or not view.own:
        return None
    at_sentinels = getattr(view.canary_sum, "at_sentinels", None)  # K there, computed in advance
    if at_sentinels is not None:
        return (view.centered[sentinels] - at_sentinels) / noise_std
    noise = view.centered if view.added is None else view.centered - view.added
    return noise[sentinels] / noise_std


def sentinel_positions(pool_size: int):
    """SENTINELS pool positions spread evenly over the pool (None when the pool is too small)."""
    if pool_size < SENTINELS:
        return None
    return np.linspace(0, pool_size - 1, SENTINELS).astype(int)
