"""What the practitioner recipes (tests/recipes.py) share: a recipe's record, the audit attached as the guides show,
a plain loop that stops at the first alarm, and what a result says the checks compared.

A recipe is a correct DP-SGD training run and its buggy twin. The correct run must be quiet (no violation, no
finding) with every check having compared something or said why not; the twin must be flagged with one of the
finding codes the recipe expects.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Tuple

import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader

from lightning_dpaudit import AuditResult, PrivacyAuditor

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")

SIGMA, C, BATCH = 1.0, 1.0, 64


@dataclass(frozen=True)
class Recipe:
    """A named practitioner recipe.

    correct(seed, steps), twin(seed, steps)   run it audited and return the AuditResult (a run stops at its first alarm)
    expected      the finding codes of which the twin must show at least one
    known_failure None, or why the correct recipe is not quiet: a limitation of the audit, said rather than hidden
    declines      what the correct recipe's checks decline, saying why (a part of each such status): by design, not
                  a failure, and nothing else may be declined
    """

    name: str
    summary: str
    twin_summary: str
    correct: Callable[[int, int], AuditResult]
    twin: Callable[[int, int], AuditResult]
    expected: Tuple[str, ...]
    known_failure: Optional[str] = None
    declines: Tuple[str, ...] = ()


class Audit:
    """A PrivacyAuditor attached as the plain-loop guide shows, keeping its alarms so that the loop stops at the first."""

    def __init__(self, optimizer, *, module, loader, seed: int, loss=None, **options):
        self.alarms: List[AuditResult] = []
        self.auditor = PrivacyAuditor(optimizer, module=module, data_loader=loader, training_loss=loss, seed=seed,
                                      on_violation=self.alarms.append, **options)

    def alarmed(self) -> bool:
        return bool(self.alarms)

    def result(self) -> AuditResult:
        result = self.auditor.result()
        self.auditor.detach()
        return result


def private(model: nn.Module, dataset, *, seed: int, params: Optional[Iterable] = None, lr: float = 0.1,
            batch_size: int = BATCH, **options):
    """Opacus's make_private over `model` (SGD on `params`, all of its trainable tensors unless given), Poisson
    sampling by default; the sampling and the noise seeded. Returns (module, optimizer, loader)."""
    params = [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))
    made = PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(params, lr=lr), data_loader=loader,
                                        noise_multiplier=SIGMA, max_grad_norm=C,
                                        noise_generator=torch.Generator().manual_seed(seed + 1), **options)
    return made[0], made[1], made[-1]


def loop(step: Callable, loader, steps: int, stop: Callable[[], bool]) -> int:
    """step(batch) for each batch over as many epochs as needed, until `steps` steps or the first alarm."""
    done = 0
    while done < steps:
        for batch in loader:
            step(batch)
            done += 1
            if done >= steps or stop():
                return done
    return done


def sgd_step(model: nn.Module, optimizer, loss: Callable, *, autocast: Optional[torch.dtype] = None) -> Callable:
    """The plain training step: zero the gradients, the loss of the batch backward, the DP optimizer's step."""

    def step(batch):
        optimizer.zero_grad()
        if autocast is None:
            loss(batch).backward()
        else:
            with torch.autocast("cpu", dtype=autocast):
                value = loss(batch)
            value.backward()
        optimizer.step()

    return step


def cross_entropy(model: nn.Module) -> Callable:
    return lambda batch: nn.functional.cross_entropy(model(batch[0]), batch[1])


# ---------------------------------------------------------------------------------------------- what was compared

# a positive count of what a check compared; "0 watched": every trained tensor is the DP optimizer's, none to watch
COUNTED = re.compile(r"\b[1-9]\d* (step\(s\) compared|steps compared|replays|batches fingerprinted|comparisons)|\(0 watched,")
SAID_WHY = ("not compared:", "nothing compared yet (")


def statuses(result: AuditResult) -> List[str]:
    """The exact check's status and each run check's, split at the top-level '; ' of `result.pipeline`."""
    parts, depth, start, text = [], 0, 0, result.pipeline
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and text.startswith("; ", i):
            parts.append(text[start:i])
            start = i + 2
    parts.append(text[start:])
    return [result.data_path, *[p for p in parts if p]]


def uncompared(result: AuditResult) -> Tuple[List[str], List[str]]:
    """(failures, declined): a stopped check, a failed audit or a check that compared nothing without saying why are
    failures; a check that compared nothing and said why, or the independence check replaying the forward pass but
    not the training step, is declined (allowed, and shown)."""
    failures = [f"{name} stopped: {why}" for name, why in result.checks_stopped]
    if result.audit_failed is not None:
        failures.append(f"the audit failed: {result.audit_failed}")
    declined = []
    for status in statuses(result):
        if status.startswith("stopped at") or status == "off":
            failures.append(f"exact check {status}")
        elif COUNTED.search(status):
            if "none through the training step" in status:  # compared, but the loop's own loss was not replayed
                declined.append(status)
        elif any(why in status for why in SAID_WHY):
            declined.append(status)
        else:
            failures.append(f"compared nothing: {status}")
    return failures, declined


def quiet(result: AuditResult) -> List[str]:
    """Why a correct run is not passed: its violation, its findings, what it did not compare (empty when it passes)."""
    problems = [f"{f.code} (step {f.first_step}): {f.message}" for f in result.findings]
    if result.violation and not problems:
        problems.append("violation: " + str(result).splitlines()[0])
    return problems + uncompared(result)[0]


def flagged(result: AuditResult, expected: Tuple[str, ...]) -> List[str]:
    """Why a twin is not passed: not a violation, or none of the expected codes (empty when it passes)."""
    codes = [f.code for f in result.findings]
    problems = [] if result.violation else ["no violation"]
    if not set(codes) & set(expected):
        problems.append(f"none of {', '.join(expected)} among the findings ({', '.join(codes) or 'none'})")
    return problems
