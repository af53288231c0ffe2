"""A plain PyTorch DDP loop with Opacus, audited: one process per rank, started by torchrun.

    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/ddp_torchrun.py [--steps 200] [--out dpaudit_runs] [--threads 1]

DPDDP (or DistributedDataParallel) around the model before make_private gives a
DistributedDPOptimizer: rank 0 adds the noise, the ranks' clipped sums are all-reduced
after it. The data loader given to make_private has a DistributedSampler, so the
accountant's sample rate is that of the whole batch. The noise has its own generator.
Every rank builds the same PrivacyAuditor (same seed) and ends with the same result;
rank 0 prints it and writes the report.

--threads N sets torch's intra-op threads in each process before any work (default 1: the
model is small, and the processes share the cores; more threads wait for each other).
"""

import argparse
import os
import warnings

import torch
import torch.distributed as dist
from opacus import PrivacyEngine
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from torch.utils.data import DataLoader, DistributedSampler, random_split

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.analysis.report import write_report
from lightning_dpaudit.datasets import DigitsCNN, digits_dataset


def main(steps: int, out: str, bug: str = None) -> None:
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial model on every rank (DPDDP also broadcasts rank 0's)
    full = digits_dataset()
    train_set, _ = random_split(full, [1500, len(full) - 1500], torch.Generator().manual_seed(0))
    model = DPDDP(DigitsCNN())
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(train_set, batch_size=64, sampler=DistributedSampler(train_set)),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        noise_generator=torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1),
    )
    if bug:
        from lightning_dpaudit.testing import inject_bug

        inject_bug(optimizer, bug)
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=0)  # the same seed on every rank

    done = 0
    while done < steps:
        for images, labels in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
            done += 1
            if done == steps:
                break

    result = auditor.result()
    if rank == 0:
        print(result)  # the summary table `dpaudit report` prints
        paths = write_report(
            out, result, settings={"world_size": dist.get_world_size()}, versions={"torch": torch.__version__},
            history=[], histogram=auditor.log.histogram(),
        )
        print("audit report:", *paths)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="dpaudit_runs/ddp_torchrun")
    parser.add_argument("--bug", default=None, help="inject a bug-zoo bug (to see the audit catch it)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads in each process (default 1: the model is small, and the processes "
                        "share the cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # before any work, in each process
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"torch threads: {torch.get_num_threads()} per process (--threads)")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Full backward hook|Secure RNG).*")
        main(args.steps, args.out, args.bug)
