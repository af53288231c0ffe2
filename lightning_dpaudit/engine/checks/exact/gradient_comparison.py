"""Sentences for a difference between what Opacus holds for one example and what plain autograd gives.

Tolerance: relative `rtol` of the larger norm, plus max(ATOL, eps) of the example's whole gradient norm.
"""

from __future__ import annotations

from typing import Optional

ATOL = 1e-4  # relative to the example's whole gradient norm (one unit roundoff, if larger)


def tensor_problem(names, held, i: int, grads, total: float, rtol: float, eps: float, ghost: bool) -> Optional[str]:
    """The first tensor whose per-sample gradient (ghost: norm) of example i is not autograd's, as a sentence."""
    atol = max(ATOL, eps) * total + 1e-12
    for name, opacus, exact in zip(names, held, grads):
        exact_norm = 0.0 if exact is None else float(exact.double().norm())
        if opacus is None:
            if exact_norm > atol:
                return (f"`{name}` reaches the optimizer with a gradient (norm {exact_norm:.4g} for this example) "
                        "but without a per-sample gradient: its contribution is never clipped")
            continue
        if ghost:
            opacus_norm = float(opacus[i])
            gap = abs(opacus_norm - exact_norm)
            what = "per-sample gradient norm (ghost clipping)"
        else:
            row = opacus[i].double()
            opacus_norm = float(row.norm())
            gap = float((row - (0 if exact is None else exact.double().reshape(row.shape))).norm())
            what = "per-sample gradient"
        if gap > rtol * max(opacus_norm, exact_norm) + atol:
            return (f"Opacus's {what} of `{name}` has norm {opacus_norm:.6g}, plain autograd on the example "
                    f"alone gives {exact_norm:.6g} (difference {gap:.3g})")
    return None


def coefficient_problem(gsm, i: int, total: float, C: float, rtol: float) -> Optional[str]:
    """Ghost clipping: the module's coefficient for example i against min(1, C / (norm + 1e-6)), as a sentence."""
    saved = gsm._per_sample_gradient_norms
    try:
        coef = float(gsm.get_clipping_coef()[i])
    finally:
        gsm._per_sample_gradient_norms = saved
    exact = min(1.0, C / (total + 1e-6))
    if abs(coef - exact) > rtol * max(coef, exact) + 1e-6:
        leaks = "leaks: the contribution can exceed C" if coef > exact else "clips harder than claimed"
        return (f"the module's clipping coefficient is {coef:.6g} where min(1, C / norm) with the optimizer's "
                f"C = {C:g} and the example's gradient norm {total:.6g} gives {exact:.6g} ({leaks})")
    return None
