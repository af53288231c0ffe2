"""The audit of data-parallel DP-SGD: what the auditor needs from torch.distributed.

Opacus's DistributedDPOptimizer splits one DP-SGD step over W ranks: rank r clips its
own shard into S_r, rank 0 alone adds the noise N, and reduce_gradients all-reduces the
ranks' gradients, so every replica applies

    G = f * (S_0 + ... + S_{W-1} + N),    f = 1 / (B_rank * W) ("mean") or 1 ("sum").

The auditor reads the release where the replicas read it, after the reduction. Each
rank plants its share of the in-canaries (K_r) before its own add_noise, and one small
all-reduce per step sums the data's clipped sums and the canaries' sums at the pool
coordinates, so every rank centres G / f on the same sum S and observes
<w, G / f - S> for every canary: the same numbers on every rank, hence the same
AuditResult, and a bug anywhere between clipping and the reduced update is in view.
The same all-reduce carries how much noise each rank added (a DistributedDPOptimizer adds
it on rank 0 only). Every `checksum_every` steps the replicas' check (checks/mechanism/replicas.py)
compares per-tensor checksums of every replica's parameters in an all-reduce of its own
(replicas that drift apart train different models).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

# Opacus optimizers that add noise on rank 0 and reduce after add_noise
REDUCING_OPTIMIZERS = ("DistributedDPOptimizer", "SimpleDistributedPerLayerOptimizer",
                       "DistributedDPOptimizerFastGradientClipping")


class DistributedSetupError(RuntimeError):
    """The ranks of a distributed audit disagree about what they audit."""


def world_size() -> int:
    """Processes in the default group (1 without torch.distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _class_names(optimizer) -> set:
    return {c.__name__ for c in type(optimizer).__mro__}


def is_reducing(optimizer) -> bool:
    """True for an Opacus optimizer that noises on rank 0 and all-reduces after (DistributedDPOptimizer)."""
    return bool(_class_names(optimizer) & set(REDUCING_OPTIMIZERS))


def is_sharded(optimizer) -> bool:
    """True for Opacus's FSDP optimizer: every rank noises the shards it owns of the reduce-scattered sum."""
    return "FSDPOptimizerFastGradientClipping" in _class_names(optimizer)


def check_supported(optimizer) -> None:
    """Refuse the distributed optimizers the audit cannot read, with what to use instead."""
    names = _class_names(optimizer)
    if "DistributedPerLayerOptimizer" in names:
        raise TypeError(
            "DistributedPerLayerOptimizer noises and reduces each tensor inside backward hooks, where canaries "
            "cannot enter; use make_private(..., clipping='per_layer') with a DPDDP module, which gives a "
            "SimpleDistributedPerLayerOptimizer, or flat clipping"
        )


def unreconciled_noise_problem(optimizer) -> Optional[str]:
    """A plain DPOptimizer in a job of several processes: the mistake that breaks DP silently."""
    size = world_size()
    if size <= 1 or is_reducing(optimizer) or is_sharded(optimizer):
        return None
    return (
        f"{type(optimizer).__name__} runs in a job of {size} processes: each rank adds its own noise to its own "
        "shard's gradient and nothing reconciles them, so the replicas drift apart, and the accountant's sample "
        "rate is one rank's share of the batch, which makes the reported epsilon too low. Fix: wrap the model for "
        "DDP before make_private (make_private(module=trainer.strategy.model, ...) under Lightning's "
        "strategy='ddp', or module=DPDDP(model) in a plain loop), which gives a DistributedDPOptimizer, and give "
        "make_private a data loader with a DistributedSampler."
    )


def sample_rate_problem(sample_rate: float, batches_per_epoch: int, size: int) -> Optional[str]:
    """An accountant whose sample rate q ignores the world size.

    With a DistributedSampler every rank runs L = N / (W * b) steps an epoch over
    batches of b, so the true rate is W * b / N = 1 / L; make_private given a loader
    without one computes q = b / N = 1 / (W * L). q * L far below 1 means the
    accountant composes too small a sample rate.
    """
    if size <= 1 or not batches_per_epoch or not sample_rate:
        return None
    ratio = sample_rate * batches_per_epoch
    if ratio >= 0.75:
        return None
    return (
        f"the accountant's sample rate {sample_rate:.4g} is {ratio:.2f} x the rate of this run's batches "
        f"(1 / {batches_per_epoch} steps an epoch on each of {size} ranks): it counts one rank's share of the "
        "batch, so the accountant's epsilon is too low. Fix: give make_private the data loader with a "
        "DistributedSampler (the one each rank trains on)."
    )


def sample_rate_of(optimizer) -> Optional[float]:
    """The sample rate make_private handed the accountant's step hook (its `sample_rate` cell), if it can be read."""
    hook = getattr(optimizer, "step_hook", None)
    code = getattr(hook, "__code__", None)
    if code is None or "sample_rate" not in code.co_freevars:
        return None
    rate = hook.__closure__[code.co_freevars.index("sample_rate")].cell_contents
    return float(rate) if rate else None


class Collectives:
    """The few collectives of a distributed audit, on the default process group."""

    def __init__(self):
        self.rank = torch.distributed.get_rank()
        self.size = torch.distributed.get_world_size()
        backend = torch.distributed.get_backend()
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def agree_on_seed(self, seed: Optional[int]) -> int:
        """Rank 0's seed (drawn there when None) on every rank: all ranks draw the same canaries."""
        if seed is None:
            seed = int(np.random.SeedSequence().generate_state(1, dtype=np.uint32)[0]) if self.rank == 0 else 0
        value = torch.tensor([int(seed) % 2**62], dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(value, src=0)
        return int(value.item())

    def verify_same(self, values: np.ndarray, what: str) -> None:
        """Raise on every rank unless all ranks hold the same `values` (one all-reduce of max and -min)."""
        v = torch.as_tensor(np.asarray(values, dtype=np.float64), device=self.device)
        both = torch.cat([v, -v])
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
        high, low = both[: len(v)], -both[len(v):]
        if not torch.equal(high, low):
            differ = int(torch.argmax((high - low).abs()).item())
            raise DistributedSetupError(
                f"the ranks disagree about {what} (entry {differ}: {low[differ].item():.6g} .. {high[differ].item():.6g}); "
                "every rank must build the same model and the same audit (same settings, same seed)"
            )

    def sum(self, values: np.ndarray) -> np.ndarray:
        """Element-wise sum over ranks, in float64."""
        t = torch.as_tensor(np.ascontiguousarray(values, dtype=np.float64), device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        return t.cpu().numpy()

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any rank."""
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item() > 0)

    def own_slot(self, values: np.ndarray) -> np.ndarray:
        """(W, len(values)) with this rank's values in its row and zeros elsewhere: summed, every rank's row."""
        rows = np.zeros((self.size, len(values)))
        rows[self.rank] = values
        return rows.ravel()


def parameter_checksums(params) -> np.ndarray:
    """Per tensor: sum of values and sum of squares, in float64 (identical replicas give identical sums)."""
    out = np.empty(2 * len(params))
    with torch.no_grad():
        for i, p in enumerate(params):
            out[2 * i] = float(p.sum(dtype=torch.float64))
            out[2 * i + 1] = float(torch.linalg.vector_norm(p, dtype=torch.float64)) ** 2
    return out


def drifted_tensors(checksums_by_rank: np.ndarray, names) -> list:
    """Names of tensors whose checksums differ between ranks (rows: ranks)."""
    spread = checksums_by_rank.max(axis=0) - checksums_by_rank.min(axis=0)
    scale = np.abs(checksums_by_rank).max(axis=0) + 1e-12
    drifted = (spread > 1e-9 * scale).reshape(-1, 2).any(axis=1)
    return [names[i] for i in np.flatnonzero(drifted)]
