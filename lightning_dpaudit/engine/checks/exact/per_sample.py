"""An exact check of the data path: a few real examples' per-sample gradients against plain autograd.

At steps 1, 1 + N, 1 + 2N, ... (N = `every`), for `examples` examples i drawn from the last
batch the model saw before the step (the auditor's own generator chooses them):

    g_i         the gradient the user's loss sent to the model's output for example i
                (read by a tensor hook during the step's first backward pass)
    expected_i  s * d<out_i, g_i>/dtheta, by plain autograd with Opacus's hooks off,
                replaying the model's forward on the same inputs and RNG state (dropout alike):
                on the chosen examples alone when that gives their recorded outputs again, else
                on the whole batch;
                s = the batch size under loss_reduction="mean" (Opacus scales backprops by it), else 1

and compares, for every tensor p the optimizer trains,

    hooks, functorch, ew:  the row of p.grad_sample for example i   with expected_i[p]
    ghost clipping:        p._norm_sample[i], the module's norm      with ||expected_i[p]||
                           the module's clipping coefficient         with min(1, C / (||expected_i|| + 1e-6))

A difference beyond floating-point tolerance is a certainty, not a statistic: finding
`per_sample_gradients`. So is a tensor that autograd gives a gradient and Opacus no
per-sample gradient or norm. Tolerance: relative 1e-3, plus 1e-4 of the example's whole
gradient norm; in mixed precision 4 and 1 unit roundoffs of the lowest precision involved
(the replay runs under the forward's own autocast).
The replay restores the RNG state and the module's buffers: training is unchanged.
Cost: a due step is checked only within `budget` of the run's wall time (budget.py).
Under FSDP (`sharded`) every rank checks its own examples at every due step (the ranks gather
the model's tensors together, so no rank may skip one), replaying the model from its gathered
tensors (sharded_replay.py); there the norms are those Opacus keeps on each module.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, List, Optional

import numpy as np
import torch

from ..base import DATA_PATH, Check, RunView
from .budget import CheckBudget
from .forward_replay import (EPS32, Call, buffer_values, captured, keep_output, own_gradients, precision, replay_forward,
                             same_rows, samples_set_aside, set_buffers, sliced, smallest_module_holding)
from .gradient_comparison import coefficient_problem, tensor_problem
from .sharded_replay import ShardedReplay, module_norms
from .views import expected_for, groupings, why_not as views_refused

RTOL = 1e-3  # relative to the larger of the two norms (4 unit roundoffs of a lower precision, if larger)
DEFAULT_EVERY = 100
DEFAULT_EXAMPLES = 2
DEFAULT_BUDGET = 0.015  # of the run's wall time; the data path's target is 2%
CODE = "per_sample_gradients"


class PerSampleCheck(Check):
    """Compares Opacus's per-sample gradients (or ghost norms) of real examples with plain autograd.

    The run view (attach) gives the tensors, their names, the GradSampleModule and the step count. Its own failure
    stops it alone (`stopped`); under FSDP it still gathers where the other ranks do. It schedules the exact checks'
    steps for the replays that run with it (`due`, `further`: coupling.py's check registers at attach).
    """

    name = "per-sample gradients"
    scope = DATA_PATH
    codes = (CODE, "clipped_sum")

    def __init__(self, *, every: Optional[int] = None, examples: Optional[int] = None, budget: Optional[float] = None):
        """`every`, `examples`, `budget`: as PrivacyAuditor's per_sample_check_* options (None: the auditor's)."""
        self.further: list = []  # replays at a checked step: .replay(step) -> found coupled?; .decline(why): none ran
        self.options = {"every": every, "examples": examples, "budget": budget}
        self.every = every if every is not None else DEFAULT_EVERY
        self.examples = examples if examples is not None else DEFAULT_EXAMPLES
        self.share = budget if budget is not None else DEFAULT_BUDGET
        self.ledger = None  # accumulation.AccumulationLedger, fed at checked steps
        self.replica: Optional[ShardedReplay] = None  # under FSDP: the model run from its gathered tensors
        self.decided = (-1, False)  # (step, whether it is checked): decided once, at its first question
        self.target: Optional[torch.nn.Module] = None
        self.handles: list = []
        self.calls: List[Call] = []
        self.checked = 0  # steps whose examples were compared
        self.view_records = 0  # the views per record, once records of several views were compared (views.py)
        self.eps = EPS32  # the unit roundoff of the lowest precision the last checked step computed in
        self.replays = {"examples": 0, "batch": 0}  # replays of the chosen examples alone, of the whole batch
        self.skipped: Optional[str] = None  # why the last due step could not be compared
        self.stopped: Optional[str] = None  # "stopped at step N: <error>" once its own failure stopped it
        self.ghost = self.sharded = False  # the run's, set in attach (read by the noised step even if attach failed)

    def attach(self, run: RunView) -> None:
        super().attach(run)
        self.module, self.steps = run.gradient_module, run.steps
        self.optimizer, self.params, self.names = run.optimizer, list(run.params), run.names
        self.ghost, self.sharded = run.ghost, run.sharded
        for key, value in self.options.items():  # options left None: the auditor's, else the defaults
            if value is None and run.exact.get(key) is not None:
                setattr(self, {"every": "every", "examples": "examples", "budget": "share"}[key], run.exact[key])
        # the ledger's additions, the replay and the comparison count against it; under FSDP the ranks check together
        self.budget = CheckBudget(1.0 if self.sharded else self.share)
        self.rng = np.random.default_rng(None if run.seed is None else [run.seed, 27])
        self.ledger = run.ledger() if self.every > 0 else None

    def status(self) -> str:
        """One line for the result: what was compared, or why nothing was."""
        steps = self.run.steps()
        if self.every == 0:
            return "off"
        if self.stopped is not None:
            return f"{self.stopped}; compared before that: {self.checked} step(s)"
        if self.checked == 0:
            why = self.skipped or ("no step due yet" if steps < 2 else "no forward pass of the model was seen")
            return f"nothing compared yet ({why})"
        skipped = (f"; {self.budget.skipped} due step(s) skipped to keep the checks within {self.budget.share:.1%} of "
                   "the run's time" if self.budget.skipped else "")
        ranks = "; under FSDP each rank its own examples, from the gathered tensors" if self.sharded else ""
        if self.view_records:
            ranks += f"; records of {self.view_records} views compared per record"
        return (f"{self.checked} step(s) compared, every {self.every} from step 1: per-sample gradients of "
                f"{self.examples} real example(s) against plain autograd, and the clipped sum of each batch{skipped}"
                f"{ranks}")

    # ------------------------------------------------------------------ capture

    def accumulate(self) -> None:
        """At a checked step, the ledger adds the physical batch the optimizer is about to accumulate."""
        if self.ledger is not None and self.due(self.steps()):
            with self.budget.timed():
                try:
                    self.ledger.add()
                except Exception as error:  # the check's own failure never ends training
                    self._stop(error, self.steps())

    def due(self, step: int) -> bool:
        """Step `step` is checked: on the cadence, and (after the first check) within the time budget."""
        if self.every == 0 or self.stopped is not None:
            return False
        if self.decided[0] != step:
            self.decided = (step, self.budget.decide(step % self.every == 1 % self.every, first=not self.checked))
        return self.decided[1]

    def _hook_target(self) -> None:
        gsm = self.module()
        if gsm is None or self.target is not None or self.every == 0:
            return
        self.target = smallest_module_holding(getattr(gsm, "_module", gsm), self.params)
        if self.sharded:
            self.replica = ShardedReplay(getattr(gsm, "_module", gsm))
        self.handles = [
            self.target.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            self.target.register_forward_hook(self._after_forward, with_kwargs=True),
        ]

    def around_step(self, step: int, run_step: Callable[[], None]) -> None:
        """Check at noised step `step` (from 1), then run the audited step (the audit's own work: its forward passes
        not captured)."""
        self.check(step - 1)
        run_step()

    def _before_forward(self, module, args, kwargs):
        if self.run.busy or not self.due(self.steps()) or not (module.training and torch.is_grad_enabled()):
            return None
        call = captured(args, kwargs)
        call.buffers = buffer_values(module)  # a replay starts from them
        self.calls.append(call)
        return None

    def _after_forward(self, module, args, kwargs, output):
        if self.run.busy or not self.calls or self.calls[-1].args is not args:
            return None
        if not keep_output(self.calls[-1], output, self.rng, self.examples):
            self.calls.pop()
        return None

    # ------------------------------------------------------------------ check

    def check(self, step: int) -> None:
        """At a noised step: compare if due, never raising into training (a failure turns the check off)."""
        try:
            self._hook_target()
            if self.stopped is not None and self.replica is not None:
                self._gather_with_the_others(step)
            if not self.due(step):
                return
            with self.budget.timed():
                calls = [c for c in self.calls if c.grads]
                self.calls = []
                try:
                    why_not = None if self.replica is None else self.replica.gather()  # every rank, under FSDP
                    self.skipped = why_not or self.skipped
                    for further in self.further if why_not is not None else ():
                        further.decline(why_not)
                    if why_not is None and calls and not self._replay_further(step):
                        self._compare(calls, step)
                finally:
                    if self.replica is not None:
                        self.replica.release()
                problem = None if self.ledger is None else self.ledger.problem(self.eps)
            self.budget.step_checked()
            if problem is not None:
                self.run.report("clipped_sum", f"{problem} (step {step})", step)
        except Exception as error:  # the check's own failure never ends training; the alarm's is the user's
            if self.run.passes_on(error):
                raise
            self._stop(error, step)

    def meets_the_others(self, step: int) -> bool:
        """Under FSDP, the ranks meet at the cadence's steps (they gather there), whether or not this rank's check
        still runs: a rank missing a meeting would hang the others."""
        return self.sharded and self.every > 0 and step % self.every == 1 % self.every

    def _gather_with_the_others(self, step: int) -> None:
        """A rank whose check stopped still gathers where the others do."""
        if self.meets_the_others(step):
            self.replica.gather()
            self.replica.release()

    def _stop(self, error: Exception, step: int) -> None:
        first_line = (str(error).splitlines() or [""])[0][:200]  # one line: some errors print whole tensors
        self.stopped = f"stopped at step {step + 1}: {type(error).__name__}: {first_line}"  # `step` counts from 0
        warnings.warn(f"the per-sample gradient check {self.stopped}", RuntimeWarning, stacklevel=3)
        self.close()

    def _compare(self, calls: List[Call], step: int) -> None:
        call = calls[-1]
        if len(calls) > 1 and calls[-2].backward == call.backward:
            self.skipped = "the model ran forward more than once before one backward pass"
            return
        held, why = opacus_rows(self.params, call.batch, sum(c.batch for c in calls), ghost=self.ghost,
                                sharded=self.sharded, on_modules=module_norms(self.module()) if self.sharded else {})
        if held is None:
            self.skipped = why
            return
        views = call.batch // held_rows(held, call.batch)
        if views > 1:
            return self._compare_views(call, held, views, step)
        with self._replaying():  # expected[position][tensor]: s * d<out_i, g_i>/dp by plain autograd, hooks off
            expected = self._expected(call, self.module())
        gsm = self.module()
        C = float(self.optimizer.max_grad_norm)
        self.eps = precision([*call.outputs.values(), *held], [dtype for _, dtype in call.autocast])
        rtol = max(RTOL, 4 * self.eps)
        self.checked += 1
        for position, i in enumerate(call.chosen):
            grads = expected[position]
            total = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)))
            problem = tensor_problem(self.names, held, int(i), grads, total, rtol, self.eps, self.ghost)
            if problem is None and self.ghost:
                problem = coefficient_problem(gsm, int(i), total, C, rtol)
            if problem is not None:
                self.run.report(CODE, f"{problem} at step {step} (example {int(i)} of the batch)", step)
                return

    def _compare_views(self, call: Call, held: list, views: int, step: int) -> None:
        """Records of `views` views each (views.py): the chosen example's record under each grouping tried."""
        records = call.batch // views
        self.skipped = views_refused(call, records, self.ghost)
        if self.skipped is not None:
            return
        scale = float(call.batch) if getattr(self.module(), "loss_reduction", "mean") == "mean" else 1.0
        self.eps = precision([*call.outputs.values(), *[h for h in held if h is not None]],
                             [dtype for _, dtype in call.autocast])
        wanted = [p for p in self.params if p.requires_grad]
        with self._replaying():
            leaves = self._forward(call, call.args, call.kwargs)
            for _, record, rows in groupings(int(call.chosen[0]), records, views):
                found = dict(zip(map(id, wanted), expected_for(leaves, call.full_grads, rows, wanted, scale, views)))
                grads = [found.get(id(p)) for p in self.params]
                total = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)))
                if tensor_problem(self.names, held, record, grads, total, max(RTOL, 4 * self.eps), self.eps,
                                  False) is None:
                    self.checked += 1
                    self.view_records = views
                    return
        self.skipped = (f"records of {views} views: neither consecutive views nor view blocks give Opacus's rows at "
                        f"step {step + 1}, so nothing was compared (the views are grouped another way)")

    def _replay_further(self, step: int) -> bool:
        """The further replays (checks/run/coupling.py), hooks off; True if the examples are coupled (nothing to compare)."""
        if not self.further:
            return False
        with self._replaying():
            coupled = [self._further_replay(further, step) for further in tuple(self.further)]
        if any(coupled):
            self.skipped = "the examples are coupled (run checks): no example has a gradient of its own"
        return any(coupled)

    def _further_replay(self, further, step: int) -> bool:
        """One further replay; its own failure stops that check alone (the runner's stop)."""
        try:
            return bool(further.replay(step))
        except Exception as error:
            if self.run.passes_on(error):
                raise
            self.further.remove(further)
            self.run.stop(further, error)
            return False

    @contextlib.contextmanager
    def _replaying(self):
        """Opacus's hooks off and nothing captured while the check runs the model; the buffers put back after."""
        gsm = self.module()
        was_enabled = getattr(gsm, "hooks_enabled", False)
        buffers = buffer_values(self.target)
        try:
            if was_enabled:
                gsm.disable_hooks()
            # Opacus's switched-off backward hooks still fire here; torch's warning about them at this package's
            # lines is filtered once, at import (forward_replay.py)
            with self.run.own_work(), samples_set_aside(self.params), (
                    self.replica.plain() if self.replica else contextlib.nullcontext()):
                yield
        finally:
            if was_enabled:
                gsm.enable_hooks()
            set_buffers(self.target, buffers)

    def _expected(self, call: Call, gsm) -> list:
        """The replay, then one backward pass per chosen example, scaled as Opacus scales its backprops."""
        leaves, index = self._replay(call)
        scale = float(call.batch) if getattr(gsm, "loss_reduction", "mean") == "mean" else 1.0
        wanted = [p for p in self.params if p.requires_grad]
        differentiated = [p if self.replica is None else self.replica.leaf(p) for p in wanted]
        expected = []
        for position, i in enumerate(index):
            own = own_gradients(leaves, int(i), {j: g[position] for j, g in call.grads.items()})
            inner = sum((leaves[j][int(i)] * g).sum() for j, g in own.items())
            last = position == len(call.chosen) - 1
            grads = dict(zip(map(id, wanted), torch.autograd.grad(inner, differentiated, retain_graph=not last,
                                                                    allow_unused=True)))
            expected.append([None if grads.get(id(p)) is None else scale * grads[id(p)] for p in self.params])
        return expected

    def _replay(self, call: Call):
        """(output leaves, the chosen examples' rows in them): the chosen examples alone when that reproduces
        their outputs (a forward pass that is per-example and draws no randomness), else the whole batch."""
        alone = sliced((call.args, call.kwargs), call.chosen, call.batch)
        if alone is not None:
            try:
                leaves = self._forward(call, *alone)
                if all(j < len(leaves) and same_rows(leaves[j], rows) for j, rows in call.outputs.items()):
                    self.replays["examples"] += 1
                    return leaves, range(len(call.chosen))
            except Exception:  # a forward pass that refuses a smaller batch: replay the whole batch
                pass
        self.replays["batch"] += 1
        return self._forward(call, call.args, call.kwargs), call.chosen

    def _forward(self, call: Call, args, kwargs) -> list:
        """The target's forward pass from the call's state: its RNG states, and its buffers as they were before it."""
        set_buffers(self.target, call.buffers)
        return replay_forward(self.target, call, args, kwargs)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.calls = [], []


