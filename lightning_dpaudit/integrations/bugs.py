"""The bug zoo: deliberately broken Opacus DP optimizers, to show that an audit catches them.

``inject_bug(optimizer, name)`` swaps the class of the optimizer returned by
``PrivacyEngine.make_private`` for a subclass whose mixin overrides one template
step (``clip_and_accumulate`` or ``add_noise``). The claimed ``noise_multiplier``
and ``max_grad_norm`` (used by the accountant), ``step_hook`` and all other
attributes are kept. Noise bugs replace subclasses' own ``add_noise`` (AdaClip); on a
DistributedDPOptimizer they keep its layout (noise on rank 0 only). ``DISTRIBUTED_BUGS``
break that layout itself and need a DistributedDPOptimizer.
"""

from __future__ import annotations

import random
from typing import Dict, List

import torch
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.optimizers.optimizer import _check_processed_flag, _generate_noise, _mark_as_processed

from ..engine.release.distributed import sample_rate_of
from .ghost_bugs import GHOST_BUGS, inject_ghost_bug

__all__ = ["BUGS", "DISTRIBUTED_BUGS", "GHOST_BUGS", "inject_bug", "list_bugs"]


class _Bug:
    """Base mixin. ``options`` maps option names to defaults (set as attributes on injection);
    ``_prepare`` then validates them and sets up state, before the class is swapped."""

    options: Dict[str, object] = {}

    def _prepare(self) -> None:
        pass

    def _accumulate(self, grads: List[torch.Tensor]) -> None:
        """Add one tensor per parameter into ``p.summed_grad``; mark ``p.grad_sample`` used."""
        for p, grad in zip(self.params, grads):
            _check_processed_flag(p.grad_sample)
            p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad
            _mark_as_processed(p.grad_sample)


class _NoiseBug(_Bug):
    """DPOptimizer.add_noise with hooks: per-parameter ``_stds``, ``_noise_generator``, ``_noise``."""

    def _stds(self) -> List[float]:
        return [self.noise_multiplier * self.max_grad_norm] * len(self.params)

    def _noise_generator(self):
        return self.generator

    def _noise(self, index: int, reference: torch.Tensor, std: float, generator) -> torch.Tensor:
        return _generate_noise(std, reference, generator, self.secure_mode)

    def _noises_here(self) -> bool:
        """A DistributedDPOptimizer adds noise on rank 0 only; other ranks pass their sum on (FSDP: every rank)."""
        return getattr(self, "rank", 0) == 0 or hasattr(self, "grad_state")

    def add_noise(self):
        if hasattr(self, "grad_state"):  # FSDP: each rank noises its shards of the averaged sum
            generator, world = self._noise_generator(), self.world_size if self.loss_reduction == "mean" else 1
            for i, (p, std) in enumerate(zip(self.params, self._stds())):
                p.grad = (self.grad_state[p]["summed_grad"] + self._noise(i, p.grad, std, generator) / world).view_as(p)
            return
        if not self._noises_here():
            for p in self.params:
                p.grad = p.summed_grad.view_as(p)
            return
        generator = self._noise_generator()
        for i, (p, std) in enumerate(zip(self.params, self._stds())):
            _check_processed_flag(p.summed_grad)
            p.grad = (p.summed_grad + self._noise(i, p.summed_grad, std, generator)).view_as(p)
            _mark_as_processed(p.summed_grad)


class BatchClipping(_Bug):
    """Clip the batch-mean gradient (all parameters jointly) to C, then multiply by n."""

    def clip_and_accumulate(self):
        samples = [self._get_flat_grad_sample(p).to(p.dtype) for p in self.params]
        n = len(samples[0])
        means = [g.sum(dim=0) / max(n, 1) for g in samples]
        norm = torch.stack([m.norm(2) for m in means]).norm(2)
        factor = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        self._accumulate([m * factor * n for m in means])


class NoClipping(_Bug):
    """Sum the per-sample gradients without clipping them."""

    def clip_and_accumulate(self):
        self._accumulate([self._get_flat_grad_sample(p).to(p.dtype).sum(dim=0) for p in self.params])


class FewSeeds(_NoiseBug):
    """Draw each step's noise from a generator re-seeded with one of ``num_seeds`` seeds."""

    options = {"num_seeds": 100, "seed_chooser_seed": 0}  # a fixed default: the zoo reproduces

    def _prepare(self) -> None:
        self._seed_chooser = random.Random(self.seed_chooser_seed)

    def _noise_generator(self):
        seed = self._seed_chooser.randrange(self.num_seeds)
        return torch.Generator(device=self.params[0].device).manual_seed(seed)


class WrongNoise(_NoiseBug):
    """Apply ``applied_noise_multiplier`` (default: claimed * 2.5 / 3), or ``factor`` x the claim of each step, while claiming the original."""

    options = {"applied_noise_multiplier": None, "factor": None}

    def _prepare(self) -> None:
        if self.factor is not None:
            if self.applied_noise_multiplier is not None:
                raise ValueError("give `applied_noise_multiplier` or `factor`, not both")
            if not 0.0 < float(self.factor):
                raise ValueError(f"Unexpected value for `factor`: {self.factor}; use a number > 0")
        elif self.applied_noise_multiplier is None:
            self.applied_noise_multiplier = self.noise_multiplier * 2.5 / 3.0

    def _stds(self):
        sigma = self.applied_noise_multiplier if self.factor is None else self.factor * self.noise_multiplier
        return [sigma * self.max_grad_norm] * len(self.params)


