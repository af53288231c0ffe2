"""lightning_dpaudit: audit differentially private training while it runs.

`lightning_dpaudit.estimators` is importable without torch; the torch-based parts are
loaded on first use.
"""

from importlib import import_module

from .estimators import EpsilonEstimate, end_to_end_epsilon, epsilon_lower_bound, mu_to_epsilon

__version__ = "0.1.0"

_LAZY = {
    "PrivacyAuditor": "auditor",
    "PrivacyViolationWarning": "auditor",
    "AuditResult": "results",
    "LayerAudit": "results",
    "Finding": "results",
    "audit_optimizer": "testing",
    "PrivacyAuditFailure": "testing",
    "DPAuditCallback": "callback",
    "PrivacyViolationError": "callback",
}

__all__ = ["EpsilonEstimate", "end_to_end_epsilon", "epsilon_lower_bound", "mu_to_epsilon", "__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
