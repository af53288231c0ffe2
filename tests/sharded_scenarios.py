"""Two-process (gloo, 127.0.0.1) audits of Opacus's ghost clipping under DDP and FSDP, run by test_sharded.py.

Each rank trains the token model of ghost_setups.py on its shard of the data (a
DistributedSampler): under DDP with DPDDP + grad_sample_mode="ghost"
(DistributedDPOptimizerFastGradientClipping), under FSDP with Opacus's FSDP2Wrapper +
grad_sample_mode="ghost_fsdp" (FSDPOptimizerFastGradientClipping).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ddp_scenarios import _Stop, _summary, main, run_outcome  # noqa: E402


def _private(rank, world, mode: str, *, noise_seed: int = 7):
    """(module, optimizer, criterion, loader) for mode "ddp" or "fsdp", the same model on every rank."""
    import torch
    from ghost_setups import make_ghost, token_data, token_model

    model = token_model(0)
    if mode == "ddp":
        from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

        model, grad_sample_mode = DPDDP(model), "ghost"
    else:
        from opacus.utils.fsdp_utils import FSDP2Wrapper

        model, grad_sample_mode = FSDP2Wrapper(model), "ghost_fsdp"
    data = token_data()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    return make_ghost(module=model, dataset=data, sampler=sampler, batch_size=32, seed=noise_seed + rank,
                      grad_sample_mode=grad_sample_mode)


def _local(module):
    """This rank's parameter values (its shards under FSDP), flat."""
    import torch

    return torch.cat([(p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1) for p in module.parameters()])


