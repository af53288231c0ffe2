"""How a PrivacyAuditor's parts are made, in build order: each from those made before it, none reaching for a later one.

    validated   the optimizer (unwrapped), its release path's class, the options, the checks: refused by name
    release     the release path for the optimizer's family (release/), reporting through the finding sink
    steps       the step pipeline, connected to the finding sink; the claim read each step (claims/)
    run_checks  the run's read-only view and the runner of the checks (checks/)
    claim_of    what the run claims, for its results

The record, the finding sink and the canary kind come before the release path; the noised step and Opacus's step
watcher after the runner (auditor.py).
"""

from __future__ import annotations

import numpy as np

from ..analysis.assemble import Claim
from .release import distributed as dist
from .checks.exact.accumulation import AccumulationLedger
from .claims.adaptive import step_claims
from .checks import CheckRunner, RunView
from .checks.base import MECHANISM
from .checks.defaults import default_checks
from .checks.runner import check_checks
from .claims.claim_range import check_claim
from .claims.step_claim import NO_NOISE
from .release.ghost import check_ghost_options, is_ghost
from .canaries.input_probe import check_input_model
from .step.noised_step import canary_clipping
from .options import BATCHED_CHECK_EVERY, check_accountant, check_module, check_opacus_version, unwrapped_optimizer, validate
from .release import PathSettings, release_path_for
from .checks.exact.per_sample import PerSampleCheck
from .step.pipeline import StepPipeline
from .checks.run import check_run_options
from .checks.run.multiplicity import clipped_rows


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


def steps(optimizer, kind, path, record, findings, mechanism, accountant, options, *, alarm, on_claim_change):
    """The step pipeline: plant -> release -> read -> record -> check, each step's claim read first."""
    check_every = options.check_every
    if check_every == "auto":
        check_every = BATCHED_CHECK_EVERY if path.reads_on_device and kind.reads_on_device else 1
    claims = step_claims(optimizer, mechanism, accountant, module=kind.module_ref, on_change=on_claim_change)
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
