"""PrivacyAuditor: white-box gradient-canary audit of an Opacus DPOptimizer, in place.

Per noised step (Tight Auditing, Algorithm 2, with the privatized sum read directly):

    S  = summed_grad after the optimizer clipped the real batch (its own code)
    K  = what the optimizer's own clip_and_accumulate adds for the in-canary rows
    R  = released gradient after the optimizer's own add_noise = S + K + noise
    observation_i = <w_i, R - S - predicted repeat noise> / C_l          (one per canary)
    the update keeps R - K = S + noise, exactly what it would be without the auditor.

Centering on S removes the data's own gradient, so for a correct optimizer an
out-observation is N(0, s^2) and an in-observation N(1, s^2) with s the noise
multiplier in the canary's units: the step is (1/s)-GDP for each canary. In "paired"
mode the real release carries no canaries (out-observations) and a second, independent
privatization of S + K gives the in-observations.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Callable, Optional

import numpy as np
import torch

from . import distributed as dist
from .. import estimators as est
from ..estimators.live_epsilon import LiveEpsilon
from .canaries import DEFAULT_POOL, KINDS, CanarySampler, choose_pool
from ..analysis.findings import Evidence, diagnose
from .input_canaries import INPUT_KINDS, InputCanaries
from .input_probe import InputProbe, check_input_model
from ..analysis.monitor import POOLED, REPEATS, SETUP, AnytimeMonitor
from ..analysis.noise_fingerprints import NoiseFingerprints
from ..analysis.observations import ObservationLog
from .probe import GradientProbe
from ..analysis.results import AuditResult, Finding, LayerAudit, violation_message

MODES = ("one-run", "paired")
DEFAULT_GRADIENT_CANARIES = 1024
SENTINELS = 128  # pool coordinates whose noise fingerprints each step (NoiseFingerprints)
REPEAT_ALPHA = 1e-6  # false-alarm budget of the noise-repeat test, taken from the pooled test's share
ALL_LAYERS = "all parameters"  # the one group of input canaries, whose gradients span every tensor


class PrivacyViolationWarning(UserWarning):
    """The audited optimizer leaks more than its noise multiplier claims."""


def _find_accountant(optimizer):
    """The Opacus accountant whose hook make_private attached, if any."""
    from opacus.accountants.accountant import IAccountant

    for cell in getattr(optimizer.step_hook, "__closure__", None) or ():
        if isinstance(cell.cell_contents, IAccountant):
            return cell.cell_contents
    return None


def _check_optimizer(optimizer):
    from opacus.optimizers import DPOptimizer

    if not isinstance(optimizer, DPOptimizer):
        raise TypeError(
            f"PrivacyAuditor needs an Opacus DPOptimizer, got {type(optimizer).__name__}: pass the optimizer "
            "returned by `PrivacyEngine.make_private(...)`"
        )
    name = type(optimizer).__name__
    dist.check_supported(optimizer)
    if any("FastGradientClipping" in c.__name__ for c in type(optimizer).__mro__):
        raise TypeError(
            f"{name} uses fast (ghost) gradient clipping: per-sample gradients never exist, so gradient canaries "
            "cannot enter its clipping. Use grad_sample_mode='hooks' (the default) for an audited run."
        )
    if any(c.__name__ == "AdaClipDPOptimizer" for c in type(optimizer).__mro__):
        raise TypeError("AdaClipDPOptimizer adapts its clipping bound to the batch; canary rows would bias it")
    if getattr(optimizer, "_dpaudit_auditor", None) is not None:
        raise RuntimeError("a PrivacyAuditor is already attached to this optimizer; call its detach() first")
    if not optimizer.noise_multiplier or optimizer.noise_multiplier <= 0:
        raise ValueError(
            f"Unexpected value for the optimizer's noise_multiplier: {optimizer.noise_multiplier}; "
            "with no noise there is no privacy claim to audit"
        )


class PrivacyAuditor:
    """Plants canaries in every noised step of `optimizer` and bounds epsilon.

    canary: a gradient canary kind ("dirac", "constant", "random"), an input canary kind
    ("mislabeled", "blank", "adversarial", "crafted") or an InputCanaries object.
    canaries_per_step: canaries per noised step (one-run: half in, half out; paired: all
    in the second release, all out in the first); "auto" (default) follows auto_canaries:
    1,024 gradient canaries (fewer on models under 2,048 coordinates), 32 input canaries.
    canary_scale: canary norm as a multiple
    of the clipping bound (> 1 audits clipping). moving: fresh coordinates each step.
    support: coordinates per canary for "constant" and "random".
    Input canaries: module (the GradSampleModule) is required; canary_inputs /
    canary_labels are in-distribution examples held out from training, loss_fn the
    summed training loss (default cross-entropy), recraft_every the steps between
    rebuilds of adversarial and crafted canaries.
    observe_steps: plant and observe canaries in the first observe_steps noised steps
    only (None: all steps); later steps run un-audited.
    observation_window: how many of the latest raw observations `observations()` keeps
    (the counts, bounds and histograms cover every observation).
    on_violation: called once with the AuditResult when the alarm first fires (default:
    one PrivacyViolationWarning).
    checksum_every: under a DistributedDPOptimizer, the steps between checks that every
    replica holds the same parameters (see distributed.py; 0 turns them off).
    """

    def __init__(
        self,
        optimizer,
        *,
        accountant=None,
        delta: float = 1e-5,
        confidence: float = 0.95,
        canary="dirac",
        canaries_per_step="auto",
        mode: str = "one-run",
        estimator: str = "gdp-cp",
        seed: Optional[int] = None,
        canary_scale: float = 2.0,
        moving: bool = True,
        support: int = 16,
        check_every: int = 1,
        module: Optional[torch.nn.Module] = None,
        on_violation: Optional[Callable[[AuditResult], None]] = None,
        canary_inputs: Optional[torch.Tensor] = None,
        canary_labels: Optional[torch.Tensor] = None,
        loss_fn: Optional[Callable] = None,
        recraft_every="auto",
        observe_steps: Optional[int] = None,
        observation_window: int = 65_536,
        checksum_every: int = 100,
    ):
        _check_optimizer(optimizer)
        self.collectives = dist.Collectives() if dist.is_reducing(optimizer) and dist.world_size() > 1 else None
        if self.collectives is not None:
            _check_distributed_options(canary, mode)
            seed = self.collectives.agree_on_seed(seed)
        if estimator == "katz":
            raise ValueError(
                "estimator 'katz' bounds pure epsilon-DP, which no Gaussian mechanism has; use gdp-cp, gdp-bayes, "
                "epsdelta-cp or epsdelta-bayes"
            )
        est.epsilon_lower_bound([], [], delta=delta, method=estimator, confidence=confidence)  # validates all three
        if delta <= 0:
            raise ValueError(f"Unexpected value for `delta`: {delta}; the audit compares GDP curves, which need delta > 0")
        if mode not in MODES:
            raise ValueError(f"Unexpected value for `mode`: {mode!r}; valid modes are {', '.join(MODES)}")
        min_canaries = 2 if mode == "one-run" else 1
        if canaries_per_step == "auto":
            canaries_per_step = auto_canaries(canary, sum(p.numel() for p in optimizer.params), support)
        if isinstance(canaries_per_step, str) or int(canaries_per_step) < min_canaries:
            raise ValueError(f"Unexpected value for `canaries_per_step`: {canaries_per_step}; {mode} needs >= {min_canaries}")
        if canary_scale <= 0 or check_every < 1:
            raise ValueError(f"`canary_scale` must be > 0 and `check_every` >= 1; got {canary_scale}, {check_every}")
        if observe_steps is not None and int(observe_steps) < 1:
            raise ValueError(f"Unexpected value for `observe_steps`: {observe_steps}; use an integer >= 1 or None")
        if isinstance(canary, str) and canary in INPUT_KINDS:
            canary = InputCanaries(
                canary, inputs=canary_inputs, labels=canary_labels, loss_fn=loss_fn, recraft_every=recraft_every
            )
        self.input = canary if isinstance(canary, InputCanaries) else None
        if self.input is not None:
            check_input_model(module, list(optimizer.params), self.input)
            self.input.options["norm_floor"] = float(optimizer.max_grad_norm)
        elif canary not in KINDS:
            raise ValueError(
                f"Unexpected value for `canary`: {canary!r}; valid kinds are {', '.join(KINDS + INPUT_KINDS)} "
                "or an InputCanaries object"
            )
        self.optimizer = optimizer
        self.accountant = accountant if accountant is not None else _find_accountant(optimizer)
        self.delta, self.confidence, self.estimator = float(delta), float(confidence), estimator
        self.mode, self.check_every = mode, int(check_every)
        self.canary = self.input.kind if self.input is not None else canary
        self.observe_steps = None if observe_steps is None else int(observe_steps)
        self.per_step = int(canaries_per_step)
        self.model = module
        self.on_violation = on_violation
        params = list(optimizer.params)
        self.layer_names = _layer_names(params, module, optimizer) if self.input is None else [ALL_LAYERS]
        per_layer = hasattr(optimizer, "max_grad_norms")
        clip = np.array(optimizer.max_grad_norms if per_layer else [optimizer.max_grad_norm] * len(params), dtype=float)
        self.mu_claimed = 1.0 / float(optimizer.noise_multiplier)
        self.noise_std = float(optimizer.noise_multiplier) * float(optimizer.max_grad_norm)
        self.epsilon_step_claimed = est.mu_to_epsilon(self.mu_claimed, self.delta)
        layer_mu = clip / (float(optimizer.noise_multiplier) * float(optimizer.max_grad_norm))
        self.rng = np.random.default_rng(seed)
        sizes = [p.numel() for p in params]
        if self.input is None:
            self.sampler = CanarySampler(
                sizes, kind=canary, per_step=canaries_per_step, moving=moving, support=support, rng=self.rng
            )
            pool = self.sampler.pool
            layer_mu = {i: float(m) for i, m in enumerate(layer_mu)}
        else:
            self.sampler = None
            pool = choose_pool(sizes, DEFAULT_POOL, self.rng)
            layer_mu = {0: self.mu_claimed}
        self.probe = GradientProbe(params, pool, clip, canary_scale)
        if self.input is not None:
            self.input_probe = InputProbe(
                params, module, self.input, clip, per_layer=per_layer, max_grad_norm=float(optimizer.max_grad_norm),
                loss_reduction=optimizer.loss_reduction, pool=self.probe.pool,
            )
        self.fingerprints = NoiseFingerprints(SENTINELS, alpha=REPEAT_ALPHA)
        self.sentinels = sentinel_positions(len(self.probe.pool))
        self.log = ObservationLog(list(KINDS + INPUT_KINDS), window=observation_window)
        self.monitor = AnytimeMonitor(layer_mu, self.mu_claimed, confidence=confidence, reserved=REPEAT_ALPHA)
        self.steps = 0
        self._live_epsilon = None
        self._alerted = False
        self.extra_findings: list = []  # Finding records of other checks; they lead result().findings
        self.checksum_every = int(checksum_every)
        self._pending = None
        if self.collectives is not None:
            self.collectives.verify_same(
                np.concatenate([[self.per_step, float(optimizer.noise_multiplier), float(optimizer.max_grad_norm), seed],
                                self.probe.pool.cpu().numpy(), dist.parameter_checksums(params)]),
                "the audit's settings, its seed or the model's parameters at the start",
            )
        self._attach()
        self._note_problem("unreconciled_noise", dist.unreconciled_noise_problem(optimizer))

    # ------------------------------------------------------------------ wiring

    def _attach(self) -> None:
        opt = self.optimizer
        self._had_own_add_noise = "add_noise" in vars(opt)
        self._previous_add_noise = vars(opt).get("add_noise")
        self._release = opt.add_noise
        opt.add_noise = self._audited_add_noise
        if self.collectives is not None:
            self._reduce = opt.reduce_gradients
            opt.reduce_gradients = self._audited_reduce
        opt._dpaudit_auditor = self

    def detach(self) -> None:
        """Restore the optimizer exactly as it was before the auditor attached."""
        opt = self.optimizer
        if getattr(opt, "_dpaudit_auditor", None) is not self:
            return
        if self._had_own_add_noise:
            opt.add_noise = self._previous_add_noise
        else:
            del opt.add_noise
        if self.collectives is not None:
            del opt.reduce_gradients
        del opt._dpaudit_auditor

    # ------------------------------------------------------------------ one noised step

    def _audited_add_noise(self) -> None:
        if self.observe_steps is not None and self.steps >= self.observe_steps:
            self._release()  # past the observation window: the plain step
            self.steps += 1
            return
        if self.collectives is not None:
            self._pending = self._local_release()  # observed once the ranks' gradients are reduced
            return
        if self.input is not None:
            self._input_step()
        else:
            self._gradient_step()
        self.steps += 1
        if self.steps % self.check_every == 0:
            self._check()

    def _gradient_step(self) -> None:
        canaries = self.sampler.next_step(all_in=self.mode == "paired")
        self._privatize(
            lambda which: self.probe.canary_rows(canaries, which),
            lambda data_sum, added, is_in: self._observe(data_sum, added, canaries, is_in),
            canaries.is_in,
        )

    def _input_step(self) -> None:
        """One noised step with input canaries (see input_probe for the observations)."""
        probe, spec = self.input_probe, self.input
        if spec.due(self.steps):
            spec.build(self.model, self.per_step, torch.Generator().manual_seed(int(self.rng.integers(2**62))))
        probe.prepare(probe.gradients())
        k = len(spec.x)
        is_in = np.ones(k, dtype=bool)
        if self.mode == "one-run":
            is_in[:] = False
            is_in[self.rng.permutation(k)[: k // 2]] = True
        self._privatize(lambda which: (probe.canary_rows(which), [None] * len(probe.params)), self._observe_input, is_in)
        probe.release()

    def _privatize(self, rows_of, observe, is_in) -> None:
        """Release the step with canaries and observe them; leave the un-audited update.

        rows_of(which): (rows, columns) of the selected canaries (columns None for dense
        rows); observe(data_sum, added, is_in): record a release, with `added` the
        canaries' CanarySum (None when the release carries none). one-run: the `is_in`
        canaries enter the one release and their clipped sum is removed after. paired:
        the real release carries none (all out), a second privatization of data + all
        canaries gives the in-observations.
        """
        params = self.probe.params
        data_sum = [p.summed_grad for p in params]
        if self.mode == "one-run":
            added = self._release_with(rows_of(is_in))
            observe(data_sum, added, is_in)
            added.remove_from([p.grad for p in params])
        else:
            self._release()
            released = [p.grad for p in params]  # add_noise assigns new tensors: these stay as they are
            observe(data_sum, None, np.zeros(len(is_in), bool))
            added = self._release_with(rows_of(is_in))
            observe(data_sum, added, np.ones(len(is_in), bool))
            for p, r in zip(params, released):
                p.grad = r
        _restore_data_sum(params, data_sum)

    def _release_with(self, rows_and_columns):
        """Release data + canaries through the optimizer's own clipping and noise; summed_grad is the data's again after."""
        params = self.probe.params
        added = self.probe.clip(self.optimizer, *rows_and_columns)
        added.enter(params)
        self._release()
        for p in params:  # a release that is a view of summed_grad (a rank without noise) keeps its canaries
            if p.grad.data_ptr() == p.summed_grad.data_ptr():
                p.grad = p.grad.clone()
        added.leave(params)
        return added

    # ------------------------------------------------------------------ one noised step, data-parallel

    def _local_release(self):
        """This rank's part of a distributed step: plant its share of the in-canaries, release locally.

        In-canary j enters on rank j mod W (counting in-canaries only), so each enters the
        reduced sum once and every rank's clipping is exercised. Returns what the
        observation after the reduction needs: the canaries, this rank's data sum and
        canary sum at the pool, the noise this rank added (RMS on the sentinels, in units
        of sigma*C) and the factor f the optimizer applies before and in the reduction.
        """
        probe, opt, c = self.probe, self.optimizer, self.collectives
        params = probe.params
        canaries = self.sampler.next_step()
        mine = np.zeros(len(canaries.is_in), dtype=bool)
        mine[np.flatnonzero(canaries.is_in)[c.rank :: c.size]] = True
        data_sum = [p.summed_grad for p in params]
        data_at_pool = probe.at_pool(data_sum)
        if mine.any():
            canaries_at_pool = probe.sum_at_pool(self._release_with(probe.canary_rows(canaries, mine)))
        else:
            self._release()
            canaries_at_pool = np.zeros(len(probe.pool))
        own_noise = (probe.at_pool([p.grad for p in params]) - data_at_pool - canaries_at_pool)[self._noise_coords()]
        _restore_data_sum(params, data_sum)
        factor = 1.0
        if opt.loss_reduction == "mean":
            factor = 1.0 / (float(opt.expected_batch_size) * opt.accumulated_iterations * c.size)
        return canaries, data_at_pool, canaries_at_pool, float(np.sqrt(np.mean(own_noise**2))) / self.noise_std, factor

    def _audited_reduce(self) -> None:
        self._reduce()
        pending, self._pending = self._pending, None
        if pending is None:  # a step past observe_steps
            return
        self._observe_reduced(*pending)
        self.steps += 1
        if self.steps % self.check_every == 0:
            self._check()

    def _observe_reduced(self, canaries, data_at_pool, canaries_at_pool, own_noise, factor) -> None:
        """Observe the reduced release G after one all-reduce of S and K (at the canaries' and
        sentinels' coordinates), each rank's own noise and, when due, the replicas' checksums.

        observation = <w, G / f - S> / C_l, identical on every rank; then G -= f * K.
        """
        probe, c = self.probe, self.collectives
        params = probe.params
        n = len(probe.pool)
        read = np.unique(np.concatenate([canaries.pool_index.ravel(), np.arange(n)[self._noise_coords()]]))
        m = len(read)  # only the canaries' and the sentinels' pool positions are summed
        checksums = self.checksum_every > 0 and self.steps % self.checksum_every == 0
        parts = [data_at_pool[read], canaries_at_pool[read], c.own_slot([own_noise])]
        if checksums:
            parts.append(c.own_slot(dist.parameter_checksums(params)))
        total = c.sum(np.concatenate(parts))
        data, added = np.zeros(n), np.zeros(n)
        data[read], added[read] = total[:m], total[m : 2 * m]
        noise_by_rank = total[2 * m : 2 * m + c.size]
        released = probe.at_pool([p.grad for p in params]) / factor - data
        self._check_noise(released - added)
        values = probe.project(released, canaries)
        self.log.append(step=self.steps, layer=canaries.tensor, kind=self.canary, is_in=canaries.is_in, value=values)
        self.monitor.update(canaries.tensor, canaries.is_in, values)
        probe.subtract_at_pool([p.grad for p in params], added * factor)
        step = self.steps + 1
        noisy = [r for r in range(1, c.size) if noise_by_rank[r] > 1e-3]
        if noisy:
            self._note_problem(
                "noise_placement",
                f"noise entered on rank(s) {', '.join(map(str, noisy))} (RMS "
                f"{', '.join(f'{noise_by_rank[r]:.3g}' for r in noisy)} x sigma*C; rank 0: {noise_by_rank[0]:.3g}): "
                f"{type(self.optimizer).__name__} adds the noise on rank 0 only, so this code's noise depends on the "
                "ranks' layout (on one process it would add none, or the total is not the accountant's)",
                step,
            )
        if checksums:
            drifted = dist.drifted_tensors(total[2 * m + c.size :].reshape(c.size, -1), self.layer_names)
            if drifted:
                self._note_problem(
                    "replica_drift",
                    f"the replicas' parameters differ at step {step} ({', '.join(drifted[:4])}"
                    f"{', ...' if len(drifted) > 4 else ''}): the ranks train different models, so the released model "
                    "is not the one the noise protects. Every rank must apply the same reduced gradient: use the "
                    "DistributedDPOptimizer's own step and do not change gradients or parameters on one rank only.",
                    step,
                )

    # ------------------------------------------------------------------ set-up problems

    def _note_problem(self, code: str, message: Optional[str], step: int = 0) -> None:
        """Record a set-up problem found outside the canaries (a certainty, not a statistical test).

        Alarms at once on one process; a distributed step alarms at its own check, which
        every rank reaches together.
        """
        if self._record_problem(code, message, step) and self.collectives is None:
            self._check()

    def _record_problem(self, code: str, message: Optional[str], step: int) -> bool:
        if not message or any(code == known.code for known in self.extra_findings):
            return False
        self.extra_findings.append(Finding(code, message, first_step=int(step)))
        self.monitor.flag(SETUP, int(step))
        return True

    @property
    def problems(self) -> list:
        """(code, message, step) of the set-up problems found so far."""
        return [(f.code, f.message, f.first_step) for f in self.extra_findings]

    def check_sample_rate(self, batches_per_epoch: int) -> None:
        """Flag an accountant whose sample rate ignores the world size (distributed.sample_rate_problem)."""
        rate = dist.sample_rate_of(self.optimizer)
        self._record_problem("sample_rate", dist.sample_rate_problem(rate, batches_per_epoch, dist.world_size()), self.steps)
        self._check()  # every rank calls this method, so every rank reaches the check

    def _observe_input(self, data_sum, added, is_in) -> None:
        probe = self.input_probe
        released = [p.grad for p in probe.params]
        if self.mode == "one-run" or added is None:  # the release the optimizer makes
            pool = self.probe  # the one pool reader, kept in step with a restored pool
            noise = pool.at_pool(released) - pool.at_pool(data_sum)  # R - S - K at the pool, per tensor
            if added is not None:
                noise -= pool.at_pool(added.values)
            self._check_noise(noise)
        observed, values = probe.project(released, data_sum, is_in)
        layers = np.zeros(len(values), dtype=int)
        self.log.append(step=self.steps, layer=layers, kind=self.canary, is_in=is_in[observed], value=values)
        self.monitor.update(layers, is_in[observed], values)

    def _observe(self, data_sum, added, canaries, is_in) -> None:
        released = self.probe.at_pool([p.grad for p in self.probe.params]) - self.probe.at_pool(data_sum)
        if self.mode == "one-run" or added is None:  # the release the optimizer makes
            self._check_noise(released if added is None else released - self.probe.sum_at_pool(added))
        values = self.probe.project(released, canaries)
        self.log.append(step=self.steps, layer=canaries.tensor, kind=self.canary, is_in=is_in, value=values)
        self.monitor.update(canaries.tensor, is_in, values)

    def _check_noise(self, noise_at_pool: np.ndarray) -> None:
        """Fingerprint this step's noise on the sentinels; a repeat of an earlier step is a violation.

        Steps whose sentinel noise is (nearly) zero are skipped: they repeat nothing, and
        the canaries see the missing noise directly.
        """
        if self.sentinels is None:
            return
        noise = noise_at_pool[self.sentinels]
        if np.sqrt(np.mean(noise**2)) < 1e-3 * self.noise_std:
            return
        if self.fingerprints.check(noise, self.steps + 1) is not None:
            self.monitor.flag(REPEATS, self.steps + 1)

    def _noise_coords(self):
        return self.sentinels if self.sentinels is not None else slice(None)

    def _check(self) -> None:
        """Alert once when a test fired; under DDP every rank alerts at the same check.

        The ranks' observations are identical unless the reduction is broken, so one small
        all-reduce per check tells each rank whether any rank fired; a rank that did not
        records why (its release differs from another rank's) and alerts with it.
        """
        fired = self.monitor.check(self.steps)
        if self.collectives is not None and not self._alerted:
            if self.collectives.any(bool(fired)) and not fired:
                self._record_problem(
                    "rank_disagreement",
                    "another rank's audit fired while this rank's did not: the ranks released different "
                    "gradients (the all-reduce after the noise is missing or altered), so the replicas do not "
                    "apply one noised update",
                    self.steps,
                )
                fired = self.monitor.check(self.steps)
        if fired and not self._alerted:
            self._alerted = True
            result = self.result()
            if self.on_violation is not None:
                self.on_violation(result)
            else:
                warnings.warn(violation_message(result), PrivacyViolationWarning, stacklevel=3)

    # ------------------------------------------------------------------ results

    def observations(self) -> dict:
        """The most recent observations (at most `observation_window`; every observation is
        counted in `self.log.histogram()` and the bounds): numpy arrays step, layer, kind, is_in, value."""
        return self.log.arrays()

    def result(self, *, accounting: bool = True) -> AuditResult:
        """The audit so far (see AuditResult for what each number means).

        accounting=False skips the accountant's epsilon and the end-to-end conversion
        (both nan), the costly part with a PRV accountant, for frequent live views.
        """
        counts = self.monitor.group_counts()
        groups = [POOLED, *range(len(self.layer_names))]
        mus = self._mu_lower(np.array([counts[g] for g in groups]))
        mu_step = float(mus[0])
        anytime = self.monitor.refresh_bounds()
        layers = []
        for i, name in enumerate(self.layer_names):
            tp, fn, fp, tn = counts[i]
            layers.append(
                LayerAudit(
                    name=name,
                    mu_lower_bound=float(mus[i + 1]),
                    mu_lower_bound_anytime=float(anytime.get(i, 0.0)),
                    mu_claimed=float(self.monitor.claims[i]),
                    n_in=int(tp + fn),
                    n_out=int(fp + tn),
                    violation=i in self.monitor.first_violation,
                )
            )
        tp, fn, fp, tn = counts[POOLED]
        violating = tuple(_group_name(g, self.layer_names) for g in sorted(self.monitor.first_violation))
        first = min(self.monitor.first_violation.values()) if self.monitor.first_violation else None
        eps_accountant, eps_lower = self._end_to_end(mu_step) if accounting else (math.nan, math.nan)
        findings = diagnose(
            self._evidence(anytime), violation=bool(violating), first_violation_step=first, extra=self.extra_findings
        )
        return AuditResult(
            epsilon_lower_bound=eps_lower,
            epsilon_accountant=eps_accountant,
            mu_lower_bound=mu_step,
            mu_lower_bound_anytime=float(anytime.get(POOLED, 0.0)),
            mu_claimed=self.mu_claimed,
            violation=bool(violating),
            violating_layers=violating,
            n_in=int(tp + fn),
            n_out=int(fp + tn),
            steps=self.steps,
            estimator=self.estimator,
            confidence=self.confidence,
            delta=self.delta,
            epsilon_step_lower_bound=est.mu_to_epsilon(mu_step, self.delta),
            epsilon_step_claimed=self.epsilon_step_claimed,
            first_violation_step=first,
            noise_repeats=self.fingerprints.matches,
            first_noise_repeat=self.fingerprints.first_repeat,
            mode=self.mode,
            canary=self.canary,
            layers=tuple(layers),
            findings=findings,
        )

    def _evidence(self, anytime: dict) -> Evidence:
        """The numpy state findings.diagnose reads: moments per tensor, claims, alarms, noise repeats."""
        tensors = len(self.layer_names)
        moments = np.zeros((tensors, 2, 3))
        logged = self.log.moments()[:tensors]
        moments[: len(logged)] = logged
        return Evidence(
            moments=moments,
            claims=np.array([self.monitor.claims[i] for i in range(tensors)], dtype=float),
            names=tuple(self.layer_names),
            confidence=self.confidence,
            noise_multiplier=float(self.optimizer.noise_multiplier),
            mu_claimed=self.mu_claimed,
            gradient=self.input is None,
            alarms=dict(self.monitor.first_violation),
            mu_anytime=dict(anytime),
            first_repeat=self.fingerprints.first_repeat,
            repeats=self.fingerprints.matches,
            batch_size=getattr(self.optimizer, "expected_batch_size", None),
            canary_scale=self.probe.scale,
        )

    def _mu_lower(self, counts: np.ndarray) -> np.ndarray:
        """Fixed-sample mu lower bounds from the threshold-0.5 attack's counts, one row (tp, fn, fp, tn) per group."""
        counts = np.asarray(counts, dtype=np.int64)
        if self.estimator.startswith("gdp"):
            return np.atleast_1d(est.mu_from_counts(*counts.T, method=self.estimator, confidence=self.confidence))
        mus = []
        for row in counts:
            e = est.epsilon_from_counts(*(int(c) for c in row), delta=self.delta, method=self.estimator, confidence=self.confidence)
            mus.append(float(e.mu) if e.mu is not None else est.epsilon_to_mu(e.epsilon, self.delta) if e.epsilon > 0 else 0.0)
        return np.array(mus)

    def _end_to_end(self, mu_step: float):
        """(accountant epsilon, end-to-end lower bound), cached per accountant kind (LiveEpsilon)."""
        acc = self.accountant
        if acc is None or not acc.history:
            return math.nan, math.nan
        kind = acc.mechanism()
        if self._live_epsilon is None or self._live_epsilon.accountant != kind:
            self._live_epsilon = LiveEpsilon(kind, delta=self.delta)
        live = self._live_epsilon
        return live.accountant_epsilon(acc.history), live.lower_bound_epsilon(mu_step, acc.history)

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "alerted": self._alerted,
            "sampler": self.sampler.state_dict() if self.sampler is not None else {"rng": self.rng.bit_generator.state},
            "input_canaries": _input_state(self.input),
            "pool": [p.cpu().numpy() for p in self.probe.pool_local],
            "fingerprints": self.fingerprints.state_dict(),
            "log": self.log.state_dict(),
            "monitor": self.monitor.state_dict(),
            "problems": [list(p) for p in self.problems],
        }

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self._alerted = bool(state.get("alerted", False))
        if self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])
        else:
            self.rng.bit_generator.state = state["sampler"]["rng"]
        if self.input is not None and state.get("input_canaries"):
            saved = state["input_canaries"]
            self.input.x, self.input.y = torch.as_tensor(saved["x"]), torch.as_tensor(saved["y"])
            self.input.builds = int(saved["builds"])
        if "pool" in state:
            self.probe.set_pool(state["pool"])
        if "fingerprints" in state:
            self.fingerprints.load_state_dict(state["fingerprints"])
        self.log.load_state_dict(state["log"])
        self.monitor.load_state_dict(state["monitor"])
        self.extra_findings = [Finding(str(c), str(m), first_step=int(s)) for c, m, s in state.get("problems", [])]


