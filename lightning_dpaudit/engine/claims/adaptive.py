"""Adaptive clipping (Andrew et al., 2021) as Opacus 1.6.0 ships it, audited.

Two set-ups: `AdaClipDPOptimizer` (make_private(clipping="adaptive")) and adaptive ghost
clipping (PrivacyEngineAdaptiveClipping, grad_sample_mode="ghost": a plain
DPOptimizerFastGradientClipping driven by the DPLossFastGradientAdaptiveClipping criterion).
Each step makes two releases of the batch:

    gradient  sum_i clip_C(g_i) + N(0, (sigma_g C)^2)    sigma_g = (sigma^-2 - (2 sigma_u)^-2)^(-1/2)
    count     #{i : ||g_i|| <= C} + N(0, sigma_u^2)     the next bound: C * exp(-eta (count / n - target))

AdaClip draws both in add_noise (sigma_u = unclipped_num_std) and moves C after the step;
the ghost criterion draws the count in backward (sigma_u = n / 20, n the batch), moves C
before the second backward pass and leaves sigma_g in `_adjusted_noise_multiplier`. Both
keep `noise_multiplier` = sigma, which the accountant composes: Theorem 1 takes the pair for
one Gaussian mechanism with 1/sigma^2 = 1/sigma_g^2 + 1/(2 sigma_u)^2 (the count's
sensitivity 1/2, a centred bit; Opacus releases the uncentred count over the batch's own
size, which leaks up to about 1/sigma_u under Poisson sampling, where the size is private:
the audit keeps the accountant's convention, docs/guide/changing-privacy-parameters.md).

The audit:
- canaries enter the gradient release only, through the optimizer's own clipping and noise;
  a step claims sigma_g in units of its C (`mechanism_of`, `AdaptiveClaims`); under ghost
  clipping min(sigma_g, sigma), since there sigma_g moves with each Poisson batch size
  (`AdaptiveNoise.claimed`);
- AdaClip counts whatever clip_and_accumulate clips, canary rows too: `AdaClipRelease` puts
  the data's own count back after the canaries' clipping (and after a second privatization
  in paired mode), so the bound follows the data alone and training is the un-audited one;
  the ghost count is drawn in backward, before the canaries exist;
- each step the accountant must compose sigma_acc with 1/sigma_acc^2 >= 1/sigma_g^2 +
  1/(2 sigma_u)^2, with sigma_g and sigma_u as the step used them (AdaClip: the standard
  deviations its add_noise passed to Opacus's _generate_noise, `NoiseTap`); less is the
  finding `adaptive_accounting`, a certainty (Opacus 1.1.3-1.5.4 composed sigma_g itself,
  #807).
"""

from __future__ import annotations

import math
import sys
import weakref
from dataclasses import replace
from typing import NamedTuple, Optional

import numpy as np
import torch

from ..options import Mechanism
from ..release.distributed import world_size
from ..release.ghost import is_ghost
from ..release.per_sample import PerSampleRelease
from .claim_range import check_claim
from .step_claim import StepClaims, claim_of

CODE = "adaptive_accounting"
RTOL = 1e-6  # mu^2 compared with this relative slack (float32 bounds)


def adjusted(sigma: float, sigma_u: float) -> float:
    """The gradient's noise multiplier Opacus derives (Theorem 1): (sigma^-2 - (2 sigma_u)^-2)^(-1/2)."""
    return (sigma ** -2 - (2.0 * sigma_u) ** -2) ** -0.5 if sigma > 0 else 0.0


class StepNoise(NamedTuple):
    """One adaptive step's two noises: the gradient's multiplier (units of C) and the count's std (None: unread)."""

    gradient: float
    count: Optional[float]

    @property
    def joint(self) -> float:
        """The single Gaussian mechanism's noise multiplier: (sigma_g^-2 + (2 sigma_u)^-2)^(-1/2) (0: no noise)."""
        if self.gradient <= 0 or self.count <= 0:
            return 0.0
        return (self.gradient ** -2 + (2.0 * self.count) ** -2) ** -0.5


def is_adaclip(optimizer) -> bool:
    return any(c.__name__ == "AdaClipDPOptimizer" for c in type(optimizer).__mro__)


# ---------------------------------------------------------------------- reading a step's noise


