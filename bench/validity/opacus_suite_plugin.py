"""A pytest plugin that runs Opacus's own tests with a PrivacyAuditor on every DP optimizer they make.

Loaded with `-p opacus_suite_plugin` (this folder on PYTHONPATH) by opacus_suite.py, in both of its passes:

    DPAUDIT_SUITE_OUTCOMES=path   each test's outcome, one JSON line per test (both passes)
    DPAUDIT_SUITE_AUDIT=1         attach the audit (the audited pass; unset or 0: the plain pass)
    DPAUDIT_SUITE_AUDITS=path     one JSON line per DP optimizer the test made (audited pass)
    DPAUDIT_SUITE_PER_SAMPLE_EVERY  the auditor's per_sample_check_every (default 1: as often as its budget allows)

The audit attaches after the outermost `__init__` of every DPOptimizer (and every subclass, those the tests
define too) returns. Under `PrivacyEngine.make_private` (and make_private_with_epsilon, which calls it) it waits
for make_private to return, then attaches with the module it returned (the GradSampleModule; under
wrap_model=False, the user's model its GradSampleHooks are on) and the DataLoader it returned (the loader is
watched for the sampling checks). An optimizer made outside make_private gets the module of the GradSampleModule
(or GradSampleHooks) holding all its parameters when one was made, else none. Attaching never makes a test fail: an error there is written as
`attach_refused` and the test goes on without the audit. At the end of each test every auditor made during it
gives its result (an error there is written as `result_error`) and is detached.

Both passes also load the same environment fixes, so they differ only by the audit:
- a Hypothesis profile (derandomize: both passes draw the same examples; no example database; no default
  deadline and no too_slow health check, which time a shared machine rather than the code; a test's own
  settings still win), and
- where torchvision's compiled operators cannot load (a CUDA build of torchvision beside a CPU build of torch),
  the schemas of the two operators its meta registrations need, so that its pure-Python parts (FakeData,
  transforms, mobilenet_v3_small, which the tests use) import; no operator is given a kernel.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
import traceback
import weakref

import pytest

AUDIT = os.environ.get("DPAUDIT_SUITE_AUDIT", "0") not in ("", "0")
OUTCOMES = os.environ.get("DPAUDIT_SUITE_OUTCOMES")
AUDITS = os.environ.get("DPAUDIT_SUITE_AUDITS")
PER_SAMPLE_EVERY = int(os.environ.get("DPAUDIT_SUITE_PER_SAMPLE_EVERY", "1"))
MESSAGE_CHARS = 200


# ---------------------------------------------------------------------------------------- the environment, both passes

def _torchvision_without_ops() -> None:
    """Import torchvision; if its compiled operators are missing, declare the two its import registers fakes for."""
    try:
        import torchvision  # noqa: F401
        return
    except ModuleNotFoundError:
        return
    except RuntimeError as error:
        if "torchvision::" not in str(error):
            raise
    import torch

    for name in [name for name in sys.modules if name == "torchvision" or name.startswith("torchvision.")]:
        del sys.modules[name]
    library = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _torchvision_without_ops.library = library  # kept alive: the schemas go with it
    import torchvision  # noqa: F401,F811


def _hypothesis_profile() -> None:
    try:
        from hypothesis import HealthCheck, settings
    except ModuleNotFoundError:
        return
    settings.register_profile("dpaudit-suite", derandomize=True, database=None, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("dpaudit-suite")


# ---------------------------------------------------------------------------------------- outcomes, both passes

SEVERITY = ("passed", "skipped", "xfailed", "xpassed", "failed", "error")
_outcomes: dict = {}


def _phase_outcome(report) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed" if report.passed else "failed"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    return "skipped" if report.skipped else "passed"


def pytest_runtest_logreport(report):
    if report.when != "call" and report.passed:
        return
    entry = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0, "detail": ""})
    outcome = _phase_outcome(report)
    entry["seconds"] += report.duration
    if SEVERITY.index(outcome) > SEVERITY.index(entry["outcome"]):
        entry["outcome"] = outcome
        if report.failed:
            lines = (report.longreprtext or "").strip().splitlines()
            entry["detail"] = lines[-1][:300] if lines else ""


def pytest_collectreport(report):
    """A file or class that fails to collect (a missing import): its tests never run, so it is written as one error."""
    if report.failed and OUTCOMES:
        lines = (report.longreprtext or "").strip().splitlines()
        with open(OUTCOMES, "a") as handle:
            handle.write(json.dumps({"test": report.nodeid or "<collection>", "outcome": "error", "seconds": 0.0,
                                     "detail": "collection failed: " + (lines[-1][:280] if lines else "")}) + "\n")


def pytest_runtest_logfinish(nodeid, location):
    entry = _outcomes.pop(nodeid, None)
    if entry is None or not OUTCOMES:
        return
    with open(OUTCOMES, "a") as handle:
        handle.write(json.dumps({"test": nodeid, **entry}) + "\n")


# ---------------------------------------------------------------------------------------- the audit, audited pass only

_state = threading.local()
_current = {"test": None}
_auditors: list = []  # one dict per optimizer: test, optimizer class, auditor (or None and why refused), module, loader
_modules: "weakref.WeakSet" = weakref.WeakSet()


def _depth(name: str) -> int:
    return getattr(_state, name, 0)


def _trained_module(made):
    """The module the test trains for what Opacus made: a GradSampleModule itself; under wrap_model=False
    (GradSampleHooks, not a module) the user's model the hooks are on; None otherwise."""
    import torch

    if isinstance(made, torch.nn.Module):
        return made
    inner = getattr(made, "_module", None)
    return inner if isinstance(inner, torch.nn.Module) else None


