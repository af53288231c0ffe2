"""The probe's cases (bench/robustness/probe.py runs them), one module per area of the public surface.

    options       every option of PrivacyAuditor; the run's options (data_loader, other_optimizers, training_loss)
    inputs        input canaries
    attach        what the auditor is attached to
    schedules     noise and clipping changed mid-run
    faults        faults inside the audit's step
    state         the auditor's saved state
    callback      the Lightning callback and its checkpoints
    reports       `dpaudit report` and the CLI
    estimators    the estimators
    final_model   final-model canaries
    common        what they share
"""

from __future__ import annotations

from .attach import attach_cases
from .callback import callback_cases
from .estimators import estimator_cases
from .faults import fault_cases
from .final_model import final_model_cases
from .inputs import input_cases
from .options import auditor_option_cases, run_option_cases
from .reports import cli_cases, report_cases
from .schedules import schedule_cases
from .state import state_cases


def all_cases():
    cases = []
    for make in (auditor_option_cases, input_cases, attach_cases, schedule_cases, fault_cases, state_cases,
                 callback_cases, report_cases, cli_cases, estimator_cases, final_model_cases, run_option_cases):
        cases.extend(make())
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    return cases
