"""The claim of each audited step: the noise multiplier and clipping bound(s) the optimizer uses now.

Opacus's noise and clipping schedulers (`opacus.schedulers`) and user code change
`optimizer.noise_multiplier` and `optimizer.max_grad_norm` between steps; the accountant
composes each step's own noise multiplier. Before every audited step this reads both; when
they changed, the canaries are sized by the new bounds and read in their units, and the
step's observations go to the claim segment of the new claim (analysis/claim_segments.py).

It also compares what the accountant recorded for the previous step with the noise
multiplier that step used: a claim the accountant does not see (a hook that composes a
noise multiplier of its own, a schedule that bypasses the accountant) makes the reported
epsilon wrong whatever the noise, and is a set-up problem.

A noise multiplier of exactly 0 (at attach or set later) is a void claim: the release is
the clipped sum itself. It is the finding NO_NOISE (scope "mechanism", a certainty), not a
refusal; its steps are released plain, with no canary (pipeline.py), while the canaries
keep a claim that is a number (`audited_claim`) for the steps after it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Optional

import numpy as np

from ..options import Mechanism
from .claim_range import check_claim, claim_number

NO_NOISE = "no_noise"
UNACCOUNTED = "claim_unaccounted"  # steps the accountant did not compose with their noise


def no_noise_message(step: int) -> str:
    return (f"the optimizer's noise multiplier is 0 from step {step}: the release is the clipped sum without noise, so "
            "no (epsilon, delta) holds and the accountant's epsilon does not describe the run. Fix: restore "
            "optimizer.noise_multiplier to the value the run was calibrated for (make_private's, or its schedule's)")


def audited_claim(mechanism: Mechanism) -> Mechanism:
    """The mechanism the canaries are sized and read against: the optimizer's, or, where its noise multiplier is 0
    (no claim: no step is audited while it is), the same bounds under noise multiplier 1, so that the claim the
    audit opens with, 1 / sigma, is a number. A later positive noise multiplier opens its own claim."""
    return replace(mechanism, noise_multiplier=1.0) if mechanism.noise_multiplier == 0 else mechanism


def claim_of(optimizer) -> tuple:
    """(noise multiplier, clipping bounds per tensor) as the optimizer holds them now."""
    bounds = getattr(optimizer, "max_grad_norms", None)
    if bounds is None:
        bounds = [claim_number(optimizer.max_grad_norm)] * len(optimizer.params)
    return optimizer.noise_multiplier, tuple(bounds)


class StepClaims:
    """Follows the optimizer's claim from step to step; `before_step` gives the step's mechanism."""

    def __init__(self, optimizer, mechanism: Mechanism, accountant):
        self.optimizer, self.mechanism, self.accountant = optimizer, mechanism, accountant
        self.on_change: Callable[[Mechanism], None] = lambda mechanism: None  # the step pipeline's follow_claim
        self._read = claim_of(optimizer)
        self._stepped = False  # a step ran since attach: self.mechanism is the claim it used
        self._accounted = self._last_entry()
        self._baseline = None  # composed steps minus audited steps, read at the first audited step

    def before_step(self, step: int) -> Mechanism:
        """The mechanism this step claims; calls on_change first when it differs from the last step's (a noise
        multiplier of 0 included: the step is then released without canaries, pipeline.py)."""
        now = claim_of(self.optimizer)
        if now != self._read:
            check_claim(self.optimizer)
            sigma, bounds = now
            self.mechanism = replace(
                self.mechanism, clip_bounds=np.array(bounds, dtype=float), noise_multiplier=float(sigma),
                max_grad_norm=float(self.optimizer.max_grad_norm),
            )
            self._read = now
            self.on_change(self.mechanism)
        return self.mechanism

    def accounting_problems(self, step: int) -> list:
        """Before step `step` + 1 is claimed: (code, message) of each way the accountant did not compose the steps
        released so far with their noise (after the first step; at the first, the composed steps the audit starts
        from are read). A certainty each: checks/mechanism/accountant.py reports them."""
        problems = []
        if self._stepped:
            problems += self._history_problem(step) + self._accountant_problem(step)
        elif self.accountant is not None:
            self._baseline = composed_steps(self.accountant) - step
        self._stepped = True
        return problems

    def resync(self, steps: int) -> None:
        """Opacus's step raised after its release (opacus_step.py): it may be composed or not, so the steps after it
        are compared with the accountant's history as it is now, `steps` steps released."""
        if self._baseline is not None:
            self._baseline = composed_steps(self.accountant) - steps
        self._accounted = self._last_entry()

    def _last_entry(self) -> tuple:
        """(entries, the last one) of the accountant's history: it changes when the accountant records a step.

        Opacus merges a step into the last entry when its parameters are the same, so the
        history has an entry per change of claim, and this reads one entry, not all of them.
        """
        history = getattr(self.accountant, "history", None) or []
        return (len(history), tuple(history[-1])) if history else (0, None)

    def _history_problem(self, step: int) -> list:
        """Every step released since the first audited one is composed: the accountant's history holds
        at least (its steps then) + (steps since). Fewer is a certainty: steps the epsilon leaves out."""
        if self._baseline is None:
            return []
        now, expected = composed_steps(self.accountant), self._baseline + step
        if now >= expected:
            return []
        return [(UNACCOUNTED, (
            f"the accountant's history composes {now} step(s) where {expected} were released: steps it had "
            "composed were removed (an accountant whose get_epsilon consumes its history counts only the steps "
            "since the last query) or never recorded, so its epsilon is too low. Fix: an accountant stepped by "
            "the optimizer's hook that keeps every step (Opacus >= 1.4)"
        ))]

    def _newly_accounted(self) -> bool:
        """Whether the accountant recorded a step since the last look (not when its history is empty)."""
        if self.accountant is None:
            return False
        accounted = self._last_entry()
        if accounted == self._accounted:  # nothing recorded for the previous step (not our accountant's hook)
            return False
        self._accounted = accounted
        return accounted[1] is not None  # an emptied history: _history_problem names it

    def _accountant_problem(self, step: int) -> list:
        """The accountant's last entry, if it recorded the previous step, must carry that step's noise multiplier."""
        if not self._newly_accounted():
            return []
        recorded = float(self.accountant.history[-1][0])
        used = self.mechanism.noise_multiplier  # not yet updated: the previous step's claim
        if math.isclose(recorded, used, rel_tol=1e-6):
            return []
        return [(UNACCOUNTED, (
            f"the accountant composed noise multiplier {recorded:.4g} for step {step}, but the optimizer used "
            f"{used:.4g} (its noise_multiplier then): the accountant's epsilon is not the run's. Fix: let the "
            "step hook make_private attached read optimizer.noise_multiplier at every step, and change the noise "
            "only through optimizer.noise_multiplier (opacus.schedulers do)."
        ))]


def composed_steps(accountant) -> int:
    """The steps an Opacus accountant's history composes: entries (noise multiplier, sample rate, steps)."""
    history = getattr(accountant, "history", None) or []
    return int(sum(entry[2] for entry in history if len(entry) > 2))


def normalisation_problem(optimizer) -> Optional[str]:
    """The update divided by Opacus's expected_batch_size under loss_reduction="mean", a quantity
    make_private derives from the dataset's size (int(len(dataset) * sample_rate))."""
    size = getattr(optimizer, "expected_batch_size", None)
    if getattr(optimizer, "loss_reduction", None) != "mean" or not size:
        return None
    return (
        f"the update is divided by expected_batch_size = {size:g}, derived from the dataset's size: under add/remove "
        "neighbouring the step's scale can tell neighbouring datasets apart (under substitution nothing leaks); "
        "for none, use loss_reduction=\"sum\" and a fixed, public batch size (see the data path guide)"
    )
