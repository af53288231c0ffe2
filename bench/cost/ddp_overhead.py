"""Overhead of the auditor under DDP: the same training with and without it, alternating, on 2 gloo processes.

Digits CNN wrapped in DPDDP (a DistributedDPOptimizer), `--batch-size` examples per rank
and step. Each process holds two replicas of the run, one audited and one not, and
times them in alternating rounds of `--steps` steps (order swapped every round), so
machine noise hits both alike; the ratio of the median round times is reported. The
same measurement on one process (world size 1) is printed beside it.

    .venv/bin/python bench/cost/ddp_overhead.py [--steps 50] [--rounds 6] [--batch-size 64]
"""

import datetime
import os
import socket
import time
import warnings

from _path import harness

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _replica(batch_size, audited):
    from opacus import PrivacyEngine
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.integrations.digits import DigitsCNN, digits_dataset

    torch.manual_seed(0)
    data = digits_dataset()
    model = DPDDP(DigitsCNN())
    model, optimizer, _ = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data)),
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
    )
    if audited:
        PrivacyAuditor(optimizer, seed=0)
    loader = DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data, shuffle=False))
    return model, optimizer, list(loader)


def _round(replica, steps):
    model, optimizer, batches = replica
    start = time.perf_counter()
    for i in range(steps):
        x, y = batches[i % len(batches)]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return time.perf_counter() - start


def _worker(rank, world, port, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    plain, audited = _replica(args.batch_size, False), _replica(args.batch_size, True)
    _round(plain, 5), _round(audited, 5)  # warm-up
    runs = {"plain": lambda _: _round(plain, args.steps), "audited": lambda _: _round(audited, args.steps)}
    times = harness.alternate(runs, args.rounds, swap=True, before=dist.barrier)  # both ranks start each run together
    if rank == 0:
        results.put((world, times))
    dist.destroy_process_group()


def main():
    parser = harness.parser(__doc__, steps=50, rounds=6, batch_size=64)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    rows = {}
    for world in (2, 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_worker, args=(world, port, args, results), nprocs=world, start_method="spawn")
        w, times = results.get()
        rows[w] = harness.medians(times)
    print(f"steps/round={args.steps} rounds={args.rounds} batch/rank={args.batch_size} threads/process=1 canaries=auto")
    print(harness.header("processes", "plain ms/step", "audited ms/step", "audited / plain"))
    for w in (2, 1):
        p, a = rows[w]["plain"], rows[w]["audited"]
        print(f"| {w} | {1000 * p / args.steps:.2f} | {1000 * a / args.steps:.2f} | {a / p:.2f} |")


if __name__ == "__main__":
    main()