class MeanSensitivity(_NoiseBug):
    """Noise std noise_multiplier * C / B (the sensitivity of the mean, not of the sum)."""

    def _prepare(self) -> None:
        if not self.expected_batch_size:
            raise ValueError("mean-sensitivity needs the optimizer's expected_batch_size")

    def _stds(self):
        return [std / self.expected_batch_size for std in super()._stds()]


class NoNoise(_NoiseBug):
    """Add no noise at all."""

    def _stds(self):
        return [0.0] * len(self.params)


class ReusedNoise(_NoiseBug):
    """Draw the noise once and add the same vector at every step."""

    def _prepare(self) -> None:
        self._reused_noise: Dict[int, torch.Tensor] = {}

    def _noise(self, index, reference, std, generator):
        if index not in self._reused_noise:
            self._reused_noise[index] = super()._noise(index, reference, std, generator)
        return self._reused_noise[index]


class AntitheticNoise(_NoiseBug):
    """Every second step adds the negation of the previous step's noise (antithetic noise: two releases' sum has none)."""

    def _prepare(self) -> None:
        self._to_negate: Dict[int, torch.Tensor] = {}

    def _noise(self, index, reference, std, generator):
        if index in self._to_negate:
            return -self._to_negate.pop(index)
        self._to_negate[index] = noise = super()._noise(index, reference, std, generator)
        return noise


class CorrelatedNoise(_NoiseBug):
    """Noise z_t = correlation z_(t-lag) + sqrt(1 - correlation^2) fresh: the right size, correlated with lag steps back."""

    options = {"correlation": 0.8, "lag": 1}

    def _prepare(self) -> None:
        if not -1.0 <= float(self.correlation) <= 1.0:
            raise ValueError(f"Unexpected value for `correlation`: {self.correlation}; use a number in [-1, 1]")
        if int(self.lag) < 1:
            raise ValueError(f"Unexpected value for `lag`: {self.lag}; use an integer >= 1")
        self._past: Dict[int, List[torch.Tensor]] = {}  # per parameter, the last `lag` steps' noise, oldest first

    def _noise(self, index, reference, std, generator):
        a, past = float(self.correlation), self._past.setdefault(index, [])
        noise = super()._noise(index, reference, std, generator)
        if len(past) == int(self.lag):
            noise = a * past.pop(0) + (1.0 - a * a) ** 0.5 * noise
        past.append(noise)
        return noise


class UnnoisedLayer(_NoiseBug):
    """Parameter tensor number ``layer_index`` (default: the last) gets no noise."""

    options = {"layer_index": -1}

    def _prepare(self) -> None:
        if not -len(self.params) <= self.layer_index < len(self.params):
            raise ValueError(f"layer_index {self.layer_index} out of range for {len(self.params)} parameters")

    def _stds(self):
        stds = super()._stds()
        stds[self.layer_index] = 0.0
        return stds


class HalfNoiseLastLayer(_NoiseBug):
    """The last parameter tensor gets half the noise std."""

    def _stds(self):
        stds = super()._stds()
        stds[-1] /= 2.0
        return stds


class NoiseOnOtherRank(_NoiseBug):
    """Distributed: the noise is added on the last rank instead of rank 0 (none on a single process)."""

    def _noises_here(self) -> bool:
        return self.rank == self.world_size - 1 and self.world_size > 1


class NoiseOverWorldSize(_NoiseBug):
    """Distributed: rank 0's noise std divided by the world size, as if each rank added its share."""

    def _stds(self):
        return [std / self.world_size for std in super()._stds()]


class SkippedReduction(_Bug):
    """Distributed: reduce_gradients skips the all-reduce; each replica applies its own shard's gradient."""

    def reduce_gradients(self):
        if self.loss_reduction == "mean":
            for p in self.params:
                p.grad /= self.world_size


_DISTRIBUTED_MIXINS = {
    "noise-on-other-rank": NoiseOnOtherRank,
    "noise-over-world-size": NoiseOverWorldSize,
    "skipped-reduction": SkippedReduction,
}


class _Reseeded(_NoiseBug):
    """Noise from a generator of the bug's own, seeded with ``noise_seed`` and re-seeded when
    ``_reseed_before(step)`` says so (``step``: noised steps done so far)."""

    def _prepare(self) -> None:
        self._noise_source = torch.Generator(device=self.params[0].device).manual_seed(int(self.noise_seed))
        self._noised_steps = 0

    def _reseed_before(self, step: int) -> bool:
        raise NotImplementedError

    def _noise_generator(self):
        return self._noise_source

    def pre_step(self, closure=None):
        if self._noised_steps and self._reseed_before(self._noised_steps):
            self._noise_source.manual_seed(int(self.noise_seed))
        noised = super().pre_step(closure)
        if noised:
            self._noised_steps += 1
        return noised


