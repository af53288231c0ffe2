"""The runner: calls each hook on the checks that implement it, and keeps one check's fault its own.

Dispatch. Each hook has the list of the checks whose class overrides it (base.overrides), made
once: a step calls nothing for a check with nothing to do there. `around_step` wrappers nest in
the order the checks were given (the first outermost); the noised step inside them runs as the
audit's own work (RunView.own_work).

Faults. A check that raises (not the alarm's own error, which is passed on) is stopped alone: it
leaves every hook list, its close() runs, its status reads "stopped at step N: <error>" and
`stopped` names it; the other checks and training go on. An around_step wrapper that raised before
running the step has the step run for it; one that raised after, not again.

What the step was made of (StepSeen) is counted here once for every check: the records of the
batches delivered since the last noised step, and the rows the optimizer clipped (its accumulate,
patched on the instance while any check is attached).
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional, Sequence

from ..support.instance_patch import InstancePatch
from .base import HOOKS, PIPELINE, RUN_HOOKS, SCOPES, Batch, Check, RunView, StepSeen, overrides


class CheckStoppedWarning(RuntimeWarning):
    """A check of the audit raised and was stopped; the other checks and training go on."""


def check_checks(checks) -> list:
    """The checks as a list, each a Check with a known scope; a ValueError naming the first that is not."""
    if isinstance(checks, Check) or not isinstance(checks, (list, tuple)):
        raise ValueError(f"Unexpected value for `checks`: {checks!r}; pass a list of Check objects "
                         "(lightning_dpaudit.default_checks(...) gives the defaults)")
    for check in checks:
        if not isinstance(check, Check):
            raise ValueError(f"Unexpected value in `checks`: {check!r}; each check is an instance of a subclass of "
                             "lightning_dpaudit.Check")
        if check.scope not in SCOPES:
            raise ValueError(f"Unexpected value for {type(check).__name__}.scope: {check.scope!r}; one of {SCOPES}")
    return list(checks)


def first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


class CheckRunner:
    """Runs `checks` against the run `run`; `passes_on(error)`: an error to raise on (the alarm's), not a fault.
    `rows(params, gradient_module)` counts the rows of a physical batch; `accumulate_method` is the optimizer's
    method that folds one in ("clip_and_accumulate", or "accumulate" under ghost clipping)."""

    def __init__(self, checks: Sequence[Check], run: RunView, *, passes_on: Callable[[BaseException], bool],
                 rows: Callable, accumulate_method: str):
        self.checks = check_checks(checks)
        self.run, self.passes_on, self.rows = run, passes_on, rows
        self.hooks = {hook: [c for c in self.checks if overrides(c, hook)] for hook in HOOKS}
        # the bound methods each hook calls, in order (looked up once: the step's dispatch is a loop of calls)
        self.calls = {hook: [(c, getattr(c, hook)) for c in checks] for hook, checks in self.hooks.items()}
        run.stop = self.stop
        self.counting = bool(self.hooks["step"])  # records and rows are counted for the checks' step hook
        self.records: Optional[int] = 0
        self.fed = False
        self.clipped = 0
        self.hook, self.around_at = "attach", 0  # the hook being dispatched: a stop is dated by the step it serves
        self._patch: Optional[InstancePatch] = None
        if self.counting or self.hooks["accumulate"]:
            self._patch = InstancePatch(run.optimizer, accumulate_method, self._accumulate)

    # ------------------------------------------------------------------ dispatch

    def call(self, check: Check, hook: str, *args):
        """`check.<hook>(*args)`, a fault stopping the check alone (None then)."""
        self.hook = hook
        try:
            return getattr(check, hook)(*args)
        except Exception as error:
            self._fault(check, error)
            return None

    def _each(self, hook: str, *args) -> None:
        self.hook = hook  # a stop is dated by the step the hook serves
        for check, method in tuple(self.calls[hook]):
            try:
                method(*args)
            except Exception as error:
                self._fault(check, error)

    def attach(self) -> None:
        for check in tuple(self.checks):
            self.call(check, "attach", self.run)
        for check in self.checks:  # nothing to do in this run (replicas on one process, ...): out of the run's hooks
            if check.idle and check.stopped is None:
                self._leave(check, RUN_HOOKS)
        self.counting = bool(self.hooks["step"])

    def loader(self, loader) -> None:
        self._each("loader", loader)

    def batch(self, value, step_fn: Optional[Callable] = None) -> None:
        """A batch the loader delivered for the coming step; `step_fn(batch)` replays its training step's loss."""
        batch = Batch(value, step_fn)
        if self.counting:
            self.fed = True
            records = batch.records
            self.records = None if records is None or self.records is None else self.records + records
        self._each("batch", batch)

    def _accumulate(self, *args, **kwargs):
        if not self.run.busy:
            if self.counting:
                try:
                    self.clipped += self.rows(self.run.params, self.run.gradient_module) or 0
                except Exception:  # an unreadable layout counts nothing; the rows check then compares nothing
                    pass
            self._each("accumulate")
        return self._patch.original(*args, **kwargs)

    def step(self, step: int) -> None:
        """A noised step (from 1), before its canaries: the step hooks, when a check has one."""
        if self.calls["step"]:
            seen = StepSeen(step, self.records, self.clipped, self.fed)
            self.records, self.clipped = 0, 0
            self._each("step", seen)
        else:
            self.records, self.clipped = 0, 0

    def around_step(self, step: int, run_step: Callable[[], None]) -> None:
        """`run_step` (the audited step) inside every around_step wrapper, as the audit's own work."""
        self.hook, self.around_at, run = "around_step", step, self.run

        def own():
            run.busy += 1  # RunView.own_work, without a generator on the hot path
            try:
                run_step()
            finally:
                run.busy -= 1
        wrappers = self.hooks["around_step"]
        if wrappers:
            self._nest(tuple(wrappers), step, own)
        else:
            own()

    def _nest(self, wrappers: tuple, step: int, run_step: Callable[[], None]) -> None:
        if not wrappers:
            return run_step()
        check, inner = wrappers[0], wrappers[1:]
        ran, raised = False, []

        def rest():
            nonlocal ran
            if ran:
                raise RuntimeError(f"{type(check).__name__}.around_step ran the step twice")
            ran = True
            try:
                if inner:
                    self._nest(inner, step, run_step)
                else:  # the innermost wrapper runs the step itself
                    run_step()
            except BaseException as error:
                raised.append(error)
                raise

        try:
            check.around_step(step, rest)
        except Exception as error:
            if raised and error is raised[0]:
                raise
            self._fault(check, error)
        if raised:  # the step's own error, swallowed by the wrapper: passed on all the same
            raise raised[0]
        if not ran:
            if check.stopped is None:
                self.stop(check, RuntimeError("around_step returned without running the step"))
            self._nest(inner, step, run_step)

    # ------------------------------------------------------------------ faults

    def _fault(self, check: Check, error: Exception) -> None:
        """What `check` raised: passed on when it is the alarm's own, else the check is stopped."""
        if self.passes_on(error):
            raise error
        self.stop(check, error)

    def stop(self, check: Check, error: BaseException) -> None:
        """Stop `check` alone: out of every hook, closed, its status and the result saying so."""
        if check.stopped is not None:
            return
        if self.hook == "around_step":
            step = self.around_at
        else:  # a batch, an accumulation or a step hook serves the step not yet counted
            step = self.run.steps() + (self.hook in ("batch", "accumulate", "step"))
        check.stopped = f"stopped at step {step}: {first_line(error)}"
        self._leave(check, HOOKS)
        try:
            check.close()
        except Exception:
            pass
        warnings.warn(f"the audit's check `{check.name}` {check.stopped}; the other checks and training go on",
                      CheckStoppedWarning, stacklevel=3)

    def _leave(self, check: Check, hooks: Sequence[str]) -> None:
        """`check` out of the lists of `hooks`."""
        for hook in hooks:
            if check in self.hooks[hook]:
                self.hooks[hook].remove(check)
                self.calls[hook] = [(c, m) for c, m in self.calls[hook] if c is not check]

    # ------------------------------------------------------------------ what ran

    def status(self, scope: str = PIPELINE) -> str:
        """One line per check of `scope`, joined: what it did, or that it stopped and when."""
        return "; ".join(filter(None, (self._status(c) for c in self.checks if c.scope == scope)))

    def _status(self, check: Check) -> str:
        """The check's own line (which may say it stopped itself), or the runner's when it stopped it."""
        line = self.call(check, "status") if check in self.hooks["status"] else ""
        return line or (f"{check.name} ({check.stopped})" if check.stopped is not None else "")

    def find(self, kind: type) -> Optional[Check]:
        """The first check of class `kind` this runner runs, or None."""
        return next((c for c in self.checks if isinstance(c, kind)), None)

    def stopped_checks(self) -> tuple:
        """(name, "stopped at step N: <error>") of every check stopped, in the order given."""
        return tuple((c.name, c.stopped) for c in self.checks if c.stopped is not None)

    def notes(self) -> list:
        notes = []
        for check in tuple(self.hooks["notes"]):
            notes += self.call(check, "notes") or []
        return notes

    def close(self) -> None:
        for check in self.checks:
            if check.stopped is None:
                try:
                    check.close()
                except Exception:
                    pass
        if self._patch is not None:
            self._patch.restore()
            self._patch = None