class NoiseTap:
    """The standard deviations an add_noise call passes to Opacus's `_generate_noise`, read as it runs.

    Every loaded opacus module holding `_generate_noise` gets a recording wrapper for the call only
    (restored after). Calls whose reference is a parameter's summed_grad are the gradient's."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.modules = [m for name, m in list(sys.modules.items())
                        if name.startswith("opacus.") and callable(vars(m).get("_generate_noise"))]
        self.measured: Optional[tuple] = None  # ((sigma, sigma_u) as the optimizer held them, StepNoise)

    def call(self, add_noise):
        opt, calls, saved = self.optimizer, [], []
        for module in self.modules:
            original = vars(module)["_generate_noise"]

            def recording(std, reference, *args, _original=original, **kwargs):
                calls.append((float(std), reference))
                return _original(std, reference, *args, **kwargs)

            saved.append((module, original))
            module._generate_noise = recording
        inputs = (float(opt.noise_multiplier), float(opt.unclipped_num_std))
        sums = [p.summed_grad for p in opt.params]
        try:
            return add_noise()
        finally:
            for module, original in saved:
                module._generate_noise = original
            C = float(opt.max_grad_norm)
            gradient = [std for std, ref in calls if any(ref is s for s in sums)]
            count = [std for std, ref in calls if not any(ref is s for s in sums)]
            if gradient:
                self.measured = (inputs, StepNoise(min(gradient) / C, min(count) if count else inputs[1]))

    def take(self) -> Optional[StepNoise]:
        """The noise of the last call, once (None: nothing measured since)."""
        measured, self.measured = self.measured, None
        return None if measured is None else measured[1]


_TAPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def tap_for(optimizer) -> NoiseTap:
    """The optimizer's one NoiseTap: the release path calls through it, the claims read it."""
    if optimizer not in _TAPS:
        _TAPS[optimizer] = NoiseTap(optimizer)
    return _TAPS[optimizer]


class AdaptiveNoise:
    """What an adaptive optimizer's step releases: `predict()` before it, `used(predicted)` after."""

    def __init__(self, optimizer, module=None):
        self.optimizer, self.module = optimizer, module
        self.adaclip = is_adaclip(optimizer)
        self.tap = tap_for(optimizer) if self.adaclip else None
        self._last: Optional[tuple] = None  # AdaClip: ((sigma, sigma_u), StepNoise) last measured

    def predict(self) -> Optional[StepNoise]:
        """This step's noises, None when the optimizer is not adaptive (a ghost optimizer no adaptive criterion drives)."""
        opt = self.optimizer
        if self.adaclip:
            inputs = (float(opt.noise_multiplier), float(opt.unclipped_num_std))
            if self._last is not None and self._last[0] == inputs:
                return self._last[1]  # what the optimizer drew with these values before
            return StepNoise(adjusted(*inputs), inputs[1])  # Opacus 1.6.0's AdaClipDPOptimizer.add_noise
        sigma_g = getattr(opt, "_adjusted_noise_multiplier", None)
        if sigma_g is None:
            return None
        return StepNoise(float(sigma_g), self._ghost_count_std())

    def claimed(self, noise: StepNoise) -> float:
        """The noise multiplier the step's canaries are read against: AdaClip's sigma_g (fixed while sigma and
        sigma_u are); under ghost clipping the smaller of sigma_g and noise_multiplier. Opacus 1.6.0 keeps sigma
        there, below sigma_g = (sigma^-2 - (n / 10)^-2)^(-1/2), which moves with every Poisson batch size n: a
        claim of a little more leak than the step has keeps the test valid and one claim segment for the run,
        where sigma_g itself opens a segment at the first step and one per few batch sizes after."""
        if self.adaclip:
            return noise.gradient
        return min(noise.gradient, float(self.optimizer.noise_multiplier))

    def used(self, predicted: StepNoise) -> StepNoise:
        """The noises of the step just released: as measured where the tap saw them, else as predicted."""
        if self.tap is None:
            return predicted
        inputs = None if self.tap.measured is None else self.tap.measured[0]
        measured = self.tap.take()
        if measured is None:
            return predicted
        self._last = (inputs, measured)
        return measured

    def _ghost_count_std(self) -> Optional[float]:
        """The ghost criterion's count noise, batch / 20 (Opacus 1.6.0's heuristic), on one process."""
        gsm = None if self.module is None else self.module()
        norms = None if gsm is None else getattr(gsm, "_per_sample_gradient_norms", None)
        if norms is None or world_size() > 1:  # several processes count the global batch: not read here
            return None
        return len(norms) / 20.0


# ---------------------------------------------------------------------- the claim


def mechanism_of(optimizer) -> Mechanism:
    """Mechanism.of, with an adaptive optimizer's gradient noise multiplier as the claim."""
    mechanism = Mechanism.of(optimizer)
    reader = AdaptiveNoise(optimizer) if (is_adaclip(optimizer) or is_ghost(optimizer)) else None
    noise = None if reader is None else reader.predict()
    return mechanism if noise is None else replace(mechanism, noise_multiplier=reader.claimed(noise))


def step_claims(optimizer, mechanism, accountant, *, module=None) -> StepClaims:
    """StepClaims for the optimizer; AdaptiveClaims where it is (or, under ghost clipping, may become) adaptive."""
    if is_adaclip(optimizer) or is_ghost(optimizer):
        return AdaptiveClaims(optimizer, mechanism, accountant, module=module)
    return StepClaims(optimizer, mechanism, accountant)


