"""The noise_correlated finding: a step's noise correlated with a recent step's (noise_correlation.py).

The correlation quoted is sin(pi c / 2) for the mean sign correlation c of all pairs of
steps `lag` apart, with its anytime interval at the audit's confidence, valid for every
lag at once (so for the lag that fired). A correct optimizer gives 0 at every lag.
"""

from __future__ import annotations

from .noise_correlation import Correlation
from .results import Finding

_FIX = (
    "fix: draw every step's noise fresh from one generator (secure_mode=True in PrivacyEngine, or make_private's "
    "noise_generator) and never add back, negate or average an earlier step's noise"
)


def correlated(c: Correlation) -> Finding:
    """What the correlation test measured, its likely causes and the fix."""
    back = f"{c.lag} step{'s' * (c.lag != 1)} back"
    if c.value < 0:
        cause = ("the noise is negated and reused (antithetic noise, a 'variance reduction' that makes the sum of two "
                 "releases noise-free)")
    else:
        cause = ("the noise is partly reused: noise momentum or smoothing (z_t = a z_(t-lag) + b fresh), a noise "
                 "buffer not cleared, or a generator state restored in part")
    return Finding(
        code="noise_correlated",
        message=(
            f"the noise of step {c.step} is correlated with step {c.earlier}'s, {back}: correlation {c.value:.2f} "
            f"({c.confidence:.0%} CI {c.low:.2f} to {c.high:.2f}) over {c.pairs} pairs of steps {c.lag} apart, where "
            f"fresh noise gives 0; the accountant composes independent steps, so the claim does not hold. Likely "
            f"cause: {cause}; {_FIX}"
        ),
        first_step=int(c.step),
        measured=float(c.value),
        claimed=0.0,
    )
