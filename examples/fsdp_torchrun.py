"""A plain PyTorch FSDP loop with Opacus ghost clipping, audited: one process per rank, started by torchrun.

    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/fsdp_torchrun.py [--steps 200] [--out dpaudit_runs] [--threads 1]

Opacus's FSDP2Wrapper shards every layer with FSDP2's fully_shard (here on a CPU device
mesh over gloo); make_private with grad_sample_mode="ghost_fsdp" then returns an
FSDPOptimizerFastGradientClipping and a criterion whose loss runs ghost clipping's two
backward passes. Each rank clips its own samples, FSDP's reduce-scatter sums them into
the rows each rank owns, and each rank adds the noise to its own rows. The data loader
has a DistributedSampler, so the accountant's sample rate is that of the whole batch;
make_private returns it Poisson-sampled (Opacus's distributed sampler), and each rank
iterates that loader and gives it to the auditor.
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
from opacus.utils.fsdp_utils import FSDP2Wrapper
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.analysis.report import write_report

VOCAB, LENGTH, WIDTH, CLASSES = 64, 8, 32, 4


class TokenClassifier(nn.Module):
    """Embeddings, one pre-norm attention block written with nn.Linear, a LayerNorm and a linear head."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(LENGTH, WIDTH)
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, idx):
        batch, length = idx.shape
        # positions as a (batch, length) input: Opacus reads dimension 0 of every input as the sample
        positions = torch.arange(length).expand(batch, length).contiguous()
        x = self.tokens(idx) + self.positions(positions)
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v))
        return self.head(self.norm2(x).mean(dim=1))


def token_data(n: int = 2048) -> TensorDataset:
    """Random token sequences; the class is the first token's, modulo CLASSES (a learnable rule)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    return TensorDataset(x, x[:, 0] % CLASSES)


def main(steps: int, out: str, bug: str = None) -> None:
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial model on every rank, before sharding
    model = FSDP2Wrapper(TokenClassifier())  # fully_shard on each layer and on the whole model
    data = token_data()
    model, optimizer, criterion, loader = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(data, batch_size=32, sampler=DistributedSampler(data, seed=0)),
        criterion=nn.CrossEntropyLoss(),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode="ghost_fsdp",
        noise_generator=torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1),
    )
    if bug:
        from lightning_dpaudit.testing import inject_bug

        inject_bug(optimizer, bug, module=model)
    auditor = PrivacyAuditor(optimizer, data_loader=loader, seed=0)  # the same seed on every rank

    done = 0
    while done < steps:
        for tokens, labels in loader:
            criterion(model(tokens), labels).backward()  # norms, then the clipped sum in this rank's shards
            optimizer.step()  # noise on this rank's rows, then the update
            optimizer.zero_grad()
            done += 1
            if done == steps:
                break

    result = auditor.result()
    if rank == 0:
        local = sum(p.to_local().numel() for p in model.parameters())  # DTensors: this rank's shards
        print(f"sharded: rank 0 holds {local:,} of {sum(p.numel() for p in model.parameters()):,} parameters "
              f"({type(optimizer).__name__})")
        print(result)  # the summary table `dpaudit report` prints
        paths = write_report(
            out, result, settings={"world_size": dist.get_world_size(), "sharding": "fsdp2"},
            versions={"torch": torch.__version__}, history=[], histogram=auditor.log.histogram(),
        )
        print("audit report:", *paths)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="dpaudit_runs/fsdp_torchrun")
    parser.add_argument("--bug", default=None, help="inject a bug-zoo bug (to see the audit catch it)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads in each process (default 1: the model is small, and the processes "
                        "share the cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # before any work, in each process
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"torch threads: {torch.get_num_threads()} per process (--threads)")
    with warnings.catch_warnings():
        # FSDP2 warns of outputs that are views, in case an in-place op follows; this loop makes none
        warnings.filterwarnings("ignore", message=".*(Full backward hook|Secure RNG|returned a view tensor).*")
        main(args.steps, args.out, args.bug)
