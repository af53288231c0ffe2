"""PrivacyAuditor: the white-box canary audit of an Opacus DPOptimizer, attached in place.

Per noised step (Tight Auditing, Algorithm 2, with the privatized sum read directly):

    S  = summed_grad after the optimizer clipped the real batch (its own code)
    K  = what the optimizer's own clipping makes of the in-canaries' rows
    R  = released gradient after the optimizer's own add_noise = S + K + noise
    observation_i = <w_i, R - S> / C_l                                      (one per canary)
    the update keeps R - K = S + noise, exactly what it would be without the auditor.

Centering on S removes the data's own gradient, so for a correct optimizer an
out-observation is N(0, s^2) and an in-observation N(1, s^2) with s the noise
multiplier in the canary's units: the step is (1/s)-GDP for each canary.

This class is the wiring: options (options.py), the canary kind (kinds/), the release
path for the optimizer's family (paths/), the step pipeline (pipeline.py), what is
recorded (analysis/record.py), results (analysis/assemble.py) and saved state (state.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import numpy as np
import torch

from ..analysis.assemble import Claim, ResultAssembler
from ..analysis.record import AuditRecord
from ..analysis.results import AuditResult, violation_message
from . import distributed as dist
from .accumulation_check import AccumulationLedger
from .adaptive import mechanism_of, step_claims
from .claim_range import check_claim
from .claims import normalisation_problem
from .divergence import diverged_step
from .ghost import check_ghost_options, is_ghost
from .kinds import ALL_KIND_NAMES, canary_kind_for
from .kinds.input_probe import check_input_model
from .noised_step import NoisedStep, canary_clipping
from .opacus_step import OpacusStep
from .options import (
    BATCHED_CHECK_EVERY, check_accountant, check_module, check_opacus_version, find_accountant, validate,
)
from .paths import PathSettings, release_path_for
from .per_sample_check import DEFAULT_BUDGET, DEFAULT_EVERY, DEFAULT_EXAMPLES, PerSampleCheck
from .pipeline import StepPipeline
from .run_checks import RunChecks, check_run_options
from .state import AuditStateError, check_state, composed_steps, dump_state, setup_of
from .user_warning import warn_at_user_code


class PrivacyViolationWarning(UserWarning):
    """The audited optimizer leaks more than its noise multiplier claims."""


class PrivacyAuditor:
    """Plants canaries in every noised step of `optimizer` and bounds epsilon.

    canary: a gradient canary kind ("dirac", "constant", "random"), an input canary kind
    ("mislabeled", "blank", "adversarial", "crafted") or an InputCanaries object.
    canaries_per_step: canaries per noised step (one-run: half in, half out; paired: all
    in the second release, all out in the first); "auto" (default): 1,024 gradient
    canaries (fewer on models under 2,048 coordinates), 32 input canaries.
    canary_scale: canary norm as a multiple of the clipping bound (> 1 audits clipping).
    moving: fresh coordinates each step. support: coordinates per canary for "constant"
    and "random".
    check_every: steps between checks. A violation is recorded at the step it happens and
    raised at the next check (at most check_every - 1 steps later). "auto" (default): 8
    where the readings stay on the device between checks (gradient canaries on one
    process), 1 where a step reads on the host anyway (input canaries, several processes).
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
    per_sample_check_every: the steps between exact checks of a few real examples'
    per-sample gradients (ghost clipping: norms and clipping coefficients) against plain
    autograd, first at step 1 (per_sample_check.py; 0 turns them off);
    per_sample_check_examples: the examples compared at each;
    per_sample_check_budget: the largest share of the run's wall time the exact checks may
    take after step 1's: a due step is skipped when checking it would pass that share, at the
    last check's cost (step 1 never is; 1.0: none is).
    checksum_every: under a DistributedDPOptimizer, the steps between checks that every
    replica holds the same parameters (see distributed.py; 0 turns them off).
    The run beyond the optimizer (run_checks/): data_loader, the loader the loop iterates (`watch_loader`
    for one made later); training_loss(batch), the step's loss, replayed by the independence check;
    other_optimizers, the run's other optimizers (what they hold trains outside DP-SGD).
    """

    def __init__(
        self, optimizer, *, accountant=None, delta: float = 1e-5, confidence: float = 0.95, canary="dirac",
        canaries_per_step="auto", mode: str = "one-run", estimator: str = "gdp-cp", seed: Optional[int] = None,
        canary_scale: float = 2.0, moving: bool = True, support: int = 16, check_every="auto",
        module: Optional[torch.nn.Module] = None, on_violation: Optional[Callable[[AuditResult], None]] = None,
        canary_inputs: Optional[torch.Tensor] = None, canary_labels: Optional[torch.Tensor] = None,
        loss_fn: Optional[Callable] = None, recraft_every="auto", observe_steps: Optional[int] = None,
        observation_window: int = 65_536, checksum_every: int = 100, per_sample_check_every: int = DEFAULT_EVERY,
        per_sample_check_examples: int = DEFAULT_EXAMPLES, per_sample_check_budget: float = DEFAULT_BUDGET,
        data_loader=None, training_loss: Optional[Callable] = None, other_optimizers=(),
    ):
        import opacus

        from .options import unwrapped_optimizer

        optimizer = unwrapped_optimizer(optimizer)  # Lightning's LightningOptimizer (manual optimization): its optimizer
        check_opacus_version(opacus.__version__)
        path_class = release_path_for(optimizer)
        if getattr(optimizer, "_dpaudit_auditor", None) is not None:
            raise RuntimeError("a PrivacyAuditor is already attached to this optimizer; call its detach() first")
        check_claim(optimizer)
        check_accountant(accountant)
        options = validate(
            optimizer, delta=delta, confidence=confidence, canary=canary, canaries_per_step=canaries_per_step, mode=mode,
            estimator=estimator, seed=seed, canary_scale=canary_scale, moving=moving, support=support,
            check_every=check_every, module=module, on_violation=on_violation, canary_inputs=canary_inputs,
            canary_labels=canary_labels, loss_fn=loss_fn, recraft_every=recraft_every, observe_steps=observe_steps,
            observation_window=observation_window, checksum_every=checksum_every,
            per_sample_check_every=per_sample_check_every, per_sample_check_examples=per_sample_check_examples,
            per_sample_check_budget=per_sample_check_budget,
        )
        check_run_options(data_loader=data_loader, training_loss=training_loss, other_optimizers=other_optimizers)
        path_class.check_options(options)
        check_ghost_options(optimizer, options)
        if options.input:
            check_input_model(module, list(optimizer.params), options.canary)
        check_module(module, optimizer.params)
        seed = path_class.agree_on_seed(options.seed)
        self.optimizer, self.options, self.model = optimizer, options, module
        self.accountant = accountant if accountant is not None else find_accountant(optimizer)
        self.on_violation = options.on_violation
        mechanism = mechanism_of(optimizer)  # adaptive clipping: the gradient's noise multiplier (adaptive.py)
        sigma, C = mechanism.noise_multiplier, mechanism.max_grad_norm
        self.setup = setup_of(mechanism, options)
        self.rng = np.random.default_rng(seed)
        self.kind = canary_kind_for(optimizer, mechanism, options, module, self.rng)
        self.record = AuditRecord(
            self.kind.layer_claims, 1.0 / sigma, confidence=options.confidence, kinds=ALL_KIND_NAMES,
            window=options.observation_window,
        )
        self.results = ResultAssembler(Claim(
            noise_multiplier=sigma, delta=options.delta, confidence=options.confidence, estimator=options.estimator,
            mode=options.mode, canary=options.kind, gradient=not options.input, canary_scale=options.canary_scale,
            batch_size=getattr(optimizer, "expected_batch_size", None),
        ))
        self.path = path_class(optimizer, self.probe, PathSettings(
            note_problem=lambda *a: self.pipeline.note_problem(*a), sentinels=self.kind.sentinels, noise_std=sigma * C,
            layer_names=self.layer_names, checksum_every=options.checksum_every,
            noise_seed=None if seed is None else int(np.random.default_rng([seed, 28]).integers(2**62)),
            canary_clipping=lambda step: canary_clipping(self.per_sample_check, step),
        ))
        check_every = options.check_every
        if check_every == "auto":
            check_every = BATCHED_CHECK_EVERY if self.path.reads_on_device and self.kind.reads_on_device else 1
        self.pipeline = StepPipeline(
            self.kind, self.path, self.record, paired=options.mode == "paired", check_every=check_every,
            observe_steps=options.observe_steps, alarm=self._alarm,
            claims=step_claims(optimizer, mechanism, self.accountant, module=self.kind.module_ref,
                               on_change=self._claim_changed, note_problem=lambda *a: self.pipeline.note_problem(*a)),
        )
        if self.probe.ghost is not None:  # ghost clipping's own coefficient check (ghost.py)
            self.probe.ghost.note_problem = lambda *a: self.pipeline.note_problem(*a[:2], self.pipeline.steps + 1, a[2])
        self.run_checks = RunChecks.of(self, mechanism.params, module, other_optimizers, training_loss, seed)
        self.per_sample_check = PerSampleCheck(
            optimizer, mechanism.params, self.layer_names, self.kind.module_ref, lambda: self.pipeline.steps,
            every=per_sample_check_every, examples=per_sample_check_examples,
            budget=per_sample_check_budget, seed=seed,
            ghost=is_ghost(optimizer), note_problem=lambda *a: self.pipeline.note_problem(*a),
            ledger=AccumulationLedger(optimizer, self.probe, ghost=is_ghost(optimizer), per_layer=mechanism.per_layer,
                                      path=self.path),
            sharded=dist.is_sharded(optimizer),
            on_accumulate=self.run_checks.accumulated, further=(self.run_checks.coupling,),
            passes_on=lambda error: error is self.pipeline._passed,
        )
        self.path.verify_start(options.canaries_per_step, seed)
        self.noised_step = NoisedStep(optimizer, self.pipeline, self.per_sample_check, self.run_checks, self.path)
        self.path.attach(self.noised_step)
        self.opacus_step = OpacusStep(optimizer, steps=lambda: self.pipeline.steps, report=self.noised_step.opacus_error,
                                      raised_by_audit=lambda error: error is self.pipeline.raised)
        optimizer._dpaudit_auditor = self
        # what the claim does not cover, stated beside the result (not a leak beyond the claim's own terms)
        self.notes = [("normalisation", n) for n in [normalisation_problem(optimizer)] if n]
        self.run_checks.attach(data_loader)
        self.pipeline.note_problem("unreconciled_noise", dist.unreconciled_noise_problem(optimizer), 0)

    def detach(self) -> None:
        """Restore the optimizer exactly as it was before the auditor attached."""
        if getattr(self.optimizer, "_dpaudit_auditor", None) is not self:
            return
        self.path.detach()
        self.opacus_step.restore()
        self.per_sample_check.close()
        self.run_checks.close()
        del self.optimizer._dpaudit_auditor

    # ------------------------------------------------------------------ what the audit holds

    @property
    def steps(self) -> int:
        return self.pipeline.steps

    @property
    def probe(self):
        """The pool reader the kind and the path share (probe.GradientProbe)."""
        return self.kind.probe

    @property
    def sampler(self):
        return getattr(self.kind, "sampler", None)

    @property
    def input_probe(self):
        return getattr(self.kind, "input_probe", None)

    @property
    def per_step(self) -> int:
        return self.options.canaries_per_step

    @property
    def layer_names(self) -> list:
        return self.kind.layer_names

    @property
    def mu_claimed(self) -> float:
        return self.results.claim.mu_claimed

    @property
    def input(self):
        return self.options.canary if self.options.input else None

    @property
    def log(self):
        """The observation log, with every step read so far."""
        self.pipeline.record_pending()
        return self.record.log

    @property
    def monitor(self):
        self.pipeline.record_pending()
        return self.record.monitor

    @property
    def fingerprints(self):
        self.pipeline.record_pending()
        return self.record.fingerprints

    @property
    def problems(self) -> list:
        """(code, message, step) of the set-up problems found so far."""
        return [(f.code, f.message, f.first_step) for f in self.record.problems]

    def watch_loader(self, loader) -> None:
        """Check the loader the loop iterates (under BatchMemoryManager, the one it yields) and each batch it delivers."""
        self.run_checks.watch(loader)

    def check_sample_rate(self, batches_per_epoch: int) -> None:
        """Flag an accountant whose sample rate ignores the world size (distributed.sample_rate_problem)."""
        rate = dist.sample_rate_of(self.optimizer)
        self.record.note_problem("sample_rate", dist.sample_rate_problem(rate, batches_per_epoch, dist.world_size()), self.steps)
        self.pipeline.check()  # every rank calls this method, so every rank reaches the check

    def _claim_changed(self, mechanism) -> None:
        """The optimizer's noise multiplier or clipping bounds changed: the next steps claim the new values."""
        self.kind.set_claim(mechanism)
        if hasattr(self.path, "noise_std"):
            self.path.noise_std = mechanism.noise_multiplier * mechanism.max_grad_norm
        self.pipeline.segment = self.record.open_claim(self.kind.layer_claims, 1.0 / mechanism.noise_multiplier)
        self.results.claim = replace(self.results.claim, noise_multiplier=mechanism.noise_multiplier)

    def _alarm(self) -> None:
        result = self.result()
        with self.pipeline.delivering():  # given from here; what on_violation raises is passed on
            if self.on_violation is not None:
                self.on_violation(result)
            else:
                warn_at_user_code(violation_message(result), PrivacyViolationWarning)

    # ------------------------------------------------------------------ results

    def observations(self) -> dict:
        """The most recent observations (at most `observation_window`; every observation is
        counted in `self.log.histogram()` and the bounds): numpy arrays step, layer, kind, is_in, value."""
        return self.log.arrays()

    def result(self, *, accounting: bool = True) -> AuditResult:
        """The audit so far (see AuditResult for what each number means).

        accounting=False skips the accountant's epsilon and the end-to-end conversion
        (both nan), the costly part with a PRV accountant, for frequent live views. A violation
        recorded and not yet alarmed is alarmed first (under several processes, at the next
        check, which every rank reaches).
        """
        if self.path.local:
            self.pipeline.check()
        else:
            self.pipeline.record_pending()
        result = self.results.result(self.record, self.layer_names, self.steps, self.accountant, accounting=accounting)
        diverged = self.pipeline.diverged
        stopped = "" if diverged is None else f"; stopped: training diverged at step {diverged}"
        return replace(result, audit_failed=self.record.failed,
                       data_path=self.per_sample_check.status(self.steps) + stopped,
                       pipeline=self.run_checks.status() + stopped, epsilon_sampling=self.run_checks.epsilon(),
                       notes=tuple(f"{code}: {message}" for code, message in self.notes + self.run_checks.notes())
                       + result.notes)

    def _evidence(self, anytime: dict):
        return self.results.evidence(self.record, self.layer_names, anytime)

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict:
        """Plain values and numpy arrays: the set-up, the step count, the kind's and the record's state."""
        self.pipeline.record_pending()
        return dump_state(self.setup, self.steps, self.kind.state_dict(), self.record.state_dict())

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state`; AuditStateError (a ValueError), with the auditor unchanged, if it
        was taken on another set-up or is damaged."""
        check_state(state, self.setup, claims=self.record.monitor.opening,
                    composed=composed_steps(getattr(self.accountant, "history", None)))
        saved = self.state_dict()
        try:
            self._load(state)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
            self._load(saved)
            raise AuditStateError(f"the audit state is damaged ({error}); start a new audit") from None

    def _load(self, state: dict) -> None:
        try:
            self.kind.load_state_dict(state)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
            raise ValueError(f"`sampler` or `pool`: {type(error).__name__}: {error}") from error
        self.record.load_state_dict(state)
        self.pipeline.steps = int(state["steps"])
        self.pipeline.diverged = diverged_step(self.record.problems)  # a run that diverged stays unobserved
        self._claim_changed(self.pipeline.claims.mechanism)  # the steps from here claim what the optimizer holds now

    # ------------------------------------------------------------------ summary

    def summary(self) -> str:
        """The audit so far as the summary table `dpaudit report` prints (`str(self.result())`):
        "OK: ..." or "VIOLATION: ...", findings, both epsilons, the mu rows, one row per tensor."""
        return str(self.result())