def auto_canaries(canary, parameters: int, support: int) -> int:
    """The default canaries per step.

    Gradient canaries: 1,024 (their rows are compressed, so they cost little, and 1,000
    steps of 1,024 reach about 0.95 of the accountant's epsilon or more), but never more
    than half the model's coordinates / support, so that moving canaries still move on
    small models. Input canaries: 32 (each costs a forward and backward pass).
    """
    if canary in INPUT_KINDS or isinstance(canary, InputCanaries):
        return 32
    width = 1 if canary == "dirac" else int(support)
    return max(2, min(DEFAULT_GRADIENT_CANARIES, parameters // (2 * width)) // 2 * 2)


def sentinel_positions(pool_size: int):
    """SENTINELS pool positions spread evenly over the pool (None when the pool is too small)."""
    if pool_size < SENTINELS:
        return None
    return np.linspace(0, pool_size - 1, SENTINELS).astype(int)


def _group_name(group: int, layer_names) -> str:
    if group == POOLED:
        return "pooled"
    if group == REPEATS:
        return "noise repeats"
    if group == SETUP:
        return "distributed set-up"
    return layer_names[group]


def _restore_data_sum(params, data_sum) -> None:
    """summed_grad as the un-audited step leaves it: the data's own clipped sum, marked as noised."""
    for p, s in zip(params, data_sum):
        p.summed_grad = s
        s._processed = True


def _check_distributed_options(canary, mode) -> None:
    if mode != "one-run":
        raise ValueError("a distributed audit runs in mode='one-run' (a second privatization would need a second reduction)")
    if isinstance(canary, InputCanaries) or canary in INPUT_KINDS:
        raise ValueError(
            f"input canaries ({getattr(canary, 'kind', canary)!r}) are not supported under a DistributedDPOptimizer; "
            "use gradient canaries ('dirac', 'constant' or 'random')"
        )


def _layer_names(params, module, optimizer=None) -> list:
    """The names of the parameter tensors as the model calls them, without Opacus's `_module.` prefix.

    With `module` they are read from it at once. Without it they come from the Opacus
    GradSampleModule that computes the parameters' per-sample gradients. Neither the
    DPOptimizer nor its parameters lead to that module (Opacus 1.6: the optimizer holds
    the original optimizer, the noise generator and the accountant's step hook; a
    parameter carries only grad_sample, _forward_counter and summed_grad), but its hooks
    sit on the submodules that own the parameters, so the model's next forward pass
    shows it: _NameWatch fills the list in place then. Until then, and for a tensor no
    module names, the name is ``param{i}{shape}``.
    """
    names = [f"param{i}{tuple(p.shape)}" for i, p in enumerate(params)]
    if module is not None:
        _name_from(names, params, module)
    elif optimizer is not None and params:
        _NameWatch(names, params, optimizer)
    return names


def _name_from(names: list, params, module) -> bool:
    """Fill `names` in place from module.named_parameters(); True when every tensor has a name."""
    found = {id(p): n.removeprefix("_module.") for n, p in module.named_parameters()}
    for i, p in enumerate(params):
        if id(p) in found:
            names[i] = found[id(p)]
    return all(id(p) in found for p in params)


class _NameWatch:
    """Waits for the first forward pass through the audited parameters and names them.

    A global forward pre-hook (torch.nn.modules.module.register_module_forward_pre_hook)
    sees every module called. A GradSampleModule, or a submodule owning one of the
    parameters whose forward hooks belong to a GradSampleModule (Opacus hooks modules in
    place, as under Lightning), gives the names. The hook removes itself when the names
    are found, when a module owning the parameters carries no Opacus hooks (nothing to
    find), or when the auditor has been detached.
    """

    def __init__(self, names: list, params, optimizer):
        from torch.nn.modules.module import register_module_forward_pre_hook

        self.names, self.params = names, list(params)
        self.ids = {id(p) for p in self.params}
        self.optimizer = weakref.ref(optimizer)
        self.handle = register_module_forward_pre_hook(self)

    def __call__(self, module, args):
        from opacus.grad_sample.gsm_base import AbstractGradSampleModule

        optimizer = self.optimizer()
        auditor = getattr(optimizer, "_dpaudit_auditor", None)
        if auditor is None or auditor.layer_names is not self.names:
            self.handle.remove()  # detached, or the auditor never finished attaching
            return
        if isinstance(module, AbstractGradSampleModule):
            owner = module
        elif any(p is not None and id(p) in self.ids for p in module._parameters.values()):
            owner = next((o for o in map(_hook_owner, module._forward_hooks.values()) if o is not None), None)
            if owner is None:
                self.handle.remove()  # these parameters are trained without Opacus hooks to follow
                return
        else:
            return
        if _name_from(self.names, self.params, owner):
            self.handle.remove()


def _hook_owner(hook):
    from opacus.grad_sample.gsm_base import AbstractGradSampleModule

    owner = getattr(getattr(hook, "func", hook), "__self__", None)
    return owner if isinstance(owner, AbstractGradSampleModule) else None


def _input_state(spec: Optional[InputCanaries]):
    if spec is None or spec.x is None:
        return None
    return {"x": spec.x.detach().cpu().numpy(), "y": spec.y.detach().cpu().numpy(), "builds": spec.builds}