def held_rows(held: list, batch: int) -> int:
    """The rows Opacus holds per tensor for the last batch (`batch` when it holds none)."""
    return next((int(h.shape[0]) for h in held if h is not None), batch)


def opacus_rows(params, batch: int, stacked: int, *, ghost: bool, sharded: bool, on_modules: dict):
    """(held, None): what Opacus holds per tensor for the last batch, held[t][i] example i's entry (ghost clipping:
    norms; under FSDP the modules' `on_modules`); rows for records of several views as they are (views.py).
    (None, why) when the rows cannot be matched to the batch's examples."""
    held = []
    for p in params:
        if ghost:
            norms = on_modules.get(id(p)) if sharded else getattr(p, "_norm_sample", None)
            if norms is not None and norms.shape[0] != batch:
                return None, f"the per-sample norms hold {norms.shape[0]} rows, the last batch {batch}"
            held.append(norms)
            continue
        samples = getattr(p, "grad_sample", None)
        if isinstance(samples, list):
            samples = torch.cat(samples, dim=0)
        if samples is not None:
            rows = samples.shape[0]
            several_views = not sharded and 0 < rows < batch and batch % rows == 0  # views.py
            if rows not in (batch, stacked) and not several_views:
                return None, f"the per-sample gradients hold {rows} rows, the last batch {batch}"
            if several_views and any(h is not None and h.shape[0] != rows for h in held):
                return None, "the per-sample gradients of the tensors hold different numbers of rows"
            if not several_views:
                samples = samples[samples.shape[0] - batch:]
        held.append(samples)
    return held, None
