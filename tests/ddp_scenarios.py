"""Two-process (gloo, 127.0.0.1) audits of Opacus's DistributedDPOptimizer, run by test_distributed.py
(and bench/validity/false_alarms.py's correct runs under DDP and FSDP).

`launch(scenario, ...)` starts one process per rank running this file and returns each
rank's JSON answer; a rank that hangs or dies fails the launch within `timeout` seconds.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = 120


def launch(scenario: str, out: Path, world: int = 2, timeout: float = 240.0, script: str = "ddp_scenarios.py",
           **options) -> list:
    """Run `scenario` (a function of `script`) on `world` local processes; each rank's answer (a dict), in rank order."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / script), scenario, str(out), json.dumps(options)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"{scenario}: ranks did not finish within {timeout:.0f} s")
    for r, (p, text) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            raise AssertionError(f"{scenario}: rank {r} exited with {p.returncode}:\n{text[-4000:]}")
    return [json.loads((out / f"{scenario}-rank{r}.json").read_text()) for r in range(world)]


def run_bounded(args, timeout: float = 240.0, cwd=None):
    """(exit code, output) of `python args...`, its process group killed and the test failed after `timeout` s."""
    import signal

    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.Popen([sys.executable, *map(str, args)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"{args}: the job did not end within {timeout:.0f} s (a rank hangs)")
    return proc.returncode, text


# ---------------------------------------------------------------------- inside each rank


def _model(seed: int = 0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 10))


def _loader(rank: int, world: int, n: int = 1024, batch: int = 32, sharded: bool = True, generator=None):
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
    drawn = {} if generator is None else {"generator": generator}
    if not sharded:
        return DataLoader(data, batch_size=batch, **drawn)
    return DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False),
                      **drawn)


def _private(rank, world, *, wrap=True, noise_seed=7, sharded=True, noise_multiplier=1.0, clipping="flat",
             poisson_sampling=True):
    """A DP model, its optimizer (a DistributedDPOptimizer when wrapped) and loader. Fixed batches unless
    poisson_sampling: then make_private's own Poisson sampling (under DPDDP a DPDataLoader over Opacus's
    DistributedUniformWithReplacementSampler: each rank draws from its shard with a generator of its own)."""
    import torch
    from opacus import PrivacyEngine
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    model = _model()
    module = DPDDP(model) if wrap else model
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    engine = PrivacyEngine()
    generator = torch.Generator().manual_seed(noise_seed * world + rank + 1) if poisson_sampling else None
    module, optimizer, loader = engine.make_private(
        module=module, optimizer=optimizer, data_loader=_loader(rank, world, sharded=sharded, generator=generator),
        noise_multiplier=noise_multiplier, poisson_sampling=poisson_sampling, clipping=clipping,
        max_grad_norm=1.0 if clipping == "flat" else [0.5] * len(list(model.parameters())),
        noise_generator=torch.Generator().manual_seed(noise_seed),
    )
    return module, optimizer, loader, engine


def _train(module, optimizer, loader, steps, on_step=None):
    import torch

    done = 0
    while done < steps:
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(module(x), y).backward()
            optimizer.step()
            done += 1
            if on_step is not None:
                on_step(done)
            if done == steps:
                return


def _summary(auditor):
    r = auditor.result()
    return {"violation": r.violation, "first_violation_step": r.first_violation_step, "violating": list(r.violating_layers),
            "mu_lower_bound": r.mu_lower_bound, "n_in": r.n_in, "n_out": r.n_out, "steps": r.steps,
            "problems": [list(p) for p in auditor.problems], "epsilon_lower_bound": r.epsilon_lower_bound,
            "epsilon_accountant": r.epsilon_accountant, "data_path": r.data_path}


def _halve_linear_bias_samples():
    from opacus.grad_sample import GradSampleModule

    sampler = GradSampleModule.GRAD_SAMPLERS[torch_nn().Linear]

    def halved(layer, activations, backprops):
        out = sampler(layer, activations, backprops)
        out[layer.bias] = out[layer.bias] / 2
        return out

    GradSampleModule.GRAD_SAMPLERS = {**GradSampleModule.GRAD_SAMPLERS, torch_nn().Linear: halved}


def torch_nn():
    import torch

    return torch.nn


