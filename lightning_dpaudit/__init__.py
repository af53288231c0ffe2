"""lightning_dpaudit: audit differentially private training while it runs.

Layers, each importing only from the ones above it:

    estimators    bounds on epsilon and mu from counts (numpy, scipy)
    analysis      a run's statistics: monitor, observations, noise fingerprints, findings, results, report
    engine        the audit of an Opacus optimizer: step pipeline, canary kinds, release paths (torch, Opacus)
    integrations  Lightning callback, test-suite helper, bug zoo, bundled digits
    app           the `dpaudit` command and its demo

`lightning_dpaudit.estimators` is importable without torch; the torch-based parts are
loaded on first use. Version 0.1.0's flat import paths (`lightning_dpaudit.testing`,
`lightning_dpaudit.bugs`, `lightning_dpaudit.digits`, ...) still resolve (see _compat).
"""

from importlib import import_module

from . import _compat
from .estimators import EpsilonEstimate, end_to_end_epsilon, epsilon_lower_bound, mu_to_epsilon

__version__ = "0.2.0"

_compat.install()

_LAZY = {
    "PrivacyAuditor": "engine.auditor",
    "PrivacyViolationWarning": "engine.auditor",
    "AuditResult": "analysis.results",
    "LayerAudit": "analysis.results",
    "Finding": "analysis.results",
    "audit_optimizer": "integrations.testing",
    "PrivacyAuditFailure": "integrations.testing",
    "DPAuditCallback": "integrations.callback",
    "PrivacyViolationError": "integrations.callback",
}

__all__ = ["EpsilonEstimate", "end_to_end_epsilon", "epsilon_lower_bound", "mu_to_epsilon", "__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
