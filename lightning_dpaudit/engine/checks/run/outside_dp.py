"""Everything trained is private: no tensor of the module learns from the data outside the DP optimizer.

optimizers   a tensor held by another optimizer of the run (the Trainer's other optimizers, or
             `other_optimizers=`): inside the model the private batch runs through (Opacus's
             GradSampleModule), or outside the module given (a loss's own temperature), trained
             without noise: certain at attach, finding `outside_dp`. A tensor of the module beside that
             model (a generator beside a DP discriminator) is watched as below, and trained on the
             data only if its gradients come from the data.
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
data         on the compared steps (from the loader's batch to the next), data_taint.py marks what is
             computed from the private batch: a watched tensor that received a gradient from a backward
             pass of the data's is certain (`outside_dp`); one whose gradients there all came from
             backward passes that start elsewhere (a generator through a DP discriminator's output) is
             trained by post-processing of DP outputs: a note. Without batches seen (no loader watched),
             any gradient counts as the data's.
buffers      buffers the forward pass updates from the examples (running statistics) are found by
             the exact checks' replay (coupling.py).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ...release.ghost import grad_sample_module_in
from .base import DOES_NOT_DESCRIBE, RunCheck
from .data_taint import DataTaint

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


def compared_at(step: int) -> bool:
    """Whether the watched tensors are compared at `step` (and its batch traced): steps 1, 2, every WATCH_EVERY."""
    return step <= 2 or step % WATCH_EVERY == 0


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
        self.from_data: set = set()  # watched tensors a backward pass of the data's reached (traced steps)
        self.elsewhere: set = set()  # watched tensors a backward pass not of the data's reached (traced steps)
        self.taint, self.batches_traced, self.traced_step = DataTaint(), 0, 0
        self.handles: list = []

    def attach(self, run) -> None:
        super().attach(run)
        module = run.module
        covered = {id(p) for p in run.params}
        module = getattr(module, "_module", module)  # a GradSampleModule's tensors by the model's own names
        named = [] if module is None else [(n, p) for n, p in module.named_parameters() if id(p) not in covered]
        names = {id(p): n for n, p in named}
        gsm = None if module is None else grad_sample_module_in(module, run.params)
        gsm = getattr(gsm, "_module", gsm)  # the model Opacus wraps or hooks (GradSampleHooks: not a module itself)
        data_model = None if gsm is None else {id(p) for p in gsm.parameters()}  # None: every tensor counts as in it
        others = []
        for optimizer in run.other_optimizers:  # every tensor they hold, the module's or not (a loss's own, ...)
            held = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in covered]
            # certain: in the model the batch runs through, or outside the module given (nothing tells what trains
            # it); the module's other tensors (a generator beside a DP discriminator) are watched below
            inside = [p for p in held if data_model is None or id(p) in data_model or id(p) not in names]
            if inside:
                others.append((type(optimizer).__name__, [names.get(id(p), f"a tensor of shape {tuple(p.shape)}")
                                                          for p in inside]))
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
                if self.taint.active:
                    (self.from_data if self.taint.from_data else self.elsewhere).add(name)
        return received

    def batch(self, batch) -> None:
        """Trace what is computed from the batch of a compared step (data_taint.py), up to the next batch."""
        coming = self.run.steps() + 1
        if self.watched and not self.found and compared_at(coming):
            self.taint.start(batch.tensors)
            self.batches_traced, self.traced_step = self.batches_traced + 1, coming
        else:
            self.taint.stop()

    def _trained(self, name: str) -> bool:
        """Whether the data's gradient reached the watched tensor while attached: a backward pass of the data's
        did, or (no batch traced) its hook fired or its `.grad` changed."""
        if name in self.from_data:
            return True
        if self.batches_traced and name in self.elsewhere:
            return False  # gradients, but none the data's where traced: post-processing of DP outputs
        p, _, grad_before = self.watched[name]
        return name in self.received or (p.grad is not None and grad_print(p) != grad_before)

    def step(self, seen) -> None:
        step = seen.step
        if step > self.traced_step:  # a later step than the one traced: nothing more to trace (no batch came)
            self.taint.stop()
        if self.found or not self.watched or not compared_at(step):
            return
        self.compared += 1
        changed = [n for n, (p, before, _) in self.watched.items() if fingerprint(p) != before]
        trained = [n for n in changed if self._trained(n)]
        self.post_processed.update(n for n in changed if n not in trained)
        self.post_processed.difference_update(trained)
        if trained:
            self.taint.stop()
            self._found(f"{listed(trained)} changed by step {step} and received gradients, though the DP optimizer "
                        f"does not hold {'them' if len(trained) > 1 else 'it'}: trained on the data without noise or "
                        "clipping", step)

    def _found(self, message: str, step: int) -> None:
        self.found = True
        self.run.report(CODE, f"{DOES_NOT_DESCRIBE}: {message}", step)

    def notes(self) -> list:
        if not self.post_processed:
            return []
        through = sorted(n for n in self.post_processed if n in self.elsewhere)
        computed = sorted(n for n in self.post_processed if n not in self.elsewhere)
        said = [] if not computed else [(CODE, (
            f"{len(computed)} tensor(s) outside the DP optimizer changed without receiving a gradient "
            f"({listed(computed)}): post-processing such as an average of the DP iterates (EMA), not trained on the "
            "data's gradients"))]
        return said + ([] if not through else [(CODE, (
            f"{len(through)} tensor(s) outside the DP optimizer changed by gradients whose backward passes never "
            f"started from the private batch ({listed(through)}; traced on {self.batches_traced} steps): trained "
            "through the DP model's outputs alone, such as a generator through a DP discriminator: post-processing"))])

    def status(self) -> str:
        if self.run.module is None:
            return "tensors outside the DP optimizer (not compared: no module given)"
        return f"tensors outside the DP optimizer ({len(self.watched)} watched, {self.compared} comparisons)"

    def close(self) -> None:
        self.taint.stop()
        for handle in self.handles:
            handle.remove()
        self.handles = []
