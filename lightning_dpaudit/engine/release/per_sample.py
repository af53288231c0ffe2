"""Per-sample clipping on one process (DPOptimizer and its per-layer subclasses).

Per audited step, with S = summed_grad after the optimizer clipped the real batch:

    K = clip_and_accumulate(canary rows)     the optimizer's own clipping code, at the steps the
                                             exact checks verify (compared there with a correct
                                             clipping); in between, the rows as a correct clipping
                                             leaves them (probe.preclipped), which costs O(k)
    R = add_noise() on S + K                 the optimizer's own noise
    read (R - S) at the pool; the update keeps R - K = S + noise, the un-audited one.

one-run: the in-canaries enter the one release. paired: the real release carries none
(every canary out), and a second privatization of S + K (all in), with noise from the
audit's own generator, gives the in-observations; the update keeps the first.
"""

from __future__ import annotations

import numpy as np

from ..canaries.base import Planted, ReleaseView
from ..canaries.gradient_probe import CanarySum, GradientProbe
from ..support.instance_patch import InstancePatch
from .base import AuditNoise, LocalChecks, PathSettings, no_canaries


class PerSampleRelease(LocalChecks):
    local = True  # one process: a set-up problem alarms at once
    reads_on_device = True  # readings stay on the device until a check

    def __init__(self, optimizer, probe: GradientProbe, settings: PathSettings):
        self.optimizer, self.probe, self.settings = optimizer, probe, settings
        self.audit_noise = AuditNoise(settings.noise_seed)

    def attach(self, audited_step) -> None:
        self._patch = InstancePatch(self.optimizer, "add_noise", audited_step)
        self.add_noise = self._patch.original

    def detach(self) -> None:
        self._patch.restore()

    def release_plain(self) -> None:
        self.add_noise()

    def gather_pool(self, tensors) -> "torch.Tensor":
        """Per-parameter tensors' values at the pool coordinates (the clipped-sum ledger reads through it)."""
        return self.probe.gather(tensors)

    @staticmethod
    def all_finite(finite: bool) -> bool:
        """Whether every process found its tensors finite (here: this one)."""
        return finite

    def summed_grads(self) -> list:
        """The optimizer's accumulated clipped sums, one per tensor (None before the first physical batch)."""
        return [p.summed_grad for p in self.probe.params]

    def release(self, planted: Planted, *, step: int, paired: bool, read, done) -> None:
        params = self.probe.params
        data = [p.summed_grad for p in params]
        try:
            if not paired:
                added = self.release_with(planted, planted.is_in, step)
                try:
                    read(self.view(data, added, planted.is_in, own=True))
                finally:  # the update is the un-audited one even if the reading fails
                    added.remove_from([p.grad for p in params])
            else:
                self.add_noise()
                released = [p.grad for p in params]  # add_noise assigns new tensors: these stay as they are
                try:
                    read(self.view(data, None, no_canaries(len(planted.is_in)), own=True))
                    every = np.ones(len(planted.is_in), dtype=bool)
                    with self.audit_noise.use(self.optimizer):  # training's noise stream stays as it was
                        added = self.release_with(planted, every, step)
                    read(self.view(data, added, every, own=False))
                finally:
                    for p, r in zip(params, released):
                        p.grad = r
        finally:
            restore_data_sum(params, data)
        done()

    def view(self, data, added, is_in, *, own: bool) -> ReleaseView:
        """The release now in p.grad, centred on the data's sum, gathered at the pool on the device."""
        released = [p.grad for p in self.probe.params]
        centered = self.probe.difference(released, data)
        at_pool = None if added is None or added.at_sentinels is not None else self.probe.gather_sum(added)
        return ReleaseView(released, data, centered, at_pool, is_in, own, canary_sum=added)

    def release_with(self, planted: Planted, which: np.ndarray, step: int) -> CanarySum:
        """Release data + the selected canaries through the optimizer's noise; summed_grad is the data's again after."""
        params = self.probe.params
        added = self.canary_sum(planted, which, step)
        added.enter(params)
        try:
            self.add_noise()
            for p in params:  # a release that is a view of summed_grad (a rank without noise) keeps its canaries
                if p.grad.data_ptr() == p.summed_grad.data_ptr():
                    p.grad = p.grad.clone()
        finally:  # summed_grad is the data's own again, whatever add_noise did
            added.leave(params)
        return added


    def canary_sum(self, planted: Planted, which: np.ndarray, step: int) -> CanarySum:
        """K of the selected canaries, as settings.canary_clipping says for the step: through the optimizer's own
        clipping (compared with a correct clipping at the steps that verify it: a difference is finding
        `canary_clipping`), or as a correct clipping leaves them. Kinds without pre-clipped sums always clip."""
        how = self.settings.canary_clipping(step) if planted.preclipped is not None else "optimizer"
        if how == "correct":
            return planted.preclipped(which)
        clipped = self.probe.clip(self.optimizer, *planted.rows(which))
        if how == "compared":
            problem = self.probe.clipping_problem(clipped, planted.preclipped(which), self.settings.layer_names)
            if problem is not None:
                self.settings.note_problem("canary_clipping", f"{problem} (step {step})", step)
        return clipped


def restore_data_sum(params, data_sum) -> None:
    """summed_grad as the un-audited step leaves it: the data's own clipped sum, marked as noised."""
    for p, s in zip(params, data_sum):
        p.summed_grad = s
        s._processed = True