def correct(rank, world, options):
    """An audited and an un-audited run of the same job: same updates, the same audit on every rank, no alarm."""
    import torch

    from lightning_dpaudit import PrivacyAuditor

    mode, steps = options["mode"], int(options.get("steps", 40))
    audited, plain = _private(rank, world, mode), _private(rank, world, mode)
    auditor = PrivacyAuditor(audited[1], seed=options.get("seed", 11))
    batches = list(audited[3])
    gaps = []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        for module, optimizer, criterion, _ in (audited, plain):
            criterion(module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        gaps.append(float(torch.max(torch.abs(_local(audited[0]) - _local(plain[0])))))
    summary = _summary(auditor)
    summary["max_update_gap"] = max(gaps)
    summary["optimizer"] = type(audited[1]).__name__
    summary["canaries_per_step"] = auditor.options.canaries_per_step
    summary["result"] = auditor.result().to_dict()
    return summary


def bugs(rank, world, options):
    """Each named bug injected into the ghost-clipping set-up: the audit's summary at the first alarm."""
    from ghost_setups import train_ghost
    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.bugs import inject_bug
    from lightning_dpaudit.engine.checks.exact.per_sample import DEFAULT_BUDGET, DEFAULT_EVERY

    found = {}
    for name in options["names"]:
        module, optimizer, criterion, loader = _private(rank, world, options["mode"])
        if name != "correct":
            inject_bug(optimizer, name, module=module)
        # options["checks"]: "off" the canaries' reading alone, "default" the auditor's defaults (both stopped at the
        # first alarm), "every" the exact checks at every step, the whole run (every check has its say)
        checks = options.get("checks", "off")
        every = {"off": 0, "default": DEFAULT_EVERY, "every": 1}[checks]
        auditor = PrivacyAuditor(optimizer, seed=3, on_violation=(lambda result: None) if checks == "every" else _stop,
                                 per_sample_check_every=every, per_sample_check_budget=1.0 if every == 1 else DEFAULT_BUDGET)
        try:
            train_ghost(module, optimizer, criterion, loader, int(options.get("steps", 60)))
        except _Stop:
            pass  # every rank alarms at the same check (the same observations), so every rank stops there
        summary = _summary(auditor)
        summary["findings"] = [f.code for f in auditor.result(accounting=False).findings]
        found[name] = summary
        auditor.detach()
    return found


def false_alarms(rank, world, options):
    """Correct audited FSDP runs one after another (bench/validity/false_alarms.py --mode fsdp): per run, whether the
    alarm ever fired and which findings or failures were recorded."""
    from ghost_setups import train_ghost
    from lightning_dpaudit import PrivacyAuditor

    outcomes = []
    for seed in options["seeds"]:
        module, optimizer, criterion, loader = _private(rank, world, "fsdp", noise_seed=10_000 + seed)
        auditor = PrivacyAuditor(optimizer, seed=10_000 + seed, on_violation=lambda result: None)
        train_ghost(module, optimizer, criterion, loader, int(options["steps"]))
        outcomes.append(run_outcome(auditor))
    return {"outcomes": outcomes}


def pipeline(rank, world, options):
    """FSDP's run checks and exact checks on mistakes of the user's own step or model, each run 8 steps (no stop):
    copies of the batch inside the step, a module centring over the batch, and a mixed-precision policy that the
    exact checks' replay declines (the audit stays quiet there and says so)."""
    import torch
    from ghost_setups import make_ghost, token_data, token_model
    from opacus.utils.fsdp_utils import FSDP2Wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_dpaudit import PrivacyAuditor

    class Centred(torch.nn.Module):  # statistics over the batch in training: each row depends on the others
        def forward(self, x):
            return x - x.mean(dim=0, keepdim=True)

    def centred_model():
        model = token_model(0)
        return torch.nn.Sequential(*model[:4], Centred(), *model[4:])

    cases = {
        "copies": (token_model, {}, lambda x, y: (torch.cat([x, x]), torch.cat([y, y]))),
        "centred": (centred_model, {}, lambda x, y: (x, y)),
        "mixed_precision": (token_model, {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)},
                            lambda x, y: (x, y)),
    }
    data = token_data()
    found = {}
    for name, (build, wrap, step_input) in cases.items():
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
        module, optimizer, criterion, loader = make_ghost(
            module=FSDP2Wrapper(build(), **wrap), dataset=data, sampler=sampler, batch_size=32, seed=5 + rank,
            grad_sample_mode="ghost_fsdp")
        auditor = PrivacyAuditor(optimizer, module=module, seed=3, on_violation=lambda result: None,
                                 data_loader=loader, per_sample_check_every=1)
        batches = iter(loader)
        for _ in range(8):
            x, y = step_input(*next(batches))
            criterion(module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        result = auditor.result(accounting=False)
        found[name] = {"findings": sorted({f.code for f in result.findings}), "data_path": result.data_path,
                       "pipeline": result.pipeline, "first": {f.code: f.first_step for f in result.findings}}
        auditor.detach()
    return found


def check_fault(rank, world, options):
    """Rank 0's exact check fails at its first compared step (a fault of the check's own code): training goes on
    on both ranks (rank 0 still gathers with rank 1 at the later checked steps), and the models equal plain ones."""
    import torch

    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.engine import per_sample_check

    audited, plain = _private(rank, world, "fsdp"), _private(rank, world, "fsdp")
    auditor = PrivacyAuditor(audited[1], seed=3, module=audited[0], per_sample_check_every=2)
    if rank == 0:
        def broken(self, calls, step):
            raise RuntimeError("a fault of the check's own code")
        per_sample_check.PerSampleCheck._compare = broken
    batches = list(audited[3])
    for step in range(9):
        x, y = batches[step % len(batches)]
        for module, optimizer, criterion, _ in (audited, plain):
            criterion(module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    result = auditor.result(accounting=False)
    return {"data_path": result.data_path, "steps": result.steps, "findings": [f.code for f in result.findings],
            "gap": float(torch.max(torch.abs(_local(audited[0]) - _local(plain[0]))))}


def short_of_memory(rank, world, options):
    """Rank 0 alone finds the gathered model too large for its memory: every rank declines the check's step."""
    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.engine import sharded_replay

    module, optimizer, criterion, loader = _private(rank, world, "fsdp")
    if rank == 0:
        sharded_replay.over_memory = lambda need, device: True
    auditor = PrivacyAuditor(optimizer, seed=3, module=module, per_sample_check_every=2)
    from ghost_setups import train_ghost

    train_ghost(module, optimizer, criterion, loader, 6)
    result = auditor.result(accounting=False)
    return {"data_path": result.data_path, "findings": [f.code for f in result.findings], "steps": result.steps}


def _stop(result):
    raise _Stop


def both(rank, world, options):
    """`correct`, `bugs` and the exact checks' bugs in one job (one start-up of the process group)."""
    return {"correct": correct(rank, world, options), "bugs": bugs(rank, world, options),
            "exact": bugs(rank, world, {**options, "names": options["exact_names"], "checks": "every"})}


if __name__ == "__main__":
    main(globals())
