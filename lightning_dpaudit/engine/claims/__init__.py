"""What each audited step claims: the optimizer's noise multiplier and clipping bound(s), read at every step.

    step_claim.py    the claim of each step, read from the optimizer; the normalisation a claim does not cover
    adaptive.py      adaptive clipping (AdaClip, adaptive ghost clipping): the gradient's own noise multiplier
    claim_range.py   a claim float32 can hold, refused at attach otherwise
"""

from .step_claim import (
    NO_NOISE,
    StepClaims,
    audited_claim,
    claim_of,
    composed_steps,
    no_noise_message,
    normalisation_problem,
)

__all__ = ["NO_NOISE", "StepClaims", "audited_claim", "claim_of", "composed_steps", "no_noise_message",
           "normalisation_problem"]
