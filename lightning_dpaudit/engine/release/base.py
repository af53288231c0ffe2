"""What a release path is to the step pipeline: how canaries enter the optimizer's own
mechanism, where the release is read, and how the update is left as it would have been.

A path wraps the optimizer's methods on the instance (subclasses keep their overrides)
and, for each audited step, calls `read(view)` for every release it makes (a
ReleaseView) and `done()` when the step's release is complete. The pipeline does the rest.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import numpy as np

from ..canaries.base import Planted, ReleaseView
from .distributed import Collectives

Read = Callable[[ReleaseView], None]
Done = Callable[[], None]


@dataclass(frozen=True)
class PathSettings:
    """What a path may need beyond the optimizer and the pool reader.

    note_problem(code, message, step)   records a set-up problem the path finds
    sentinels                           pool positions whose noise is fingerprinted (None: too few)
    noise_std                           sigma * C, the noise's standard deviation
    noise_seed                          seeds the generator of releases that training never uses
    canary_clipping(step)               how the canaries are clipped at this step (see the field)
    """

    note_problem: Callable[[str, Optional[str], int], None]
    sentinels: Optional[np.ndarray]
    noise_std: float
    layer_names: Sequence[str]
    noise_seed: Optional[int] = None  # the audit's own noise for releases training never uses (paired mode)
    # how the canaries are clipped at a step: "optimizer" (the optimizer's own clipping), "compared" (that, compared
    # with a correct clipping: the exact checks' steps) or "correct" (planted as a correct clipping leaves them)
    canary_clipping: Callable[[int], str] = lambda step: "optimizer"


class ReleasePath(Protocol):
    local: bool  # True on one process; False where alarms wait for a check every rank reaches
    reads_on_device: bool  # a step's release is read without moving values to the host
    def attach(self, audited_step: Callable[[], None]) -> None:
        """Route the optimizer's noising through `audited_step` (on the instance)."""

    def detach(self) -> None:
        """Restore the optimizer's methods exactly as they were."""

    def release_plain(self) -> None:
        """The un-audited release (steps past `observe_steps`)."""

    def release(self, planted: Planted, *, step: int, paired: bool, read: Read, done: Done) -> None:
        """Release the step with the planted canaries; read each release; leave the un-audited update."""

    def agree(self, fired: list, recheck: Callable[[], list], note_problem) -> list:
        """The groups that fired, as every process sees them (one process: `fired`)."""


class LocalChecks:
    """Defaults for paths on one process: any options, one's own seed, nothing to agree on."""

    @staticmethod
    def check_options(options) -> None:
        pass

    @staticmethod
    def agree_on_seed(seed: Optional[int]) -> Optional[int]:
        return seed

    def verify_start(self, per_step: int, seed) -> None:
        pass

    def agree(self, fired: list, recheck, note_problem) -> list:
        return fired


class DistributedChecks:
    """Set-up of a path over several processes (needs `optimizer`, `probe`, `collectives`): one-run
    only, rank 0's seed on every rank, and every rank starting from the same settings, seed and pool
    (plus `start_values()`, what else must agree at the start)."""

    @staticmethod
    def check_options(options) -> None:
        if options.mode != "one-run":
            raise ValueError("a distributed audit runs in mode='one-run' (a second privatization would need a second release)")

    @staticmethod
    def agree_on_seed(seed: Optional[int]) -> int:
        return Collectives().agree_on_seed(seed)

    def verify_start(self, per_step: int, seed) -> None:
        opt = self.optimizer
        self.collectives.verify_same(
            np.concatenate([[per_step, float(opt.noise_multiplier), float(opt.max_grad_norm), seed],
                            self.probe.pool.cpu().numpy(), self.start_values()]),
            "the audit's settings, its seed or the model at the start",
        )

    def start_values(self) -> np.ndarray:
        return np.zeros(0)


def no_canaries(k: int) -> np.ndarray:
    return np.zeros(k, dtype=bool)


class AuditNoise:
    """Noise for a release the audit makes and training never uses (paired mode's second release).

    The optimizer's add_noise draws from `optimizer.generator`, or torch's global generator
    when that is None; either way, drawing the extra release there would shift every later
    training step's noise. Inside `use(optimizer)` the optimizer draws from the audit's own
    generator (one per device, seeded once), and the global generator's state is restored
    after, so training draws exactly what it would have drawn without the audit.
    """

    def __init__(self, seed: Optional[int]):
        self.seed = seed
        self.generators: dict = {}

    def generator(self, device):
        import torch

        key = str(device)
        if key not in self.generators:
            g = torch.Generator(device=device)
            if self.seed is None:
                g.seed()
            else:
                g.manual_seed(self.seed)
            self.generators[key] = g
        return self.generators[key]

    @contextmanager
    def use(self, optimizer):
        import torch

        params = list(optimizer.params)
        device = params[0].device if params else "cpu"
        saved = optimizer.generator
        optimizer.generator = self.generator(device)
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                yield
        finally:
            optimizer.generator = saved
