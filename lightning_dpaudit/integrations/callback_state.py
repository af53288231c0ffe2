"""What DPAuditCallback saves in a Lightning checkpoint and restores from one.

The auditor's state, the accountant's history (Opacus accountants are not part of a
Lightning checkpoint), the logged epsilon history, whether the alert fired, the
final-model audit's secret seed and start losses and, when asked for, the optimizer's
noise generator. A state loaded before the auditor exists waits until fit start.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_warn

from ..engine.state import AuditStateError
from .logged_values import _from_checkpoint, _to_checkpoint


class AuditCheckpointing:
    """Checkpoint methods of DPAuditCallback (which holds auditor, history, alerted, final_model,
    checkpoint_noise_generator, _pending_state and _warned_generator)."""

    def state_dict(self) -> dict:
        state = {"history": list(self.history), "alerted": self.alerted}
        if self.final_model is not None:
            state["final_model"] = self.final_model.state_dict()
        if self.auditor is not None:
            state["auditor"] = _to_checkpoint(self.auditor.state_dict())
            if self.auditor.accountant is not None:
                state["accountant_history"] = [list(entry) for entry in self.auditor.accountant.history]
            if self.checkpoint_noise_generator:
                generator = self._noise_generator()
                if generator is not None:
                    state["noise_generator"] = generator.get_state()
        elif self._pending_state is not None:
            state["auditor"] = self._pending_state.get("auditor")
            if self._pending_state.get("noise_generator") is not None:
                state["noise_generator"] = self._pending_state["noise_generator"]
        return state

    def _noise_generator(self) -> Optional[torch.Generator]:
        """The optimizer's own noise generator when its state can be saved and restored; else None, warned once."""
        optimizer = self.auditor.optimizer
        generator = getattr(optimizer, "generator", None)
        if isinstance(generator, torch.Generator) and not getattr(optimizer, "secure_mode", False):
            return generator
        if not self._warned_generator:
            self._warned_generator = True
            source = "the operating system (secure mode)" if getattr(optimizer, "secure_mode", False) else (
                "torch's global generator" if generator is None else f"a {type(generator).__name__}"
            )
            rank_zero_warn(
                f"checkpoint_noise_generator: the optimizer draws its noise from {source}, whose state the callback "
                "does not save; give make_private a noise_generator=torch.Generator() to have it saved",
                category=UserWarning,
            )
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        check_alerted(state_dict)
        if self.final_model is not None and state_dict.get("final_model") is not None:
            self.final_model.load_state_dict(state_dict["final_model"])  # before the data loader first reads the canaries
        self._pending_state = dict(state_dict)
        if self.auditor is not None:
            self._restore(self._pending_state)
            self._pending_state = None

    def _restore(self, state: dict) -> None:
        check_alerted(state)
        self.history = list(state.get("history", []))
        self.alerted = bool(state.get("alerted", False))
        if state.get("auditor") is not None:
            self.auditor.load_state_dict(_from_checkpoint(state["auditor"]))
        accountant = self.auditor.accountant
        if accountant is not None and not accountant.history and state.get("accountant_history"):
            # Opacus accountants are not part of Lightning checkpoints; without this the
            # resumed run would account only for the steps after the resume.
            accountant.history = [tuple(entry) for entry in state["accountant_history"]]
        if self.checkpoint_noise_generator and state.get("noise_generator") is not None:
            generator = self._noise_generator()
            if generator is not None:
                generator.set_state(state["noise_generator"])


def check_alerted(state: dict) -> None:
    """`alerted` is True or False (numpy's too); anything else is refused by name, before anything is restored."""
    alerted = state.get("alerted", False)
    if not isinstance(alerted, (bool, np.bool_)):
        raise AuditStateError(f"the callback state's `alerted` is {alerted!r}; expected True or False. The state is damaged")
