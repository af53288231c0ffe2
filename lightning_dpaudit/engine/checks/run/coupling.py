"""Independence: does a checked example's gradient depend on the batch's other examples?

At the exact checks' steps (checks/exact/per_sample.py), for a few examples i of the batch, the real
step is replayed from the state it started in (torch's RNG, and numpy's and Python's for
a training step; the module's buffers as they were before the forward pass):

    control    the batch as it was: it must give example i's recorded output (and, with a
               training step, the gradient the loss sent to it); else the step cannot be replayed
               exactly and the check says so and compares nothing
    replaced   every other example replaced by another real example of the batch (drawn with
               replacement by the audit's own generator), then all of them by one same other
               example; example i kept in its place

Example i's output changing is a certainty that its gradient depends on other records, and
per-example clipping then bounds nothing about one record: finding `coupled_examples`, naming
where it arises: the first module of the forward pass whose output row for i changes while the
rows it was given did not; or what the training step does to the batch before the model (its
output changes only when the training step runs); or the loss (the output is unchanged, the
gradient the loss sends to it is not). The training step is the LightningModule's own
`training_step` under Lightning, `training_loss(batch)` in a plain loop; without either the
check covers the forward pass.

The replayed forward also shows buffers updated from the examples (running statistics): a
buffer whose value after the replaced forward differs from its value after the real one is
learned from the data outside DP-SGD: finding `outside_dp`.
Training is unchanged: the RNG states are forked, the buffers put back, Opacus's hooks off.
"""

from __future__ import annotations

import random
from typing import Callable, Optional

import numpy as np
import torch

from ..exact.forward_replay import (
    autocast_regions,
    buffer_values,
    captured,
    keep_output,
    replay_forward,
    same_rows,
    samples_set_aside,
    set_buffers,
    smallest_module_holding,
    tensors,
)
from .base import DOES_NOT_DESCRIBE, RunCheck, records_in
from .outside_dp import CODE as OUTSIDE_DP, listed

CODE = "coupled_examples"


def replacements(keep: np.ndarray, batch: int, rng: np.random.Generator) -> list:
    """Index arrays `source` (row r of the replaced batch is row source[r] of the real one): the rows in `keep` stay,
    every other row becomes another real example of the batch, drawn with replacement; then every other row becomes
    one same other example (statistics over the batch, class counts, a loss's ranking moved as far as the batch
    allows). Empty when fewer than 2 rows are not kept."""
    others = np.setdiff1d(np.arange(batch), keep)
    if len(others) < 2:
        return []
    drawn, single = np.arange(batch), np.arange(batch)
    drawn[others] = rng.choice(others, size=len(others), replace=True)
    if np.array_equal(drawn[others], others):
        drawn[others] = np.roll(others, 1)
    single[others] = rng.choice(others)
    return [drawn, single]


def reindexed(value, source: np.ndarray, batch: int):
    """`value` with every tensor whose leading size is `batch` re-indexed by `source` (nested tuples, lists, dicts)."""
    def walk(v):
        if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == batch:
            return v[torch.as_tensor(source, device=v.device)]
        if isinstance(v, (tuple, list)):
            return type(v)(walk(x) for x in v)
        if isinstance(v, dict):
            return type(v)({k: walk(x) for k, x in v.items()}) if type(v) is dict else {k: walk(x) for k, x in v.items()}
        return v

    return walk(value)


class ModuleRows:
    """Forward hooks on every submodule keeping, in the order they finish, the chosen rows of their first batched
    output and whether the chosen rows of their batched inputs were kept."""

    def __init__(self, target: torch.nn.Module, rows: torch.Tensor, batch: int):
        self.rows, self.batch, self.seen = rows, batch, []
        self.handles = [m.register_forward_hook(self._keep(name), with_kwargs=True)
                        for name, m in target.named_modules() if name]

    def _keep(self, name):
        def hook(module, args, kwargs, output):
            outs = [t for t in tensors(output) if t.dim() > 0 and t.shape[0] == self.batch]
            ins = [t for t in tensors((args, kwargs)) if t.dim() > 0 and t.shape[0] == self.batch]
            if outs:
                self.seen.append((name, [t.detach()[self.rows].clone() for t in ins], outs[0].detach()[self.rows].clone()))
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _synchronising(module: torch.nn.Module) -> bool:
    """A data-parallel wrapper whose forward pass talks to the other ranks (DDP, Opacus's DPDDP)."""
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel

    return isinstance(module, (torch.nn.parallel.DistributedDataParallel, DifferentiallyPrivateDistributedDataParallel))