def correct(rank, world, options):
    """An audited and an un-audited replica of the same run: same updates, same audit on every rank, no alarm."""
    import torch

    from lightning_dpaudit import PrivacyAuditor

    steps = int(options.get("steps", STEPS))
    clipping = options.get("clipping", "flat")
    if options.get("wrong_sampler_rank") == rank:  # this rank's per-sample gradients of Linear biases are halved
        _halve_linear_bias_samples()
    audited = _private(rank, world, clipping=clipping)
    plain = _private(rank, world, clipping=clipping)
    auditor = PrivacyAuditor(audited[1], seed=options.get("seed"), checksum_every=10)
    gaps = []
    batches = list(audited[2])
    for step in range(steps):
        x, y = batches[step % len(batches)]
        for module, optimizer, _, _ in (audited, plain):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(module(x), y).backward()
            optimizer.step()
        gaps.append(max(float((a - b).abs().max()) for a, b in zip(audited[0].parameters(), plain[0].parameters())))
    summary = _summary(auditor)
    summary["max_update_gap"] = max(gaps)
    summary["observations"] = auditor.observations()["value"][:64].tolist()
    summary["canaries_per_step"] = auditor.options.canaries_per_step
    summary["optimizer"] = type(audited[1]).__name__
    summary["result"] = auditor.result().to_dict()  # the whole AuditResult, compared across ranks
    return summary


def bugs(rank, world, options):
    """Each named bug injected into the DistributedDPOptimizer: the step of the first alarm (None: quiet)."""
    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.bugs import inject_bug

    found = {}
    for name in options["names"]:
        module, optimizer, loader, _ = _private(rank, world)
        if name != "correct":
            inject_bug(optimizer, name, **options.get("bug_options", {}).get(name, {}))
        # the canaries' reading alone: the exact checks' per-rank findings are tested on their own
        auditor = PrivacyAuditor(optimizer, seed=3, per_sample_check_every=0)
        first = {}

        def stop(step):
            if auditor.result(accounting=False).violation and "step" not in first:
                first["step"] = step
                raise _Stop

        try:
            _train(module, optimizer, loader, int(options.get("steps", STEPS)), on_step=stop)
        except _Stop:
            pass
        found[name] = _summary(auditor)
        auditor.detach()
    return found


class _Stop(Exception):
    pass


def false_alarms(rank, world, options):
    """Correct audited runs one after another (bench/validity/false_alarms.py --mode ddp or fsdp): per run, whether the
    alarm ever fired and which findings or failures were recorded.

    setup "ddp" (default): the MLP under DPDDP and its DistributedDPOptimizer, the exact checks at every due step;
    "fsdp": the token classifier of ghost_setups.py under Opacus's FSDP2Wrapper, grad_sample_mode="ghost_fsdp"
    (the exact checks at every due step: under FSDP the ranks check together). Both with make_private's Poisson sampling (poisson_sampling=True: a
    DPDataLoader over DistributedUniformWithReplacementSampler), the loader given to the audit as data_loader."""
    from lightning_dpaudit import PrivacyAuditor

    outcomes = []
    sigma = float(options.get("sigma", 1.0))
    for seed in options["seeds"]:
        if options.get("setup", "ddp") == "fsdp":
            from ghost_setups import train_ghost

            module, optimizer, criterion, loader = _fsdp_private(rank, world, noise_seed=10_000 + seed,
                                                                 noise_multiplier=sigma)
            auditor = PrivacyAuditor(optimizer, module=module, seed=10_000 + seed, on_violation=lambda result: None,
                                     data_loader=loader)
            train_ghost(module, optimizer, criterion, loader, int(options["steps"]))
        else:
            module, optimizer, loader, _ = _private(rank, world, noise_seed=10_000 + seed, noise_multiplier=sigma,
                                                   poisson_sampling=True)
            auditor = PrivacyAuditor(optimizer, module=module, seed=10_000 + seed, on_violation=lambda result: None,
                                     per_sample_check_budget=1.0,  # every due step checked
                                     data_loader=loader)
            _train(module, optimizer, loader, int(options["steps"]))
        outcomes.append(run_outcome(auditor))
    return {"outcomes": outcomes}


