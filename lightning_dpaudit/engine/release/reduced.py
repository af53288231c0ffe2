"""DistributedDPOptimizer (DPDDP or DDP with make_private): each rank clips its shard, rank 0
alone adds the noise, and reduce_gradients all-reduces after the noise (see distributed.py).

Per audited step on rank r of W:

    add_noise:          in-canary j enters on rank j mod W (counting in-canaries only), so
                        each enters the reduced sum once and every rank's clipping is
                        exercised; rank r releases S_r + K_r (+ the noise on rank 0)
    reduce_gradients:   G = f (sum_r S_r + K_r + N), read where the replicas read it; one
                        all-reduce of S and K at the canaries' and sentinels' coordinates
                        (and of each rank's noise RMS) centres G / f on S; then G -= f K.

The observations are identical on every rank, hence the same AuditResult; this path reads
on the host every step (its all-reduce is per step anyway).
"""

from __future__ import annotations

import numpy as np

from ...analysis.monitor import SETUP
from ..canaries.base import Planted, ReleaseView
from ..canaries.gradient_probe import GradientProbe
from ..canaries.input_canaries import InputCanaries
from . import distributed as dist
from .base import DistributedChecks, PathSettings
from .per_sample import PerSampleRelease, restore_data_sum


class ReducedRelease(DistributedChecks, PerSampleRelease):
    local = False  # problems and alarms wait for a check that every rank reaches
    reads_on_device = False  # the per-step all-reduce reads on the host

    def __init__(self, optimizer, probe: GradientProbe, settings: PathSettings):
        super().__init__(optimizer, probe, settings)
        self.collectives = dist.Collectives()
        self.note_problem, self.sentinels, self.noise_std = settings.note_problem, settings.sentinels, settings.noise_std
        self._pending = None

    # ------------------------------------------------------------------ set-up, on every rank

    @staticmethod
    def check_options(options) -> None:
        DistributedChecks.check_options(options)
        if isinstance(options.canary, InputCanaries):
            raise ValueError(
                f"input canaries ({options.canary.kind!r}) are not supported under a DistributedDPOptimizer; "
                "use gradient canaries ('dirac', 'constant' or 'random')"
            )

    def start_values(self) -> np.ndarray:
        return dist.parameter_checksums(self.probe.params)  # the replicas start from the same model

    def attach(self, audited_step) -> None:
        super().attach(audited_step)
        self._reduce = self.optimizer.reduce_gradients
        self.optimizer.reduce_gradients = self._audited_reduce

    def detach(self) -> None:
        super().detach()
        del self.optimizer.reduce_gradients

    # ------------------------------------------------------------------ one step

    def release(self, planted: Planted, *, step: int, paired: bool, read, done) -> None:
        """This rank's part: plant its share of the in-canaries, release locally; the rest after the reduction."""
        probe, c = self.probe, self.collectives
        params = probe.params
        canaries = planted.canaries
        mine = np.zeros(len(canaries.is_in), dtype=bool)
        mine[np.flatnonzero(canaries.is_in)[c.rank :: c.size]] = True
        data = [p.summed_grad for p in params]
        data_at_pool = probe.at_pool(data)
        if mine.any():
            canaries_at_pool = probe.sum_at_pool(self.release_with(planted, mine, step))
        else:
            self.add_noise()
            canaries_at_pool = np.zeros(len(probe.pool))
        own_noise = (probe.at_pool([p.grad for p in params]) - data_at_pool - canaries_at_pool)[self._noise_coords()]
        restore_data_sum(params, data)
        noise_rms = float(np.sqrt(np.mean(own_noise**2))) / self.noise_std
        self._pending = (step, canaries, data_at_pool, canaries_at_pool, noise_rms, self._factor(), read, done)

    def _factor(self) -> float:
        opt = self.optimizer
        if opt.loss_reduction == "mean":
            return 1.0 / (float(opt.expected_batch_size) * opt.accumulated_iterations * self.collectives.size)
        return 1.0

    def _audited_reduce(self) -> None:
        self._reduce()
        pending, self._pending = self._pending, None
        if pending is None:  # a step past observe_steps
            return
        *values, read, done = pending
        read(self._observe_reduced(*values))
        done()

    def _observe_reduced(self, step, canaries, data_at_pool, canaries_at_pool, own_noise, factor) -> ReleaseView:
        """The reduced release G after one all-reduce of S and K at the canaries' and sentinels'
        coordinates (with each rank's noise); then G -= f K."""
        probe, c = self.probe, self.collectives
        params = probe.params
        n = len(probe.pool)
        read = np.unique(np.concatenate([canaries.pool_index.ravel(), np.arange(n)[self._noise_coords()]]))
        m = len(read)  # only the canaries' and the sentinels' pool positions are summed
        total = c.sum(np.concatenate([data_at_pool[read], canaries_at_pool[read], c.own_slot([own_noise])]))
        data, added = np.zeros(n), np.zeros(n)
        data[read], added[read] = total[:m], total[m : 2 * m]
        centered = probe.at_pool([p.grad for p in params]) / factor - data
        probe.subtract_at_pool([p.grad for p in params], added * factor)
        self._note_placement(total[2 * m : 2 * m + c.size], step + 1)
        return ReleaseView(None, None, centered, added, canaries.is_in, own=True)

    def _note_placement(self, noise_by_rank, step: int) -> None:
        noisy = [r for r in range(1, self.collectives.size) if noise_by_rank[r] > 1e-3]
        if noisy:
            self.note_problem(
                "noise_placement",
                f"noise entered on rank(s) {', '.join(map(str, noisy))} (RMS "
                f"{', '.join(f'{noise_by_rank[r]:.3g}' for r in noisy)} x sigma*C; rank 0: {noise_by_rank[0]:.3g}): "
                f"{type(self.optimizer).__name__} adds the noise on rank 0 only, so this code's noise depends on the "
                "ranks' layout (on one process it would add none, or the total is not the accountant's)",
                step,
            )

    def _noise_coords(self):
        return self.sentinels if self.sentinels is not None else slice(None)

    # ------------------------------------------------------------------ alarms, on every rank at one check

    def agree(self, fired: list, recheck, note_problem) -> list:
        """The ranks' observations are identical unless the reduction is broken, so one small
        all-reduce per check tells each rank whether any rank fired, and whether for a certainty
        of its own (an exact check of its data path); a rank that did not fire records why and
        alerts with it."""
        fired_anywhere, certain = self.collectives.sum(np.array([bool(fired), SETUP in fired], dtype=float)) > 0
        if fired_anywhere and not fired:
            if certain:
                note_problem("exact_check_other_rank", "another rank's exact checks found a problem in its own data "
                             "path (named in that rank's findings)")
            else:
                note_problem(
                    "rank_disagreement",
                    "another rank's audit fired while this rank's did not: the ranks released different "
                    "gradients (the all-reduce after the noise is missing or altered), so the replicas do not "
                    "apply one noised update",
                )
            fired = recheck()
        return fired
