"""How a PrivacyAuditor's parts are made, in build order: each from those made before it, none reaching for a later one.

    build       every part, in order: the optimizer validated; the claim; the canary kind; the record and its finding
                sink; the release path; the step pipeline; the results; the checks and their runner; the noised step
                and Opacus's step watched (AuditParts)
    validated   the optimizer (unwrapped), its release path's class, the options, the checks: refused by name
    release     the release path for the optimizer's family (release/), reporting through the finding sink
    steps       the step pipeline, connected to the finding sink; the claim read each step (claims/)
    run_checks  the run's read-only view and the runner of the checks (checks/)
    claim_of    what the run claims, for its results
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from ..analysis.assemble import Claim, ResultAssembler
from ..analysis.record import AuditRecord
from .canaries import ALL_KIND_NAMES, canary_kind_for
from .canaries.input_probe import check_input_model
from .checks import CheckRunner, RunView
from .checks.base import MECHANISM
from .checks.defaults import default_checks
from .checks.exact.accumulation import AccumulationLedger
from .checks.exact.per_sample import PerSampleCheck
from .checks.run import check_run_options
from .checks.run.multiplicity import clipped_rows
from .checks.runner import check_checks
from .claims.adaptive import mechanism_of, step_claims
from .claims.claim_range import check_claim
from .claims.step_claim import NO_NOISE, audited_claim
from .findings_sink import FindingSink
from .options import (
    BATCHED_CHECK_EVERY,
    check_accountant,
    check_module,
    check_opacus_version,
    find_accountant,
    unwrapped_optimizer,
    validate,
)
from .release import PathSettings, distributed as dist, release_path_for
from .release.ghost import check_ghost_options, is_ghost
from .state import setup_of
from .step.noised_step import NoisedStep, canary_clipping
from .step.opacus_step import OpacusStep
from .step.pipeline import StepPipeline


class AuditParts(NamedTuple):
    """What a PrivacyAuditor is made of (auditor.py names each)."""

    optimizer: object
    options: object
    accountant: object
    setup: dict
    kind: object
    record: AuditRecord
    results: ResultAssembler
    path: object
    pipeline: StepPipeline
    checks: CheckRunner
    exact: object
    opacus_step: OpacusStep


def build(optimizer, settings: dict, *, accountant, checks, data_loader, training_loss, other_optimizers,
          alarm: Callable[[], None]) -> AuditParts:
    """Every part of an audit of `optimizer`, attached; `alarm()`: the auditor's alarm, given once."""
    optimizer, path_class, options, checks = validated(
        optimizer, accountant=accountant, checks=checks, data_loader=data_loader, training_loss=training_loss,
        other_optimizers=other_optimizers, settings=settings)
    seed, module = path_class.agree_on_seed(options.seed), settings["module"]
    accountant = accountant if accountant is not None else find_accountant(optimizer)
    mechanism = mechanism_of(optimizer)  # adaptive clipping: the gradient's noise multiplier (claims/adaptive.py)
    claim = audited_claim(mechanism)  # noise multiplier 0: no claim, the canaries wait under a stand-in one
    kind = canary_kind_for(optimizer, claim, options, module, np.random.default_rng(seed))
    record = AuditRecord(kind.layer_claims, 1.0 / claim.noise_multiplier, confidence=options.confidence,
                         kinds=ALL_KIND_NAMES, window=options.observation_window)
    findings, exact = FindingSink(record), exact_check_of(checks)
    path = release(path_class, optimizer, kind, claim, options, findings, seed, exact)
    pipeline = steps(optimizer, kind, path, record, findings, mechanism, accountant, options, alarm=alarm)
    results = ResultAssembler(claim_of(optimizer, mechanism, options),
                              noise_now=lambda: pipeline.claims.mechanism.noise_multiplier)
    runner = run_checks(checks, optimizer, mechanism, module, kind, path, pipeline, accountant, options, seed,
                        other_optimizers=other_optimizers, training_loss=training_loss, exact_options={
                            name: settings[f"per_sample_check_{name}"] for name in ("every", "examples", "budget")})
    path.verify_start(options.canaries_per_step, seed)
    noised_step = NoisedStep(optimizer, pipeline, exact, runner, path)
    path.attach(noised_step)
    opacus_step = OpacusStep(optimizer, steps=lambda: pipeline.steps, report=noised_step.opacus_error,
                             raised_by_audit=lambda error: error is pipeline.raised)
    return AuditParts(optimizer, options, accountant, setup_of(mechanism, options), kind, record, results, path,
                      pipeline, runner, exact, opacus_step)


