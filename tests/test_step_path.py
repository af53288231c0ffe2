"""The step path: between checks a gradient-canary step moves nothing from the device to the host,
and the alarm batched over checks records the same steps as a check after every step."""

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.bugs import inject_bug
from lightning_dpaudit.integrations.digits import make_private_digits, train_steps

# every way a tensor's values reach the host
TO_HOST = {"cpu", "item", "tolist", "numpy", "__array__", "__bool__", "__float__", "__int__", "__index__"}  # len() reads the shape only


class HostReads(TorchFunctionMode):
    """Counts the tensor methods that move values to the host (on a GPU: a synchronisation each)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in TO_HOST or (name == "to" and _to_host(args, kwargs or {}) and _from_the_package()):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _from_the_package() -> bool:
    """`.to(cpu)` is a move only where the code means one: Opacus's own `.to(p.device)` is not."""
    return "lightning_dpaudit" in sys._getframe(2).f_code.co_filename


def _to_host(args, kwargs) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


def _batches(loader, steps):
    while True:
        for batch in loader:
            yield batch


def _step(model, optimizer, images, labels):
    optimizer.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()


@pytest.mark.parametrize("mode", ["one-run", "paired"])
def test_steps_between_checks_move_nothing_to_the_host(mode):
    torch.manual_seed(0)
    model, optimizer, loader, _ = make_private_digits(seed=0)
    batches = _batches(loader, 40)
    plain = []
    for _ in range(3):  # the optimizer's own step, for reference (Opacus itself may read values)
        images, labels = next(batches)
        with HostReads() as reads:
            _step(model, optimizer, images, labels)
        plain.append(len(reads.calls))
    # the per-sample check reads on the host at its own steps (1, 1 + N, ...): off here, to see the canaries' path alone
    auditor = PrivacyAuditor(optimizer, seed=0, check_every=8, mode=mode, per_sample_check_every=0)
    audited = []
    for step in range(1, 17):
        images, labels = next(batches)
        with HostReads() as reads:
            _step(model, optimizer, images, labels)
        audited.append((step, reads.calls))
    between = [calls for step, calls in audited if step % 8]
    at_checks = [calls for step, calls in audited if step % 8 == 0]
    assert all(len(c) == max(plain) for c in between), between  # nothing beyond the optimizer's own
    assert all(len(c) > max(plain) for c in at_checks)  # the check itself does read (the test sees reads)
    observed_per_step = auditor.options.canaries_per_step * (2 if mode == "paired" else 1)  # paired: every canary out, then in
    assert auditor.result().n_in + auditor.result().n_out == 16 * observed_per_step


@pytest.mark.parametrize("bug", ["no-noise", "reused-noise", "unnoised-layer"])
def test_batched_checks_record_the_alarm_at_the_step_of_a_check_after_every_step(bug):
    results = []
    for check_every in (1, 8):
        model, optimizer, loader, _ = make_private_digits(seed=1)
        optimizer = inject_bug(optimizer, bug)
        raised = []
        auditor = PrivacyAuditor(optimizer, seed=3, check_every=check_every, on_violation=lambda r: raised.append(auditor.steps))
        train_steps(model, optimizer, loader, 40)
        results.append((auditor.result(), raised))
    (every, raised_every), (batched, raised_batched) = results
    assert every.violation and batched.violation
    assert batched.first_violation_step == every.first_violation_step
    assert batched.violating_layers == every.violating_layers
    assert raised_every == [every.first_violation_step]
    assert raised_batched[0] - every.first_violation_step in range(8)  # raised at the next check
