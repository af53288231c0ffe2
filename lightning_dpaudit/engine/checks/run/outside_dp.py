"""Everything trained is private: no tensor of the module learns from the data outside the DP optimizer.

optimizers   a tensor held by another optimizer of the run (the Trainer's other optimizers, or
             `other_optimizers=`), the module's or not (a loss's own temperature): trained without
             noise. Certain at attach: finding `outside_dp`. The check cannot tell what those gradients
             came from: a generator trained only through a DP discriminator (a DP-GAN), which is
             post-processing, is flagged too.
parameters   a tensor of the module that requires grad and that the DP optimizer does not hold is
             watched: its fingerprint (sum, sum of squares and a fixed random projection, float64)
             is taken at attach and compared at steps 1, 2 and every WATCH_EVERY steps, and a hook
             (register_post_accumulate_grad_hook, removed at close) records whether a gradient
             reached it while attached, outside the audit's own work. A tensor that changed and
             received a gradient (the hook fired, or its `.grad` differs from the one at attach) was
             updated from the data's gradients by something other than the DP optimizer (a second
             optimizer, a manual step): certain, finding `outside_dp`. A tensor that changed with no
             gradient ever reaching it was computed from other tensors, most often the DP iterates
             (an EMA or SWA average, a copy for evaluation): post-processing, said in a note, never
             an alarm. Left unchanged it releases nothing, and is counted in the status.
buffers      buffers the forward pass updates from the examples (running statistics) are found by
             the exact checks' replay (coupling.py).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .base import DOES_NOT_DESCRIBE, RunCheck

CODE = "outside_dp"
WATCH_EVERY = 100
NAMED = 4


def fingerprint(t: torch.Tensor) -> tuple:
    """(sum, sum of squares, sum of x_i * ((i * 2654435761) mod 2^32)) in float64: equal tensors give equal prints."""
    flat = t.detach().reshape(-1).to(torch.float64)
    weights = (torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) * 2654435761) % (2**32)
    return tuple(float(v) for v in (flat.sum(), (flat * flat).sum(), (flat * weights.to(torch.float64)).sum()))


def grad_print(t: torch.Tensor) -> Optional[tuple]:
    """The fingerprint of the tensor's `.grad` (None when it holds none)."""
    return None if t.grad is None else fingerprint(t.grad)


def listed(names: List[str]) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:NAMED])
    return shown + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")


class OutsideDPCheck(RunCheck):
    name = "tensors outside the DP optimizer"
    codes = (CODE,)

    def __init__(self):
        self.watched: Dict[str, tuple] = {}  # name -> (tensor, fingerprint at attach, its .grad's fingerprint at attach)
        self.found = False
        self.compared = 0
        self.received: set = set()  # watched tensors a gradient reached while attached (the hooks)
        self.post_processed: set = set()  # watched tensors that changed with no gradient reaching them
        self.handles: list = []

    def attach(self, run) -> None:
        super().attach(run)
        module = run.module
        covered = {id(p) for p in run.params}
        module = getattr(module, "_module", module)  # a GradSampleModule's tensors by the model's own names
        named = [] if module is None else [(n, p) for n, p in module.named_parameters() if id(p) not in covered]
        names = {id(p): n for n, p in named}
        others = []
        for optimizer in run.other_optimizers:  # every tensor they hold, the module's or not (a loss's own, ...)
            held = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in covered]
            if held:
                others.append((type(optimizer).__name__, [names.get(id(p), f"a tensor of shape {tuple(p.shape)}")
                                                          for p in held]))
        if others:
            said = "; ".join(f"{listed(names)} by {kind}" for kind, names in others)
            self._found(f"tensors of the module are trained by another optimizer than the DP optimizer, without noise "
                        f"or clipping: {said}", 0)
        self.watched = {n: (p, fingerprint(p), grad_print(p)) for n, p in named if p.requires_grad}
        self.handles = [p.register_post_accumulate_grad_hook(self._receiver(n))
                        for n, (p, _, _) in self.watched.items() if p.is_leaf]

    def _receiver(self, name: str):
        def received(_tensor) -> None:
            if not self.run.busy:  # the audit's own passes are not the data's
                self.received.add(name)
        return received

    def _trained(self, name: str) -> bool:
        """Whether a gradient reached the watched tensor while attached: its hook fired, or its `.grad` changed."""
        p, _, grad_before = self.watched[name]
        return name in self.received or (p.grad is not None and grad_print(p) != grad_before)

    def step(self, seen) -> None:
        step = seen.step
        if self.found or not self.watched or not (step <= 2 or step % WATCH_EVERY == 0):
            return
        self.compared += 1
        changed = [n for n, (p, before, _) in self.watched.items() if fingerprint(p) != before]
        trained = [n for n in changed if self._trained(n)]
        self.post_processed.update(n for n in changed if n not in trained)
        self.post_processed.difference_update(trained)
        if trained:
            self._found(f"{listed(trained)} changed by step {step} and received gradients, though the DP optimizer "
                        f"does not hold {'them' if len(trained) > 1 else 'it'}: trained on the data without noise or "
                        "clipping", step)

    def _found(self, message: str, step: int) -> None:
        self.found = True
        self.run.report(CODE, f"{DOES_NOT_DESCRIBE}: {message}", step)

    def notes(self) -> list:
        if not self.post_processed:
            return []
        names = sorted(self.post_processed)
        return [(CODE, f"{len(names)} tensor(s) outside the DP optimizer changed without receiving a gradient "
                 f"({listed(names)}): post-processing such as an average of the DP iterates (EMA), not trained on the "
                 "data's gradients")]

    def status(self) -> str:
        if self.run.module is None:
            return "tensors outside the DP optimizer (not compared: no module given)"
        return f"tensors outside the DP optimizer ({len(self.watched)} watched, {self.compared} comparisons)"

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
