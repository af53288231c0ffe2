"""Probe cases: the auditor's saved state (state_dict, load_state_dict) round-tripped and corrupted."""

from __future__ import annotations

import json

from .common import Case, HANDLED, NAN, REFUSED, STEPS, private, quiet, run_steps, staged


def state_cases():
    import numpy as np

    corruptions = [
        ("torch-roundtrip", lambda s: _torch_roundtrip(s), HANDLED),
        ("json-roundtrip", lambda s: json.loads(json.dumps(s, default=_jsonable)), REFUSED),
        ("extra-key", lambda s: {**s, "unexpected": 1}, HANDLED),
        ("steps=huge", lambda s: {**s, "steps": 10**18}, REFUSED),
        ("steps=True", lambda s: {**s, "steps": True}, REFUSED),
        ("steps=nan", lambda s: {**s, "steps": NAN}, REFUSED),
        ("format=str", lambda s: {**s, "format": "2"}, REFUSED),
        ("setup=None", lambda s: {**s, "setup": None}, REFUSED),
        ("log=None", lambda s: {**s, "log": None}, REFUSED),
        ("monitor=[]", lambda s: {**s, "monitor": []}, REFUSED),
        ("sampler=None", lambda s: {**s, "sampler": None}, REFUSED),
        ("pool=[]", lambda s: {**s, "pool": []}, REFUSED),
        ("pool=nan", lambda s: {**s, "pool": [np.full_like(p, NAN) for p in s["pool"]]}, REFUSED),
        ("fingerprints=None", lambda s: {**s, "fingerprints": None}, REFUSED),
        ("empty dict", lambda s: {}, REFUSED),
        ("state of a longer run", None, HANDLED),
    ]
    cases = []
    for label, corrupt, expect in corruptions:
        cases.append(Case(f"state/{label}", "saved state", expect, _state_case(corrupt)))
    return cases


def _jsonable(value):
    import numpy as np

    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return str(value)


def _torch_roundtrip(state):
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _state_case(corrupt):
    def run():
        quiet()
        import copy

        from lightning_dpaudit import PrivacyAuditor

        model, optimizer, loader, _ = private()
        saver = PrivacyAuditor(optimizer, seed=1)
        run_steps(model, optimizer, loader, 5 if corrupt is None else STEPS)
        state = copy.deepcopy(saver.state_dict())
        model2, optimizer2, loader2, engine2 = private()
        engine2.accountant.history = copy.deepcopy(saver.accountant.history)  # a resume restores the accountant
        optimizer2.generator.set_state(optimizer.generator.get_state())  # and the noise generator (else: noise repeats)
        auditor = PrivacyAuditor(optimizer2, seed=1)
        before = auditor.result(accounting=False)
        names = ["state", "saved", "steps", "format", "setup", "log", "monitor", "sampler", "pool", "fingerprints", "damaged"]

        def setup():
            auditor.load_state_dict(state if corrupt is None else corrupt(state))

        def check(ctx, _):
            after = auditor.result(accounting=False)
            composed = sum(n for _, _, n in engine2.accountant.history)
            run_steps(model2, optimizer2, loader2, 1)
            final = auditor.result(accounting=False)
            if final.audit_failed:
                return "raw", f"after loading, the next step failed: {final.audit_failed[:120]}"
            if after.steps != composed:
                return "silent-wrong", f"loaded a state of {after.steps} steps where the accountant composed {composed}"
            if final.steps != after.steps + 1 or final.violation:
                return "silent-wrong", (f"steps {after.steps} -> {final.steps}, violation {final.violation}: "
                                        f"{str(final).splitlines()[0][:90]}")
            return "handled", f"loaded: steps {before.steps} -> {after.steps}, one more step audited"

        return staged(setup, lambda ctx: None, check, names)
    return run