def origin(control: list, changed: list) -> Optional[str]:
    """The first module whose output rows differ between the two replays while its input rows did not."""
    for (name, ins_a, out_a), (name_b, ins_b, out_b) in zip(control, changed):
        if name != name_b:
            return None
        same_in = len(ins_a) == len(ins_b) and all(same_rows(b, a) for a, b in zip(ins_a, ins_b))
        if same_in and not same_rows(out_b, out_a):
            return name
    return None


class CouplingCheck(RunCheck):
    """Replays at the exact checks' steps: `schedule.due(step)` (per_sample_check.PerSampleCheck) says which; the
    exact check runs the replays (`replay`) with Opacus's hooks off, within its time budget."""

    name = "independence of examples"
    codes = (CODE, OUTSIDE_DP)

    def __init__(self, training_loss: Optional[Callable] = None, examples: int = 2, *, schedule=None):
        self.schedule = schedule
        self.closed = False
        self.training_loss = training_loss  # plain loop: batch -> the step's loss
        self.examples = examples
        self.step_fn: Optional[Callable] = None  # this batch's training step (Lightning's training_step), if any
        self.last_batch = None
        self.states = None  # (torch, numpy, python) RNG states at the last batch's delivery, at a checked step
        self.call = None  # the model's last forward pass at a checked step (forward_replay.Call)
        self.step_buffers = None  # the trained module's buffers when the last batch was delivered, at a checked step
        self.root: Optional[torch.nn.Module] = None
        self.handles: list = []
        self.compared = 0  # forward replays with the others replaced
        self.stepped = 0  # training-step replays with the others replaced
        self.skipped: Optional[str] = None
        self.found = set()

    def attach(self, run) -> None:
        super().attach(run)
        self.rng = np.random.default_rng(None if run.seed is None else [run.seed, 35])
        if self.training_loss is None:
            self.training_loss = run.training_loss
        if self.schedule is not None:
            self.schedule.further.append(self)

    def due(self) -> bool:
        return self.schedule is not None and self.schedule.due(self.run.steps())

    def _watch_model(self) -> None:
        if not self.handles:  # hooked once, when the model is first known
            model = self.run.gradient_module()
            self.watch(getattr(model, "_module", model))

    def step(self, seen) -> None:
        if not self.handles:
            self._watch_model()

    def watch(self, root: Optional[torch.nn.Module]) -> None:
        """Hook the model's forward pass (once): at a checked step, keep what a replay needs. The model's forward pass
        is that of the outermost module that runs among those holding every trained tensor (the root, or the
        model inside a LightningModule whose own forward never runs)."""
        if root is None or self.handles or self.closed:
            return
        self.depth = 0
        target = smallest_module_holding(root, self.run.params)
        name = next(n for n, m in root.named_modules() if m is target)
        chain = [m for outer, m in root.named_modules() if outer == "" or name == outer or name.startswith(outer + ".")]
        wrappers = [i for i, m in enumerate(chain) if _synchronising(m)]
        for module in chain[wrappers[-1] + 1 if wrappers else 0:]:  # a replay never runs a wrapper's collectives
            self.handles += [module.register_forward_pre_hook(self._before, with_kwargs=True),
                             module.register_forward_hook(self._after, with_kwargs=True)]

    def _before(self, module, args, kwargs):
        self.depth += 1
        if self.depth > 1 or self.run.busy or not (module.training and torch.is_grad_enabled()) or not self.due():
            return None
        self.call, self.root = captured(args, kwargs), module
        self.call.buffers = buffer_values(module)
        return None

    def _after(self, module, args, kwargs, output):
        self.depth = max(0, self.depth - 1)
        call = self.call
        if self.run.busy or call is None or module is not self.root or call.args is not args or call.chosen is not None:
            return None
        if not keep_output(call, output, self.rng, self.examples):
            self.call = None
        return None

    def batch(self, batch) -> None:
        """Keep the batch (a reference) and, at a checked step, the RNG states its training step starts from."""
        if not self.handles:
            self._watch_model()
        self.last_batch, self.step_fn, due = batch.value, batch.step_fn, self.due()
        self.states = (torch.get_rng_state(), np.random.get_state(), random.getstate()) if due else None
        self.step_buffers = buffer_values(self._step_module()) if due else None

    def _step_module(self) -> torch.nn.Module:
        """The module whose buffers a training step may update: the module trained (the LightningModule), else the
        model whose forward pass is hooked."""
        module = self.run.module if self.run.module is not None else self.root
        return getattr(module, "_module", module) if module is not None else torch.nn.Module()

    # ------------------------------------------------------------------ the replays

    def replay(self, step: int) -> bool:
        """At a checked step (Opacus's hooks off): the control and the replaced replays; True if the examples are
        found coupled."""
        call, self.call = self.call, None
        if self.closed or call is None or not call.grads or len(self.found) == 2:
            return False
        target, keep = self.root, np.asarray(call.chosen)
        rows = torch.as_tensor(keep, device=next(iter(call.outputs.values())).device)
        pre, post = call.buffers, buffer_values(target)
        sources = replacements(keep, call.batch, self.rng)
        if not sources:
            self.skipped = f"a batch of {call.batch} example(s) has no others to replace"
            return False
        try:
            control = self._forward(call, (call.args, call.kwargs), pre, rows)
            if not all(j < len(control[0]) and same_rows(control[0][j][rows], out) for j, out in call.outputs.items()):
                self.skipped = "a replay of the batch as it was does not give the recorded outputs"
                return False
            self.compared += 1
            for source in sources:
                changed = self._forward(call, reindexed((call.args, call.kwargs), source, call.batch), pre, rows)
                self._buffers(target, post, control[2], changed[2], step)
                moved = [j for j, out in call.outputs.items()
                         if j >= len(changed[0]) or not same_rows(changed[0][j][rows], out)]
                if moved:
                    where = origin(control[1], changed[1])
                    place = f"in `{where}` of the forward pass" if where else "in the forward pass"
                    return self._found(f"example {int(keep[0])}'s output changes when the batch's other examples are "
                                       f"replaced, {place}: its gradient depends on other records (statistics over "
                                       "the batch, inputs mixed across it), so clipping it bounds nothing about one "
                                       "record", step)
        finally:
            set_buffers(target, post)
        return self._training_step(call, target, rows, step, sources)  # from the buffers as the real step left them

    def _forward(self, call, inputs, pre, rows):
        """(output leaves, module rows, buffers after) of one forward pass of the hooked model from the buffers `pre`."""
        target = self.root
        set_buffers(target, pre)
        recorder = ModuleRows(target, rows, call.batch)
        try:
            leaves = replay_forward(target, call, *inputs)
        finally:
            recorder.close()
        return leaves, recorder.seen, buffer_values(target)

    def _buffers(self, target, post, control, changed, step) -> None:
        names = [n for n, _ in target.named_buffers()]
        learned = [n for n, a, b, after in zip(names, control, changed, post)
                   if a.is_floating_point() and same_rows(a, after) and not same_rows(b, a)]
        if learned and OUTSIDE_DP not in self.found:
            self.found.add(OUTSIDE_DP)
            self.run.report(OUTSIDE_DP, f"{DOES_NOT_DESCRIBE}: the buffer(s) {listed(learned)} are updated from the "
                                  "examples in training (running statistics) and released with the model without noise",
                                  step)

    def _training_step(self, call, target, rows, step, sources) -> bool:
        step_fn = self.step_fn if self.step_fn is not None else self.training_loss
        if step_fn is None or self.states is None or self.last_batch is None:
            return False
        if records_in(self.last_batch) != call.batch:
            self.skipped = "the model's batch is not the loader's (its rows cannot be matched to records)"
            return False
        module = self._step_module()
        post = buffer_values(module)
        try:
            control = self._step(step_fn, self.last_batch, target, rows, call, module)
            if control is None or not self._matches(control[:2], call.outputs, call.grads):
                self.skipped = self.skipped or "a replay of the training step does not give the recorded outputs and gradients"
                return False
            steps = [self._step(step_fn, reindexed(self.last_batch, source, call.batch), target, rows, call, module)
                     for source in sources]
        finally:
            set_buffers(module, post)
        self.stepped += 1
        where = None
        for changed in steps:
            if changed is None:
                continue
            self._buffers(module, post, control[2], changed[2], step)
            outputs, grads, _ = changed
            if not all(j in outputs and same_rows(outputs[j], out) for j, out in call.outputs.items()):
                where = "what the training step does to the batch before the model"
            elif not all(j in grads and same_rows(grads[j], g) for j, g in call.grads.items()):
                where = "the loss"
            if where is not None:
                break
        if where is None:
            return False
        return self._found(f"example {int(call.chosen[0])}'s gradient changes when the batch's other examples are replaced; "
                    f"it arises in {where}: per-example clipping then bounds nothing about one record", step)

    def _step(self, step_fn, batch, target, rows, call, module):
        """`_replayed_step` with the step's per-sample gradients set aside (expanded weights write them again)."""
        with samples_set_aside(self.run.params):
            return self._replayed_step(step_fn, batch, target, rows, call, module)

    def _replayed_step(self, step_fn, batch, target, rows, call, module):
        """({leaf: chosen output rows}, {leaf: chosen rows of the loss's gradient}, `module`'s buffers after) of one
        training step, from the states it started in; None if it gives no loss."""
        torch_state, numpy_state, python_state = self.states
        captured = []
        handle = target.register_forward_hook(lambda m, a, out: captured.append(out) if not captured else None)
        set_buffers(module, self.step_buffers)
        numpy_now, python_now = np.random.get_state(), random.getstate()
        try:
            with torch.random.fork_rng(devices=[]), torch.enable_grad(), autocast_regions(call):  # the step's precision
                torch.set_rng_state(torch_state)
                np.random.set_state(numpy_state)
                random.setstate(python_state)
                loss = step_fn(batch)
        finally:
            handle.remove()
            np.random.set_state(numpy_now)
            random.setstate(python_now)
        if isinstance(loss, dict):
            loss = loss.get("loss")
        if not torch.is_tensor(loss) or not captured:
            return None
        leaves = [t for t in tensors(captured[0]) if t.requires_grad and t.dim() > 0]
        wanted = {j: leaves[j] for j in call.outputs if j < len(leaves)}
        grads = torch.autograd.grad(loss, list(wanted.values()), allow_unused=True)
        outs = {j: leaf.detach()[rows] for j, leaf in wanted.items()}
        got = {j: (torch.zeros_like(leaf[rows]) if g is None else g.detach()[rows]) for (j, leaf), g in zip(wanted.items(), grads)}
        return outs, got, buffer_values(module)

    @staticmethod
    def _matches(result, outputs, grads) -> bool:  # result: (outputs, gradients) of a replayed training step
        outs, got = result
        return (all(j in outs and same_rows(outs[j], o) for j, o in outputs.items())
                and all(j in got and same_rows(got[j], g) for j, g in grads.items()))

    def _found(self, message: str, step: int) -> bool:
        if CODE not in self.found:
            self.found.add(CODE)
            self.run.report(CODE, f"{DOES_NOT_DESCRIBE}: {message}", step)
        return True

    def close(self) -> None:
        self.closed = True
        for h in self.handles:
            h.remove()
        self.handles, self.call = [], None

    def decline(self, reason: str) -> None:
        """The exact check replayed nothing at a due step, for `reason`: so neither did this check."""
        self.skipped = self.skipped or f"the exact checks replayed nothing: {reason}"

    def status(self) -> str:
        """Counted from what ran: forward replays, and of those the ones through the training step."""
        if not self.compared:
            return f"independence of examples (nothing compared yet{': ' + self.skipped if self.skipped else ''})"
        if self.step_fn is None and self.training_loss is None and not self.stepped:
            return f"independence of examples ({self.compared} replays with the others replaced, through the forward pass)"
        if self.stepped == self.compared:
            return f"independence of examples ({self.compared} replays with the others replaced, through the training step)"
        step = (f", {self.stepped} of them through the training step" if self.stepped else
                ", none through the training step")
        why = f" ({self.skipped})" if self.skipped and self.stepped < self.compared else ""
        return f"independence of examples ({self.compared} replays with the others replaced{step}{why})"
