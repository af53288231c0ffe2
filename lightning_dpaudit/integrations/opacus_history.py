"""Opacus's own historical privacy bugs, put back into the installed Opacus 1.6.0 as patches.

Each entry of ``HISTORICAL_BUGS`` reinstates, for the duration of its ``patch()`` context
manager, the logic an earlier Opacus release shipped (rewritten for 1.6.0's structure);
leaving the context restores the very objects that were there before. The audit can then be
run against bugs that really shipped, not only against invented ones (``bugs.py``).

    opacus-664   shipped 1.5-1.5.2, fixed in 1.5.3 by f2a591ae (PR #664).
                 ``make_private(grad_sample_mode="ghost")`` did not pass ``max_grad_norm`` to
                 ``_prepare_model``: the GradSampleModuleFastGradientClipping kept its default
                 ``max_grad_norm=1`` while the optimizer calibrated the noise to the given C.
                 Leak: with C < 1 per-sample gradients are clipped at 1 and noised with std
                 sigma*C, an effective noise multiplier of sigma*C.
    opacus-751   shipped 1.5-1.5.3, fixed in 1.5.4 by 7264cd73 (PR #751).
                 Ghost clipping's nn.Linear norm sampler took the bias norm of a sequence input
                 (3-D activations, g of shape T x d) as sqrt(||g g^T||_F^2) = ||g g^T||_F
                 instead of sqrt(1^T g g^T 1) = ||sum_t g_t|| (for one token: ||g||^2 for ||g||).
                 Leak: examples are clipped by a wrong norm; bias gradients of norm below 1
                 look smaller still and pass under-clipped.
    opacus-accumulation-1.5.3
                 shipped 1.5-1.5.2, fixed in 1.5.3 by 53b3c254 ("Fixing Ghost Clipping with
                 Batch Memory Manager", in the CHANGELOG without a PR number).
                 ``DPOptimizerFastGradientClipping.accumulate`` stored ``p.summed_grad = p.grad``
                 (an alias) and then ``+= p.grad``; ``zero_grad`` zeroes ``p.grad`` in place, so
                 the physical batches before the last are dropped and the last one is counted
                 twice. Leak: the last physical batch's records enter the update with weight 2,
                 twice the sensitivity the noise was calibrated for.
    opacus-571   shipped 1.0-1.6.0 (all releases of the 1.x API), not fixed: issues #571 and
                 #819 are open; ``patch()`` changes nothing and documents the behaviour.
                 ``make_private`` sets ``expected_batch_size = int(len(dataset) * sample_rate)``
                 and, with ``loss_reduction="mean"``, the update is divided by it. Leak: the
                 normaliser is a function of the private dataset size, so neighbouring
                 datasets (one record added or removed) give updates scaled differently
                 (e.g. 4 or 3 records, batch_size 2: divided by 2 or by 1), which the
                 subsampled-Gaussian accounting does not cover; with few records or large
                 outputs the two are nearly distinguishable.
    opacus-807   shipped 1.1.3-1.5.4 (AdaClipDPOptimizer, ``clipping="adaptive"``) and
                 1.5.3-1.5.4 (adaptive ghost clipping, PrivacyEngineAdaptiveClipping), fixed
                 in 1.6.0 by 9d3c2b01 (PR #807; the changelog line also cites #779, which only
                 fixed a LongTensor crash and is kept). AdaClip raised ``noise_multiplier``
                 to sigma_eff = (sigma^-2 - (2 sigma_u)^-2)^(-1/2) (Theorem 1 of Andrew et al.)
                 in place, and the accountant composed sigma_eff. Leak: the reported epsilon
                 is that of a larger noise multiplier than the privacy cost (sigma for the
                 gradient and the unclipped count together), several percent to much lower.
    opacus-820   reported on 1.5.4 (issue #820), not fixed in 1.6.0 (PR #826 only pins
                 peft==0.13.2 in a tutorial). Trainable PEFT/LoRA adapter parameters that
                 Opacus never registered: no grad-sample hooks, not in the ghost module's
                 ``trainable_parameters``. The patch reproduces that state without peft:
                 submodules whose qualified name has a component starting with ``lora_`` get
                 no hooks, and their parameters are left out of the per-sample norms. Leak
                 (ghost clipping): their gradient reaches the optimizer, noised, but clipped
                 by a coefficient computed from the other parameters' norms only, so one
                 example can move the adapter without bound. In hooks mode the DPOptimizer
                 raises instead ("Per sample gradient is not initialized").
                 The report's own root cause (still discussed) is an ordering hazard: the
                 adapter parameters materialise after ``make_private`` (model moved to the
                 device after ``get_peft_model``), so hooks and optimizer hold stale objects
                 and the adapter silently never trains. The registration gap is mimicked
                 here; the device-placement path needs CUDA and peft and is not reproduced.
    opacus-598   shipped 1.0-1.4.0, fixed in 1.4.1 by da05f778 (PR #598, "Fixing bugs for DP
                 MultiheadAttention"). ``ModuleValidator.fix`` replaced an
                 ``nn.MultiheadAttention(batch_first=True)`` by a DPMultiheadAttention without
                 ``batch_first``, which reads (N, L, E) as (L, N, E). Leak: the batch becomes
                 the sequence, every example attends to the others in its batch, and the
                 "per-sample" gradients mix examples, so clipping no longer bounds one
                 example's influence.
    opacus-541   shipped 1.1.1-1.3, fixed in 1.4 by 0b200590 (PR #541, issue #535).
                 ``GaussianAccountant.get_epsilon`` popped the history. Leak: every query
                 forgets the steps so far; the next epsilon counts only the steps since the
                 last query, under-reporting the privacy spent (a second query in a row
                 raises IndexError).

Fixes in the CHANGELOG since 1.4 that are left out, and why:
    #543, #550, #565 (1.4): DataLoader interface, a sampler option, the privacy script.
    #606 (1.4.1): the PRV accountant failed (raised) for large epsilons; not a silent
        misreport, and reinstating it means replacing numerical internals.
    #619 (1.4.1), #631, #633, #651 (1.5), #662 (1.5.2), #750, #754 (1.5.4), #779, #806,
        #778 (1.6.0): crashes (no trainable parameters, empty batches, device mismatch,
        DPMultiheadAttention shapes, DDP/FSDP optimizer calls, to_standard_module,
        LongTensor noise, custom batch structures, accountant state_dict).
    #641 (1.5): BatchMemoryManager's ``len`` only (progress bars), not what is sampled.
    #648 (1.5): make_private's extra kwargs never reached the optimizer class (AdaClip could
        not be configured); the flat clipping and noise were unaffected.
    #660 (1.5.2): setting param_groups/defaults/state on the DPOptimizer wrapper; no effect
        on clipping, noise or accounting.
    #663, #675, #720, #756, #758, #759: dependencies, constructor arguments, the switch to
        full backward hooks (the hooks read grad_output, the same either way), cleanup,
        warnings, type hints.
    #808 (1.6.0): ignore_index tokens counted in ghost clipping's per-sequence mean loss;
        changes the loss weighting (utility), not the bound: each per-sequence gradient is
        still clipped to C.
    The FSDP ghost optimizer (1.6.0) has its own ``accumulate``; it never shipped the
    accumulation bug and is left alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from .opacus_history_patches import (
    ADAPTER_PREFIX,
    Patch,
    patches_541,
    patches_598,
    patches_664,
    patches_751,
    patches_807,
    patches_820,
    patches_accumulation,
)

__all__ = ["HISTORICAL_BUGS", "HistoricalBug", "historical_bug", "ADAPTER_PREFIX"]

ALL_MODES = ("hooks", "functorch", "ew", "ghost")

_MISSING = object()


def _current(owner, key):
    if isinstance(owner, dict):
        return owner.get(key, _MISSING)
    return vars(owner).get(key, _MISSING)


def _put(owner, key, value) -> None:
    if isinstance(owner, dict):
        if value is _MISSING:
            owner.pop(key, None)
        else:
            owner[key] = value
    elif value is _MISSING:
        if key in vars(owner):
            delattr(owner, key)
    else:
        setattr(owner, key, value)


@dataclass(frozen=True)
class HistoricalBug:
    """One bug an Opacus release shipped; ``patch()`` puts it back into Opacus 1.6.0."""

    name: str
    title: str
    shipped_in: str
    fixed_in: Optional[str]  # None: still how Opacus 1.6.0 behaves
    fix: str  # the commit / PR that fixed it (or the open issues)
    what: str  # what leaks, in one sentence
    modes: Tuple[str, ...]  # grad_sample_mode values affected
    _patches: Callable[[], List[Patch]] = field(repr=False, compare=False)

    def targets(self) -> List[Tuple[object, str]]:
        """The (owner, key) pairs ``patch()`` replaces."""
        return [(owner, key) for owner, key, _ in self._patches()]

    @contextlib.contextmanager
    def patch(self) -> Iterator["HistoricalBug"]:
        """Reinstate the bug; on exit put back exactly the objects found on entry."""
        patches = self._patches()
        saved = [(owner, key, _current(owner, key)) for owner, key, _ in patches]
        try:
            for owner, key, value in patches:
                _put(owner, key, value)
            yield self
        finally:
            for owner, key, old in reversed(saved):
                _put(owner, key, old)


_ENTRIES = (
    HistoricalBug(
        name="opacus-664",
        title="make_private with ghost clipping ignored max_grad_norm (clipped at 1)",
        shipped_in="1.5-1.5.2",
        fixed_in="1.5.3",
        fix="f2a591ae (PR #664)",
        what="Per-sample gradients are clipped at norm 1 while the noise is calibrated to the given C, "
        "so with C < 1 the effective noise multiplier is sigma*C.",
        modes=("ghost",),
        _patches=patches_664,
    ),
    HistoricalBug(
        name="opacus-751",
        title="ghost clipping: wrong nn.Linear bias norm for sequence (3-D) inputs",
        shipped_in="1.5-1.5.3",
        fixed_in="1.5.4",
        fix="7264cd73 (PR #751)",
        what="The bias's per-sample norm for 3-D activations is ||g g^T||_F instead of ||sum_t g_t|| "
        "(a squared norm), so examples are clipped by the wrong norm and small ones pass under-clipped.",
        modes=("ghost",),
        _patches=patches_751,
    ),
    HistoricalBug(
        name="opacus-accumulation-1.5.3",
        title="ghost clipping with BatchMemoryManager: physical batches dropped or counted twice",
        shipped_in="1.5-1.5.2",
        fixed_in="1.5.3",
        fix="53b3c254 (CHANGELOG: 'Fix issue with ghost clipping and BatchMemoryManager')",
        what="summed_grad aliases p.grad, which zero_grad zeroes in place: the physical batches before "
        "the last are dropped and the last is counted twice, doubling its records' sensitivity.",
        modes=("ghost",),
        _patches=patches_accumulation,
    ),
    HistoricalBug(
        name="opacus-571",
        title="the mean-reduced update is divided by expected_batch_size derived from the dataset size",
        shipped_in="1.0-1.6.0",
        fixed_in=None,
        fix="open: issues #571, #819 (patch() is a no-op: Opacus 1.6.0 still does this)",
        what="expected_batch_size = int(len(dataset) * sample_rate) divides the update, so neighbouring "
        "datasets give differently scaled updates, a leak of the private dataset size that the "
        "subsampled-Gaussian accounting does not cover.",
        modes=ALL_MODES,
        _patches=lambda: [],
    ),
    HistoricalBug(
        name="opacus-807",
        title="adaptive clipping: the accountant composed the adjusted noise multiplier",
        shipped_in="1.1.3-1.5.4 (AdaClipDPOptimizer); 1.5.3-1.5.4 (adaptive ghost clipping)",
        fixed_in="1.6.0",
        fix="9d3c2b01 (PR #807; CHANGELOG also cites #779)",
        what="noise_multiplier is overwritten by sigma_eff = (sigma^-2 - (2 sigma_u)^-2)^(-1/2) > sigma, "
        "which the accountant composes, so the reported epsilon is too low.",
        modes=ALL_MODES,
        _patches=patches_807,
    ),
    HistoricalBug(
        name="opacus-820",
        title="trainable adapter (PEFT/LoRA) parameters never registered with Opacus",
        shipped_in="1.5.4-1.6.0",
        fixed_in=None,
        fix="open: issue #820 (PR #826 only pins peft==0.13.2 in the tutorial)",
        what="Adapter parameters get no per-sample norms under ghost clipping, so their gradient reaches "
        "the optimizer clipped by a coefficient computed without them: one example's influence on the "
        "adapter is unbounded.",
        modes=("ghost",),
        _patches=patches_820,
    ),
    HistoricalBug(
        name="opacus-598",
        title="ModuleValidator.fix dropped batch_first of nn.MultiheadAttention",
        shipped_in="1.0-1.4.0",
        fixed_in="1.4.1",
        fix="da05f778 (PR #598)",
        what="A batch_first attention layer is replaced by one that reads the batch as the sequence, so "
        "examples attend to each other and per-sample gradients mix examples, unbounding one's influence.",
        modes=ALL_MODES,
        _patches=patches_598,
    ),
    HistoricalBug(
        name="opacus-541",
        title="GaussianAccountant.get_epsilon consumed the accountant's history",
        shipped_in="1.1.1-1.3",
        fixed_in="1.4",
        fix="0b200590 (PR #541, issue #535)",
        what="Each epsilon query pops the history, so the next one counts only the steps since the last "
        "query and under-reports the privacy spent.",
        modes=ALL_MODES,
        _patches=patches_541,
    ),
)

HISTORICAL_BUGS: Dict[str, HistoricalBug] = {bug.name: bug for bug in _ENTRIES}


def historical_bug(name: str) -> HistoricalBug:
    """The entry called ``name``; ValueError listing the names if there is none (or ``name`` is not a string)."""
    if not isinstance(name, str):
        raise ValueError(
            f"Unexpected value for `name`: {name!r} of type {type(name).__name__}; use one name, a string, of: "
            f"{', '.join(HISTORICAL_BUGS)}"
        )
    try:
        return HISTORICAL_BUGS[name]
    except KeyError:
        raise ValueError(
            f"unknown historical Opacus bug {name!r}; valid names: {', '.join(HISTORICAL_BUGS)}"
        ) from None