def validated(optimizer, *, accountant, checks, data_loader, training_loss, other_optimizers, settings: dict):
    """(optimizer, path class, AuditOptions, checks) for an audit of `optimizer`, or the first error, by name."""
    import opacus

    optimizer = unwrapped_optimizer(optimizer)  # Lightning's LightningOptimizer (manual optimization): its optimizer
    check_opacus_version(opacus.__version__)
    path_class = release_path_for(optimizer)
    if getattr(optimizer, "_dpaudit_auditor", None) is not None:
        raise RuntimeError("a PrivacyAuditor is already attached to this optimizer; call its detach() first")
    check_claim(optimizer)
    check_accountant(accountant)
    options = validate(optimizer, **settings)
    check_run_options(data_loader=data_loader, training_loss=training_loss, other_optimizers=other_optimizers)
    checks = default_checks() if checks is None else check_checks(checks)
    path_class.check_options(options)
    check_ghost_options(optimizer, options)
    if options.input:
        check_input_model(settings["module"], list(optimizer.params), options.canary)
    check_module(settings["module"], optimizer.params)
    return optimizer, path_class, options, checks


def exact_check_of(checks):
    """The exact check among `checks` (it schedules the replays and decides how canaries are clipped), or None."""
    return next((c for c in checks if isinstance(c, PerSampleCheck)), None)


def release(path_class, optimizer, kind, mechanism, options, findings, seed, exact):
    """The release path: the canaries through the optimizer's own clipping and noise (release/)."""
    return path_class(optimizer, kind.probe, PathSettings(
        note_problem=findings.report, sentinels=kind.sentinels,
        noise_std=mechanism.noise_multiplier * mechanism.max_grad_norm, layer_names=kind.layer_names,
        noise_seed=None if seed is None else int(np.random.default_rng([seed, 28]).integers(2**62)),
        canary_clipping=lambda step: canary_clipping(exact, step),
    ))


def steps(optimizer, kind, path, record, findings, mechanism, accountant, options, *, alarm):
    """The step pipeline: plant -> release -> read -> record -> check, each step's claim read first."""
    check_every = options.check_every
    if check_every == "auto":
        check_every = BATCHED_CHECK_EVERY if path.reads_on_device and kind.reads_on_device else 1
    claims = step_claims(optimizer, mechanism, accountant, module=kind.module_ref)
    pipeline = StepPipeline(kind, path, record, paired=options.mode == "paired", check_every=check_every,
                            observe_steps=options.observe_steps, alarm=alarm, claims=claims, findings=findings)
    record.declare({NO_NOISE: MECHANISM})  # a noise multiplier of 0, found by the claims (claims/step_claim.py)
    return pipeline


def run_checks(checks, optimizer, mechanism, module, kind, path, pipeline, accountant, options, seed, *,
               other_optimizers, training_loss, exact_options: dict) -> CheckRunner:
    """The run's read-only view and the runner of `checks` over it; each check's codes declared to the record."""
    ghost = is_ghost(optimizer)
    view = RunView(
        optimizer, list(mechanism.params), module, kind.module_ref, accountant, pipeline.note_problem,
        steps=lambda: pipeline.steps, other_optimizers=list(other_optimizers), names=kind.layer_names, seed=seed,
        delta=options.delta, ghost=ghost, sharded=dist.is_sharded(optimizer), passes_on=pipeline.passes_on,
        ledger=lambda: AccumulationLedger(optimizer, kind.probe, ghost=ghost, per_layer=mechanism.per_layer, path=path),
        training_loss=training_loss, exact=exact_options, claims=pipeline.claims, checksum_every=options.checksum_every,
        ghost_clipping=kind.probe.ghost,
    )
    pipeline.record.declare({code: check.scope for check in checks for code in check.codes})
    return CheckRunner(checks, view, passes_on=pipeline.passes_on, rows=clipped_rows,
                       accumulate_method="accumulate" if ghost else "clip_and_accumulate")


def claim_of(optimizer, mechanism, options) -> Claim:
    """What the run claims, as results state it (analysis/assemble.py)."""
    return Claim(
        noise_multiplier=mechanism.noise_multiplier, delta=options.delta, confidence=options.confidence,
        estimator=options.estimator, mode=options.mode, canary=options.kind, gradient=not options.input,
        canary_scale=options.canary_scale, batch_size=getattr(optimizer, "expected_batch_size", None),
    )
