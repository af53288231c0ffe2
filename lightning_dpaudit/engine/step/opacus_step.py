"""The optimizer's step, watched on the instance: what Opacus's own step raises is passed on unchanged, and named.

An exception out of `optimizer.step` (clipping, the noise, `scale_grad`, the accountant's step hook, the original
optimizer's step) can leave a release that was never applied, or never composed by the accountant. That is
Opacus's error, not a leak: the auditor records it (`opacus_error`, no alarm) and, where the step's release was
made, takes the accountant's history as it is from there (claims.StepClaims.resync), so that a step the accountant
did not compose is no `claim_unaccounted`. Not Opacus's: what the closure raises (the user's loss and backward) and
what the audit raises itself (its alarm, its own errors: `raised_by_audit`).

The replacement is a bound method, as torch's LR schedulers expect of `optimizer.step` (they wrap
`step.__func__`); when one wrapped it since, `restore` leaves the wrapper in place and the method passes through.
"""

from __future__ import annotations

import types
from typing import Callable

from ..support.instance_patch import InstancePatch

CODE = "opacus_error"


class OpacusStep:
    """`report(error, step, released)`: Opacus's step raised `error` at `step` (from 1), after the step's release
    when `released`. `steps()` the audited steps so far; `raised_by_audit(error)` whether the audit raised it."""

    def __init__(self, optimizer, *, steps: Callable[[], int], raised_by_audit: Callable[[BaseException], bool],
                 report: Callable[[BaseException, int, bool], None]):
        self.steps, self.raised_by_audit, self.report = steps, raised_by_audit, report
        self.active = True

        def step(_optimizer, *args, **kwargs):
            return self._step(*args, **kwargs)

        self._function = step
        self._patch = InstancePatch(optimizer, "step", types.MethodType(step, optimizer))

    def restore(self) -> None:
        """Put back the optimizer's own step; if something wrapped ours since, ours passes through from now."""
        self.active = False
        if getattr(vars(self._patch.obj).get("step"), "__func__", None) is self._function:
            self._patch.restore()

    def _step(self, *args, **kwargs):
        original = self._patch.original
        if not self.active:
            return original(*args, **kwargs)
        closure_errors: list = []
        args, kwargs = _watched_closure(args, kwargs, closure_errors)
        before = self.steps()
        try:
            return original(*args, **kwargs)
        except Exception as error:
            if not any(error is e for e in closure_errors) and not self.raised_by_audit(error):
                try:
                    self.report(error, before + 1, self.steps() > before)
                except Exception:  # the record never replaces Opacus's own error
                    pass
            raise


def _watched_closure(args: tuple, kwargs: dict, errors: list):
    """The step's arguments with its closure (first positional, or `closure=`) noting what it raises."""
    def watch(closure):
        if not callable(closure):
            return closure

        def watched(*a, **k):
            try:
                return closure(*a, **k)
            except BaseException as error:
                errors.append(error)
                raise

        return watched

    if args:
        return (watch(args[0]), *args[1:]), kwargs
    if "closure" in kwargs:
        return args, {**kwargs, "closure": watch(kwargs["closure"])}
    return args, kwargs