def _module_holding(optimizer):
    """The module of the newest GradSampleModule (or GradSampleHooks) holding every parameter of `optimizer`."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    found = None
    for made in list(_modules):
        try:
            module = _trained_module(made)
            if module is not None and params <= {id(p) for p in module.parameters()}:
                found = module
        except Exception:
            continue
    return found


def _attach(optimizer, module=None, data_loader=None) -> None:
    """Attach, or write why not; nothing here reaches the test."""
    try:
        _attach_audit(optimizer, module, data_loader)
    except Exception as error:  # the plugin's own slip (the auditor's refusals are caught inside)
        _auditors.append({"test": _current["test"], "optimizer": type(optimizer).__name__, "auditor": None,
                          "refused": f"plugin: {type(error).__name__}: {error}", "module": None, "loader": False})


def _attach_audit(optimizer, module, data_loader) -> None:
    from lightning_dpaudit import PrivacyAuditor

    if module is None:
        module = _module_holding(optimizer)
    entry = {"test": _current["test"], "optimizer": type(optimizer).__name__, "auditor": None, "refused": None,
             "module": None if module is None else type(module).__name__, "loader": data_loader is not None}
    try:
        entry["auditor"] = PrivacyAuditor(optimizer, on_violation=lambda result: None,
                                          per_sample_check_every=PER_SAMPLE_EVERY, seed=0, module=module,
                                          data_loader=data_loader)
    except Exception as error:
        if data_loader is not None:  # a loader the run checks cannot watch: the audit without it
            try:
                entry["auditor"] = PrivacyAuditor(optimizer, on_violation=lambda result: None,
                                                  per_sample_check_every=PER_SAMPLE_EVERY, seed=0, module=module)
                entry["loader"] = f"refused: {type(error).__name__}: {error}"[:MESSAGE_CHARS]
            except Exception as second:
                error = second
        if entry["auditor"] is None:
            entry["refused"] = f"{type(error).__name__}: {error}"
    _auditors.append(entry)


def _wrap_init(cls) -> None:
    original = cls.__dict__.get("__init__")
    if original is None or getattr(original, "_dpaudit_suite", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        _state.init = _depth("init") + 1
        try:
            original(self, *args, **kwargs)
        finally:
            _state.init -= 1
        if _state.init == 0:
            if _depth("make_private"):
                _state.pending = [*getattr(_state, "pending", []), self]
            else:
                _attach(self)

    __init__._dpaudit_suite = True
    cls.__init__ = __init__


def _wrap_tree(cls) -> None:
    _wrap_init(cls)
    for sub in cls.__subclasses__():
        _wrap_tree(sub)


def _install() -> None:
    import torch
    from opacus import PrivacyEngine
    from opacus.grad_sample.gsm_base import AbstractGradSampleHooks
    from opacus.optimizers import DPOptimizer
    from torch.utils.data import DataLoader

    import opacus.optimizers  # noqa: F401  (every optimizer class Opacus ships, imported before the tree is walked)

    _wrap_tree(DPOptimizer)
    previous = DPOptimizer.__dict__.get("__init_subclass__")

    def __init_subclass__(cls, **kwargs):
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(DPOptimizer, cls).__init_subclass__(**kwargs)
        _wrap_init(cls)

    DPOptimizer.__init_subclass__ = classmethod(__init_subclass__)

    hooks_init = AbstractGradSampleHooks.__init__  # GradSampleModule's too (it calls it)

    @functools.wraps(hooks_init)
    def hooks_init_wrapped(self, *args, **kwargs):
        hooks_init(self, *args, **kwargs)
        _modules.add(self)

    AbstractGradSampleHooks.__init__ = hooks_init_wrapped

    make_private = PrivacyEngine.make_private

    @functools.wraps(make_private)
    def make_private_wrapped(self, *args, **kwargs):
        _state.make_private = _depth("make_private") + 1
        outer = _state.make_private == 1
        if outer:
            _state.pending = []
        try:
            returned = make_private(self, *args, **kwargs)
        except BaseException:
            if outer:
                _state.pending = []
            raise
        finally:
            _state.make_private -= 1
        if outer:
            pending, _state.pending = _state.pending, []
            module = _trained_module(returned[0])
            loader = returned[-1] if isinstance(returned[-1], DataLoader) else None
            for optimizer in pending:
                mine = optimizer is returned[1] or getattr(returned[1], "original_optimizer", None) is optimizer
                _attach(optimizer, module, loader if mine else None)
        return returned

    PrivacyEngine.make_private = make_private_wrapped


def _finding(finding) -> dict:
    return {"code": finding.code, "first_step": finding.first_step, "message": finding.message[:MESSAGE_CHARS]}


def _report(entry) -> dict:
    line = {key: entry[key] for key in ("test", "optimizer", "module", "loader")}
    auditor = entry["auditor"]
    if auditor is None:
        line["attach_refused"] = entry["refused"]
        return line
    try:
        result = auditor.result()
        line.update(
            steps=result.steps, violation=bool(result.violation), findings=[_finding(f) for f in result.findings],
            audit_failed=result.audit_failed, checks_stopped=[list(s) for s in result.checks_stopped],
            notes=[note.split(":", 1)[0] for note in result.notes], data_path=result.data_path,
            pipeline=result.pipeline,
        )
    except Exception as error:
        line["result_error"] = f"{type(error).__name__}: {error} | {traceback.format_exc(limit=-3)[-600:]}"
    try:
        auditor.detach()
    except Exception as error:
        line["detach_error"] = f"{type(error).__name__}: {error}"
    return line


def pytest_configure(config):
    _torchvision_without_ops()
    _hypothesis_profile()
    if AUDIT:
        _install()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _current["test"] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if not AUDIT:
        return
    mine = [entry for entry in _auditors if entry["test"] == item.nodeid]
    _auditors[:] = [entry for entry in _auditors if entry["test"] != item.nodeid]
    lines = []
    for entry in mine:
        try:
            lines.append(_report(entry))
        except Exception as error:  # the plugin's own slip: written, never raised into the test
            lines.append({"test": item.nodeid, "optimizer": entry.get("optimizer"),
                          "result_error": f"{type(error).__name__}: {error}"})
    if AUDITS and lines:
        with open(AUDITS, "a") as handle:
            for line in lines:
                handle.write(json.dumps(line, default=str) + "\n")


def pytest_sessionfinish(session, exitstatus):
    if AUDIT and AUDITS:  # auditors made outside any test (collection, class set-up): written under "<none>"
        with open(AUDITS, "a") as handle:
            for entry in _auditors:
                handle.write(json.dumps(_report(entry), default=str) + "\n")
        _auditors.clear()
