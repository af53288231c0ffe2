"""For test suites: a DP optimizer audited in one call, the bug zoo, and Opacus's historical privacy bugs.

    audit_optimizer / train_audited   an optimizer class (or a training function) audited to a verdict
    inject_bug / list_bugs            the bug zoo: known ways DP-SGD code goes wrong, put into an optimizer
    historical_bug                    a privacy bug an Opacus release shipped, put back into Opacus 1.6
"""

from .integrations.opacus_history import historical_bug
from .integrations.testing import BUGS, AuditIncomplete, PrivacyAuditFailure, audit_optimizer, inject_bug, list_bugs, train_audited

__all__ = ["BUGS", "AuditIncomplete", "PrivacyAuditFailure", "audit_optimizer", "historical_bug", "inject_bug", "list_bugs",
           "train_audited"]
