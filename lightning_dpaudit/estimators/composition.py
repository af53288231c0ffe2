"""From a per-step mu lower bound to an end-to-end epsilon (Tight Auditing, section 5.5).

If each noised step is at least mu_step-GDP in the worst case, its Gaussian noise
multiplier is at most sigma_emp = 1 / mu_step. Composing that mechanism with the run's
own sample rate and step count, through the same kind of accountant as the run (Opacus's
RDP, PRV or GDP accountant), gives the end-to-end epsilon the observed leakage implies.
Opacus is imported only when this is called, so the estimators stay free of torch.
To recompute it (and the accountant's epsilon) at every log step of a run, use
`live_epsilon.LiveEpsilon`, which reuses work between calls.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

from ._checks import check_count, check_delta, check_nonnegative

ACCOUNTANTS = ("rdp", "prv", "gdp")
PRV_MU_LIMIT = 4.0  # Opacus's PRV at 200 steps of rate 0.036: 3 s and 0.3 GB at mu 4; raises at 8 (live_epsilon.py)
MAX_STEPS = 10**8  # composed steps, any accountant
# Opacus's PRV discretises the privacy loss on 2 L / mesh points, L its RDP-derived domain size and mesh
# 0.01 / sqrt(steps log(12 / delta_error) / 2): its peak memory is about 250 bytes a point (1 GB at 4e6 points,
# 1e6 steps of rate 0.001 at mu 0.5). Above this many points the composition is refused before it allocates.
MAX_PRV_POINTS = 2**23  # about 2 GB


def end_to_end_epsilon(
    mu_step: float,
    *,
    delta: float,
    sample_rate: Optional[float] = None,
    steps: Optional[int] = None,
    history: Optional[Sequence[Tuple[float, float, int]]] = None,
    accountant: str = "rdp",
) -> float:
    """Epsilon at `delta` of `steps` steps with noise multiplier 1/mu_step at `sample_rate`.

    Instead of sample_rate and steps, pass an Opacus accountant's `history`
    [(noise_multiplier, sample_rate, steps), ...]: every entry keeps its sample rate and
    step count and takes the empirical noise multiplier 1/mu_step.
    """
    mu_step = check_nonnegative(mu_step, "mu_step")
    delta = check_delta(delta, allow_zero=False, why="the composed Gaussian has epsilon = inf at delta = 0")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"Unexpected value for `accountant`: {accountant!r}; valid accountants are {', '.join(ACCOUNTANTS)}")
    if history is None:
        if sample_rate is None or steps is None:
            raise ValueError("pass `sample_rate` and `steps`, or an accountant's `history`")
        history = [(None, sample_rate, steps)]
    elif sample_rate is not None or steps is not None:
        raise ValueError("pass either `history` or `sample_rate` and `steps`, not both")
    if isinstance(history, (str, bytes)) or not hasattr(history, "__iter__"):
        raise ValueError(
            f"Unexpected value for `history`: {history!r}; pass a list of (noise_multiplier, sample_rate, steps) "
            "entries, as an Opacus accountant's `history`"
        )
    entries = []
    for entry in history:
        if isinstance(entry, (str, bytes)) or not hasattr(entry, "__len__") or len(entry) != 3:
            raise ValueError(
                f"Unexpected entry in `history`: {entry!r}; each is (noise_multiplier, sample_rate, steps)"
            )
        _, q, n = entry
        q = check_nonnegative(q, "sample_rate")
        n = check_count(n, "steps")
        if not 0.0 < q <= 1.0:
            raise ValueError(f"Unexpected value for `sample_rate`: {q}; it must lie in (0, 1]")
        entries.append((q, n))
    if mu_step == 0.0 or sum(n for _, n in entries) == 0:
        return 0.0
    if math.isinf(mu_step):
        return math.inf
    if accountant == "prv" and mu_step > PRV_MU_LIMIT:
        raise ValueError(
            f"mu_step {mu_step:g} is beyond what the PRV accountant computes in bounded memory (<= {PRV_MU_LIMIT:g}; "
            "its work grows with mu and fails near 8); use accountant='rdp' or 'gdp'"
        )
    check_composition_size([(1.0 / mu_step, q, n) for q, n in entries], delta=delta, accountant=accountant)
    from opacus.accountants import create_accountant

    composed = create_accountant(accountant)
    composed.history = [(1.0 / mu_step, q, n) for q, n in entries if n > 0]
    return max(0.0, float(composed.get_epsilon(delta=delta)))  # a conversion below 0 (large delta) means 0


def prv_points(history: Sequence[Tuple[float, float, int]], *, delta: float) -> float:
    """How many points Opacus's PRVAccountant.get_epsilon(delta) discretises `history` on
    [(noise_multiplier, sample_rate, steps), ...] (its domain size and mesh, computed the same way; cheap)."""
    import numpy as np
    from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV, compute_safe_domain_size

    eps_error, delta_error = 0.01, delta / 1000  # PRVAccountant.get_epsilon's defaults
    entries = [(s, q, n) for s, q, n in history if n > 0]
    total = sum(n for _, _, n in entries)
    if total == 0:
        return 0.0
    # any warning here (the RDP orders') is the composition's own, from the same place, shown once per location; no
    # warnings.catch_warnings: leaving one would show every once-per-location warning of the user's run again
    size = compute_safe_domain_size(
        [PoissonSubsampledGaussianPRV(q, s) for s, q, _ in entries], [n for _, _, n in entries], eps_error, delta_error,
    )
    mesh = eps_error / np.sqrt(total * np.log(12 / delta_error) / 2)
    return float(2 * size / mesh)


def check_composition_size(history: Sequence[Tuple[float, float, int]], *, delta: float, accountant: str) -> None:
    """Refuse, before anything is allocated, a composition of more than MAX_STEPS steps, or one the PRV
    accountant would discretise on more than MAX_PRV_POINTS points."""
    total = sum(int(n) for _, _, n in history)
    if total > MAX_STEPS:
        raise ValueError(
            f"Unexpected value for `steps`: {total:,} steps to compose; at most {MAX_STEPS:,} (10**8) are composed"
        )
    if accountant == "prv":
        points = prv_points(history, delta=delta)
        if points > MAX_PRV_POINTS:
            raise ValueError(
                f"the PRV accountant would discretise {total:,} steps on {points:.3g} points (about "
                f"{points * 250 / 2**30:.0f} GiB), above the bound of {MAX_PRV_POINTS:,} points (2**23, about 2 GB); "
                "use accountant='rdp' or 'gdp'"
            )
