"""Audit DP-SGD training while it runs: a Lightning callback, or an auditor on a plain PyTorch optimizer.

Lightning: add the callback to the Trainer of a LightningModule made private with Opacus,
    callback = DPAuditCallback(); trainer = pl.Trainer(callbacks=[callback]); trainer.fit(module)
and after fit `callback.auditor.result()` is the AuditResult (it prints as the summary).

Plain PyTorch: attach the auditor to the optimizer Opacus's make_private returned, then train as before,
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader)
    print(auditor.result())   # the verdict, both epsilons, the findings

Layers, each importing only from the ones above it:

    estimators    bounds on epsilon and mu from counts (numpy, scipy)
    analysis      a run's statistics: monitor, observations, noise fingerprints, findings, results, report
    engine        the audit of an Opacus optimizer: step pipeline, canary kinds, release paths (torch, Opacus)
    integrations  Lightning callback, test-suite helper, bug zoo, bundled digits
    app           the `dpaudit` command and its demo

The public API is the names in `__all__`, all imported from here
(`from lightning_dpaudit import PrivacyAuditor`), and three modules: `lightning_dpaudit.datasets`
(the bundled digits), `lightning_dpaudit.testing` (test suites and the bug zoo) and
`lightning_dpaudit.estimators` (the bounds alone). Neither `import lightning_dpaudit` nor
`lightning_dpaudit.estimators` imports torch; the torch- and Lightning-based names are
loaded on first use. The names that moved from here to those modules still resolve, with a
DeprecationWarning; version 0.1.0's flat import paths (`lightning_dpaudit.bugs`,
`lightning_dpaudit.digits`, ...) still resolve too (see _compat).
"""

from importlib import import_module
from typing import TYPE_CHECKING

from . import _compat

__version__ = "0.2.0"

_compat.install()

_LAZY = {
    # the audit of every step: plain PyTorch and Lightning
    "PrivacyAuditor": "engine.auditor",
    "DPAuditCallback": "integrations.callback",
    "InputCanaries": "engine.canaries.input_canaries",  # canary= for input canaries, in full
    # checks: the defaults, and the interface of your own
    "Check": "engine.checks.base",
    "default_checks": "engine.checks.defaults",
    # results
    "AuditResult": "analysis.results",
    "LayerAudit": "analysis.results",
    "Finding": "analysis.results",
    # alerts and errors
    "PrivacyViolationWarning": "engine.auditor",
    "PrivacyViolationError": "integrations.callback",
    "AuditFailedWarning": "engine.step.pipeline",
    "CheckStoppedWarning": "engine.checks.runner",
    "AuditStateError": "engine.state",
    # the final-model audit
    "FinalModelCanaries": "engine.final_model",
    "CanaryDataModule": "integrations.final_model_data",
    "FinalModelResult": "analysis.final_model",
}

# names that moved from the package's root to a module of their own: still found here, with a DeprecationWarning
MOVED = {
    **dict.fromkeys(("DigitsCNN", "digits_dataset", "digits_holdout", "make_private_digits", "train_steps"), "datasets"),
    **dict.fromkeys(("inject_bug", "list_bugs", "historical_bug", "audit_optimizer", "train_audited",
                     "PrivacyAuditFailure"), "testing"),
    **dict.fromkeys(("EpsilonEstimate", "end_to_end_epsilon", "epsilon_lower_bound", "mu_to_epsilon"), "estimators"),
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from .analysis.final_model import FinalModelResult
    from .analysis.results import AuditResult, Finding, LayerAudit
    from .engine.auditor import PrivacyAuditor, PrivacyViolationWarning
    from .engine.checks.base import Check
    from .engine.checks.defaults import default_checks
    from .engine.checks.runner import CheckStoppedWarning
    from .engine.final_model import FinalModelCanaries
    from .engine.canaries.input_canaries import InputCanaries
    from .engine.step.pipeline import AuditFailedWarning
    from .engine.state import AuditStateError
    from .integrations.callback import DPAuditCallback, PrivacyViolationError
    from .integrations.final_model_data import CanaryDataModule


def __getattr__(name):
    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    if name in MOVED:
        import warnings

        where = f"lightning_dpaudit.{MOVED[name]}"
        warnings.warn(f"`lightning_dpaudit.{name}` moved to `{where}.{name}`: import it from there (the old path "
                      "will be removed)", DeprecationWarning, stacklevel=2)
        return getattr(import_module(where), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