def _fsdp_private(rank, world, *, noise_seed: int, noise_multiplier: float):
    """(module, optimizer, criterion, loader): the token classifier under FSDP2Wrapper and ghost_fsdp clipping, the
    same model on every rank, Poisson sampling over each rank's shard (a generator and noise of its own)."""
    import torch
    from ghost_setups import make_ghost, token_data, token_model
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    data = token_data()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    return make_ghost(module=FSDP2Wrapper(token_model(0)), dataset=data, sampler=sampler, batch_size=32,
                      seed=3 * (noise_seed * world + rank), noise_multiplier=noise_multiplier, grad_sample_mode="ghost_fsdp",
                      poisson_sampling=True)


def run_outcome(auditor) -> dict:
    """A finished run's outcome for bench/validity/false_alarms.py (the auditor detached): whether the alarm ever fired,
    the findings' codes, the run checks' findings (code, message, step) and status line, the audit's own failure."""
    from lightning_dpaudit.analysis.results import PIPELINE_CODES

    result = auditor.result()
    auditor.detach()
    return {"violation": bool(result.violation), "codes": sorted({f.code for f in result.findings}),
            "pipeline_findings": [[f.code, f.message, f.first_step] for f in result.findings if f.code in PIPELINE_CODES],
            "pipeline": result.pipeline, "data_path": result.data_path, "audit_failed": result.audit_failed,
            "steps": result.steps}


def plain_optimizer(rank, world, options):
    """make_private on an unwrapped module under a job of two processes: a plain DPOptimizer."""
    from lightning_dpaudit import PrivacyAuditor

    module, optimizer, loader, _ = _private(rank, world, wrap=False)
    raised = {}

    def alert(result):
        raised["message"] = result.violating_layers
        raise RuntimeError("alert")

    try:
        PrivacyAuditor(optimizer, seed=1, on_violation=alert)
    except RuntimeError as error:
        raised["error"] = str(error)
    return {"optimizer": type(optimizer).__name__, **raised}


def drift(rank, world, options):
    """One rank changes its parameters after step 12: the checksum every 10 steps finds it at step 21."""
    import torch

    from lightning_dpaudit import PrivacyAuditor

    module, optimizer, loader, _ = _private(rank, world)
    auditor = PrivacyAuditor(optimizer, seed=2, checksum_every=10)

    def perturb(step):
        if step == 12 and rank == world - 1:
            with torch.no_grad():
                next(module.parameters())[0, 0] += 1e-3

    _train(module, optimizer, loader, 25, on_step=perturb)
    return _summary(auditor)


def sample_rate(rank, world, options):
    """The accountant's sample rate from an unsharded loader (one rank's share), checked against the sharded loader."""
    from lightning_dpaudit import PrivacyAuditor

    answers = {}
    for sharded in (True, False):
        module, optimizer, loader, _ = _private(rank, world, sharded=sharded)
        auditor = PrivacyAuditor(optimizer, seed=4)
        auditor.check_sample_rate(len(_loader(rank, world)))
        answers["sharded" if sharded else "unsharded"] = _summary(auditor)
        auditor.detach()
    return answers


def disagreement(rank, world, options):
    """The last rank asks for other canaries than the rest: every rank refuses at attach."""
    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.engine.release.distributed import DistributedSetupError

    _, optimizer, _, _ = _private(rank, world)
    try:
        PrivacyAuditor(optimizer, canaries_per_step=512 if rank == world - 1 else 1024)
    except DistributedSetupError as error:
        return str(error)
    return None


def setups(rank, world, options):
    """The broken set-ups that need no canaries, in one job: plain optimizer, drift, sample rate, disagreement."""
    return {"plain_optimizer": plain_optimizer(rank, world, options), "drift": drift(rank, world, options),
            "sample_rate": sample_rate(rank, world, options), "disagreement": disagreement(rank, world, options)}


def main(scenarios: dict) -> None:
    """Run the scenario named on the command line, from `scenarios` (a module's globals), on this rank."""
    import torch

    scenario, out, options = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        answer = scenarios[scenario](rank, world, options)
        torch.distributed.barrier()  # no rank tears the group down while another still has work in it
    finally:
        torch.distributed.destroy_process_group()
    (out / f"{scenario}-rank{rank}.json").write_text(json.dumps(answer, default=float))
    # Leave without interpreter finalization: gloo's worker threads can still hold tensors whose
    # release at finalization aborts the process (SIGABRT, "terminate called without an active
    # exception") after all the work is done and written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(globals())
