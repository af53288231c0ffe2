"""The checks an audit runs unless it is given its own: `default_checks`."""

from __future__ import annotations

from typing import Callable, Optional

from .exact.per_sample import PerSampleCheck
from .mechanism.accountant import AccountantCheck
from .mechanism.ghost_clipping import GhostClippingCheck
from .mechanism.replicas import ReplicaCheck
from .mechanism.setup import SetupCheck
from .run.coupling import CouplingCheck
from .run.multiplicity import MultiplicityCheck
from .run.outside_dp import OutsideDPCheck
from .run.sampling import SamplingCheck


def default_checks(*, training_loss: Optional[Callable] = None, per_sample_check_every: Optional[int] = None,
                   per_sample_check_examples: Optional[int] = None,
                   per_sample_check_budget: Optional[float] = None) -> list:
    """A new list of the default checks, in the order they run:

    set-up              the noise reconciled over processes, the sample rate over ranks; the normalisation note
    sampling            batches drawn as the accountant composes (Poisson at its q, fresh each step)
    rows per record     one row of the clipped sum per record
    per-sample gradients  a few real examples' per-sample gradients against plain autograd, and the accumulated sum
    independence        each example's gradient depends on that example alone (replays at the exact checks' steps)
    outside DP          nothing of the module trained outside the DP optimizer
    accountant          every released step composed, with the noise it used
    replicas            every replica of a data-parallel run holds the same parameters
    ghost clipping      ghost clipping's norms and coefficients, as the canaries' rows went through them

    Each option left None takes the audit's own (PrivacyAuditor's `training_loss=` and `per_sample_check_*=`), so
    `checks=[*default_checks(), MyCheck()]` runs the defaults as the audit's options set them, and your check.
    """
    exact = PerSampleCheck(every=per_sample_check_every, examples=per_sample_check_examples,
                           budget=per_sample_check_budget)
    return [SetupCheck(), SamplingCheck(), MultiplicityCheck(), exact, CouplingCheck(training_loss, schedule=exact),
            OutsideDPCheck(), AccountantCheck(), ReplicaCheck(), GhostClippingCheck()]