class ReseededResume(_Reseeded):
    """A resume after ``resume_at`` steps re-seeds the noise generator: step resume_at + 1 replays step 1's noise."""

    options = {"resume_at": 300, "noise_seed": 0}

    def _prepare(self) -> None:
        if int(self.resume_at) < 1:
            raise ValueError(f"resume_at must be >= 1, got {self.resume_at}")
        _Reseeded._prepare(self)  # the class is not swapped yet: no super() here

    def _reseed_before(self, step: int) -> bool:
        return step == int(self.resume_at)


class ReseedEachEpoch(_Reseeded):
    """The noise generator is re-seeded at each epoch start (``epoch_steps``: default from the accountant's sample rate)."""

    options = {"epoch_steps": None, "noise_seed": 0}

    def _prepare(self) -> None:
        if self.epoch_steps is None:
            self.epoch_steps = _steps_per_epoch(self)
        if self.epoch_steps is None or int(self.epoch_steps) < 1:
            raise ValueError(
                "reseed-each-epoch needs the steps per epoch: pass epoch_steps=..., or inject it into an optimizer "
                "returned by make_private, whose accountant hook knows the sample rate"
            )
        _Reseeded._prepare(self)

    def _reseed_before(self, step: int) -> bool:
        return step % int(self.epoch_steps) == 0


def _steps_per_epoch(optimizer):
    """1 / sample rate, read from the accountant hook make_private attaches (it sets the rate to 1 / len(loader))."""
    rate = sample_rate_of(optimizer)
    return max(1, round(1.0 / rate)) if rate else None


_MIXINS = {
    "batch-clipping": BatchClipping,
    "few-seeds": FewSeeds,
    "wrong-noise": WrongNoise,
    "mean-sensitivity": MeanSensitivity,
    "no-noise": NoNoise,
    "no-clipping": NoClipping,
    "reused-noise": ReusedNoise,
    "unnoised-layer": UnnoisedLayer,
    "half-noise-last-layer": HalfNoiseLastLayer,
    "reseeded-resume": ReseededResume,
    "reseed-each-epoch": ReseedEachEpoch,
    "antithetic-noise": AntitheticNoise,
    "correlated-noise": CorrelatedNoise,
}

BUGS: Dict[str, str] = {name: m.__doc__.strip().replace("``", "") for name, m in _MIXINS.items()}
DISTRIBUTED_BUGS: Dict[str, str] = {name: m.__doc__.strip() for name, m in _DISTRIBUTED_MIXINS.items()}

_CLASS_CACHE: Dict[tuple, type] = {}


def list_bugs() -> List[str]:
    """Names of the available bugs, in definition order."""
    return list(BUGS)


def inject_bug(optimizer: DPOptimizer, name: str, *, module=None, **options) -> DPOptimizer:
    """Turn ``optimizer`` into the buggy variant ``name`` in place and return it.

    ``options`` set bug parameters (e.g. ``num_seeds``, ``applied_noise_multiplier``,
    ``layer_index``, ``resume_at``, ``epoch_steps``, ``correlation``, ``lag``); the claimed
    ``noise_multiplier``/``max_grad_norm`` are left alone.
    GHOST_BUGS break the ghost-clipping module instead: give it as ``module``.
    """
    if not isinstance(optimizer, DPOptimizer):
        raise TypeError(
            f"inject_bug needs an Opacus DPOptimizer, got {type(optimizer).__name__}; "
            "pass the optimizer returned by PrivacyEngine.make_private"
        )
    if name in GHOST_BUGS:
        return inject_ghost_bug(optimizer, module, name)
    if name in _DISTRIBUTED_MIXINS and not hasattr(optimizer, "world_size"):
        raise TypeError(f"{name!r} breaks a DistributedDPOptimizer's noise layout; got {type(optimizer).__name__}")
    mixins = {**_MIXINS, **_DISTRIBUTED_MIXINS}
    if name not in mixins:
        raise ValueError(f"unknown bug {name!r}; valid names: {', '.join([*BUGS, *DISTRIBUTED_BUGS, *GHOST_BUGS])}")
    mixin, base = mixins[name], type(optimizer)
    if "clip_and_accumulate" in vars(mixin) and isinstance(optimizer, DPOptimizerFastGradientClipping):
        raise TypeError(f"{name!r} needs per-sample gradients; ghost clipping optimizers have none")
    unknown = sorted(set(options) - set(mixin.options))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for {name!r}; valid: {sorted(mixin.options)}")
    for key, default in mixin.options.items():
        setattr(optimizer, key, options.get(key, default))
    mixin._prepare(optimizer)  # validates options; the class is not swapped yet
    if (mixin, base) not in _CLASS_CACHE:
        _CLASS_CACHE[mixin, base] = type(f"{mixin.__name__}{base.__name__}", (mixin, base), {})
    optimizer.__class__ = _CLASS_CACHE[mixin, base]
    optimizer.injected_bug = name
    return optimizer