class AdaptiveClaims(StepClaims):
    """StepClaims whose adaptive steps claim the gradient's noise and check the accountant against both releases."""

    def __init__(self, optimizer, mechanism, accountant, *, module=None):
        super().__init__(optimizer, mechanism, accountant)
        self.noise = AdaptiveNoise(optimizer, module)
        self._step: Optional[StepNoise] = None  # the last step's predicted noise (None: not adaptive)
        self._read = self._claim()[0]

    def _claim(self):
        noise = self.noise.predict()
        if noise is None:
            return claim_of(self.optimizer), None
        bounds = (float(self.optimizer.max_grad_norm),) * len(self.optimizer.params)
        return (self.noise.claimed(noise), bounds), noise

    def before_step(self, step: int):
        now, self._step = self._claim()
        if now != self._read:
            sigma, bounds = now
            if self._step is None:
                check_claim(self.optimizer)
            elif not (sigma >= 0 and math.isfinite(sigma) and all(b > 0 and math.isfinite(b) for b in bounds)):
                raise ValueError(f"adaptive clipping: no privacy claim to audit (gradient noise multiplier {sigma}, "
                                 f"clipping bound {bounds[0]})")
            self.mechanism = replace(
                self.mechanism, clip_bounds=np.array(bounds, dtype=float), noise_multiplier=float(sigma),
                max_grad_norm=float(bounds[0]),
            )
            self._read = now
            self.on_change(self.mechanism)
        return self.mechanism

    def _accountant_problem(self, step: int) -> list:
        """An adaptive step composes the gradient's and the count's releases: the accountant's last entry, if it
        recorded the previous step, must be a noise multiplier at most their joint one."""
        if self._step is None:
            return super()._accountant_problem(step)
        used = self.noise.used(self._step)
        if not self._newly_accounted():
            return []
        if used.count is None or used.gradient == 0:  # no gradient noise: the finding no_noise, not this one
            return []
        recorded, joint = float(self.accountant.history[-1][0]), used.joint
        if joint <= 0 or recorded ** -2 < joint ** -2 * (1 - RTOL):
            return [(CODE, accounting_message(recorded, used, step))]
        return []


def accounting_message(recorded: float, used: StepNoise, step: int) -> str:
    alone = math.isclose(recorded, used.gradient, rel_tol=1e-4)
    return (
        f"adaptive clipping: the accountant composed noise multiplier {recorded:.4g} for step {step}"
        + (" (the gradient's own multiplier, as Opacus 1.1.3-1.5.4 did: #807)" if alone else "")
        + f", but the step released the clipped gradient with noise multiplier {used.gradient:.4g} and the unclipped "
        f"count with std {used.count:.4g}: together one Gaussian mechanism of noise multiplier {used.joint:.4g} = "
        "(sigma_g^-2 + (2 sigma_u)^-2)^(-1/2) (Theorem 1 of Andrew et al.), so the accountant's epsilon is too low. "
        f"Fix: let the accountant compose {used.joint:.4g} or less: keep optimizer.noise_multiplier at the sigma the "
        "run was calibrated for and let the optimizer derive the gradient's noise from it, as Opacus 1.6.0 does "
        "(upgrade from 1.5.4 or earlier)"
    )


# ---------------------------------------------------------------------- the release


class AdaClipRelease(PerSampleRelease):
    """PerSampleRelease for AdaClipDPOptimizer: the canaries never enter its unclipped count.

    The count (sample_size, unclipped_num) as the data's clip_and_accumulate left it is saved when
    the step's release begins; the optimizer's first add_noise of the step noises that count (the
    canaries' clipping in between is undone first), a later one (paired mode's second
    privatization) leaves the first one's noisy count, and a release that fails before noising
    leaves the data's. Its add_noise runs under the NoiseTap."""

    def attach(self, audited_step) -> None:
        super().attach(audited_step)
        self.tap = tap_for(self.optimizer)
        self._data = self._noised = None
        self._open = False
        noise = self.add_noise

        def add_noise():
            if not self._open:
                return self.tap.call(noise)
            if self._noised is None:
                self._restore(self._data)
                result = self.tap.call(noise)
                self._noised = self._save()
                return result
            try:
                return noise()
            finally:
                self._restore(self._noised)

        self.add_noise = add_noise

    def release(self, planted, *, step: int, paired: bool, read, done) -> None:
        self._data, self._noised, self._open = self._save(), None, True
        try:
            super().release(planted, step=step, paired=paired, read=read, done=done)
        finally:
            self._restore(self._data if self._noised is None else self._noised)
            self._open, self._data, self._noised = False, None, None

    def _save(self) -> tuple:
        opt = self.optimizer
        count = opt.unclipped_num
        return opt.sample_size, count.clone() if torch.is_tensor(count) else count

    def _restore(self, saved: tuple) -> None:
        count = saved[1]
        self.optimizer.sample_size, self.optimizer.unclipped_num = saved[0], count.clone() if torch.is_tensor(count) else count
