"""Gradient canaries: where they sit in the model's flat gradient and what they add.

A canary is a chosen per-sample gradient. Each one lives in one parameter tensor, on a
small support of coordinates drawn from a fixed pool, with a unit direction w over that
support. Its per-sample gradient is `scale * C_l * w`, where C_l is the tensor's
clipping bound (the optimizer's max_grad_norm for flat clipping) and `scale` (> 1 by
default) makes clipping act on it: a correct optimizer shrinks it to C_l * w.

Kinds (Tight Auditing, App. C.2):
    dirac     one coordinate (support 1)
    constant  equal values on `support` coordinates
    random    Gaussian values on `support` coordinates, normalized

"moving" canaries draw fresh coordinates every step; "static" ones keep theirs. Canaries
of one step never share a coordinate, so their observations are independent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...analysis.schema import Field, Section, StateError, check_field

KINDS = ("dirac", "constant", "random")
DEFAULT_POOL = 8192
BLOCK = 32  # steps of canaries drawn at once


@dataclass(frozen=True)
class StepCanaries:
    """The canaries of one noised step.

    tensor      (k,) parameter-tensor index of each canary
    coords      (k, support) flat coordinates inside that tensor
    pool_index  (k, support) the same coordinates as positions in the pool (all tensors' pools concatenated)
    weights     (k, support) unit direction of each canary over its support
    is_in       (k,) True where the canary enters the step (one-run design)
    """

    tensor: np.ndarray
    coords: np.ndarray
    pool_index: np.ndarray
    weights: np.ndarray
    is_in: np.ndarray


def choose_pool(tensor_sizes: Sequence[int], pool_size: int, rng: np.random.Generator) -> list:
    """A fixed random subset of coordinates, spread evenly over tensors (sorted, per tensor)."""
    sizes = np.asarray(tensor_sizes, dtype=int)
    quota = allocate(sizes, min(pool_size, int(sizes.sum())))
    return [np.sort(rng.choice(n, size=q, replace=False)) for n, q in zip(sizes, quota)]


def allocate(capacity: Sequence[int], total: int) -> np.ndarray:
    """Spread `total` canaries over tensors as evenly as their capacities allow."""
    capacity = np.asarray(capacity, dtype=int)
    if total > capacity.sum():
        raise ValueError(f"cannot place {total} canaries in tensors with room for {capacity.sum()}")
    quota = np.zeros_like(capacity)
    remaining = total
    open_ = capacity > 0
    while remaining > 0:
        share = max(remaining // int(open_.sum()), 1)
        for i in np.flatnonzero(open_):
            take = min(share, capacity[i] - quota[i], remaining)
            quota[i] += take
            remaining -= take
            if quota[i] == capacity[i]:
                open_[i] = False
            if remaining == 0:
                break
    return quota


POSITIONS = Field("positions", "array", dtype="int", low=0)
BLOCK_ENTRY = (POSITIONS, Field("weights", "array", dtype="real"), Field("is_in", "array", dtype="bool"))


def _block_entry(entry, ctx):
    """[pool positions (k, support), unit directions (k, support), is_in (k,)] of one drawn step."""
    if not isinstance(entry, (list, tuple)) or len(entry) != 3:
        return f"is not [positions, weights, is_in] ({type(entry).__name__} of {len(entry) if hasattr(entry, '__len__') else 1})"
    for f, value in zip(BLOCK_ENTRY, entry):
        try:
            check_field(f, value, f.name, ctx)
        except StateError as error:
            return f"{f.name} {error.problem}"
    positions, weights, is_in = (np.asarray(v) for v in entry)
    k = ctx.get("per_step", len(is_in))
    if positions.ndim != 2 or positions.shape != weights.shape or positions.shape[0] != k or is_in.shape != (k,):
        return (f"has positions {positions.shape}, weights {weights.shape} and is_in {is_in.shape}; expected (k, support) "
                f"twice and (k,), k = {k} canaries per step")
    if np.abs(np.linalg.norm(weights, axis=1) - 1.0).max(initial=0.0) > 1e-6:
        return "has weights that are not unit directions (each canary's weights have norm 1)"
    return None


def _pool(value, ctx):
    sizes = ctx.get("sizes")
    if sizes is None:
        return None
    if len(value) != len(sizes):
        return f"has {len(value)} tensors; the set-up has {len(sizes)}"
    for t, (coords, size) in enumerate(zip(value, sizes)):
        coords = np.asarray(coords)
        if coords.ndim != 1 or (coords.size and coords.max() >= size):
            return f"[{t}] holds coordinates up to {int(coords.max()) if coords.size else 0}; tensor {t} has {size} values"
    return None


def _sampler_rule(state, ctx):
    """Pool positions (block, static, order) lie in the saved pool, each tensor's order in its own part of it."""
    if "pool" not in state:
        return None
    lengths = [np.size(p) for p in state["pool"]]
    offsets, total = np.concatenate([[0], np.cumsum(lengths)]), int(sum(lengths))
    for i, entry in enumerate(state.get("block", [])):
        if np.size(entry[0]) and int(np.max(entry[0])) >= total:
            return f"block[{i}]", f"holds pool position {int(np.max(entry[0]))}; the pool has {total}"
    static = state.get("static")
    if static is not None and not _old_static(static) and np.size(static) and int(np.max(static)) >= total:
        return "static", f"holds pool position {int(np.max(static))}; the pool has {total}"
    for t, order in enumerate(state.get("order", [])):
        order = np.asarray(order)
        if t >= len(lengths) or (order.size and (order.min() < offsets[t] or order.max() >= offsets[t + 1])):
            return f"order[{t}]", f"holds positions outside tensor {t}'s part of the pool"
    return None


def _old_static(static) -> bool:
    """0.1.0 saved static canaries as (tensor of each canary, positions)."""
    return isinstance(static, (list, tuple)) and len(static) == 2


def _static(value, ctx):
    if _old_static(value):
        value = value[1]
    try:
        check_field(POSITIONS, value, "static", ctx)
    except StateError as error:
        return error.problem
    return None


# The sampler's state (ctx: "sizes" per tensor, "per_step"); `load_state_dict` reads a state SAMPLER.check passed.
SAMPLER = Section(
    "sampler",
    Field("rng", "map"),  # a numpy bit generator's state: numpy checks it when it is set
    Field("static", "any", null=True, rule=_static),
    Field("pool", "list", items=Field("coordinates", "array", dtype="int", low=0), rule=_pool, optional=True),
    Field("order", "list", items=POSITIONS, optional=True),
    Field("block", "list", items=Field("step", "any", rule=_block_entry), optional=True),  # 0.1.0: none
    Field("block_all_in", "bool", optional=True),
    rules=(_sampler_rule,),
)


class CanarySampler:
    """Draws each step's canaries from its own numpy Generator."""

    def __init__(
        self,
        tensor_sizes: Sequence[int],
        *,
        kind: str,
        per_step: int,
        moving: bool,
        support: int,
        rng: np.random.Generator,
        pool_size: int = DEFAULT_POOL,
    ):
        if kind not in KINDS:
            raise ValueError(f"Unexpected value for `canary`: {kind!r}; valid kinds are {', '.join(KINDS)}")
        self.kind = kind
        self.support = 1 if kind == "dirac" else int(support)
        self.per_step = int(per_step)
        self.moving = moving
        self.rng = rng
        sizes = np.asarray(tensor_sizes, dtype=int)
        total_coords = int(sizes.sum())
        if self.per_step * self.support > total_coords:
            raise ValueError(
                f"`canaries_per_step`={per_step} with support {self.support} needs "
                f"{self.per_step * self.support} coordinates; the optimizer has {total_coords} parameters"
            )
        pool_size = max(pool_size, self.per_step * self.support)
        self.pool = choose_pool(sizes, pool_size, rng)
        pool_quota = np.array([len(p) for p in self.pool])
        self.pool_offsets = np.concatenate([[0], np.cumsum(pool_quota)])
        self._pool_local = np.concatenate(self.pool)
        self.quota = allocate(pool_quota // self.support, self.per_step)
        self._static = None
        self._order = [np.zeros(0, dtype=int) for _ in self.pool]  # per tensor: pool positions still to visit
        self._layout = np.repeat(np.arange(len(self.quota)), self.quota)
        self._block: list = []  # drawn steps not yet handed out
        self._block_all_in = False

    @property
    def pool_size(self) -> int:
        return int(self.pool_offsets[-1])

    def next_step(self, *, all_in: bool = False) -> StepCanaries:
        """Canaries for the next noised step: half in, half out unless all_in.

        Steps are drawn BLOCK at a time (one vectorized draw) and handed out one by one.
        """
        return self.canaries_of(self.hand_out(all_in=all_in))

    def hand_out(self, *, all_in: bool = False) -> tuple:
        """The next noised step's entry of `upcoming` (positions, weights, is_in), taken out of the block; the
        canaries of a step whose entry was planned already need not be built again (canary_plan.py)."""
        return self.upcoming(all_in=all_in).pop(0)

    def upcoming(self, *, all_in: bool = False) -> list:
        """The drawn steps not yet handed out, (positions, weights, is_in) each, the next step's first: the rest
        of the current block, or a new block when it is used up (or drawn for the other all_in)."""
        if not self._block or self._block_all_in != all_in:
            self._block = self._draw_block(BLOCK, all_in)
            self._block_all_in = all_in
        return self._block

    def canaries_of(self, entry) -> StepCanaries:
        """The StepCanaries of one entry of `upcoming`."""
        positions, weights, is_in = entry
        return StepCanaries(self._layout, self._pool_local[positions], positions, weights, is_in)

    def _draw_block(self, steps: int, all_in: bool) -> list:
        """(positions, weights, is_in) for `steps` steps: placements, then in/out, then directions."""
        k = len(self._layout)
        if self.moving or self._static is None:
            placed = np.concatenate([self._take(t, q, steps) for t, q in enumerate(self.quota) if q], axis=1)
            if not self.moving:
                self._static = placed[0]
                placed = np.broadcast_to(self._static, (steps, *self._static.shape))
        else:
            placed = np.broadcast_to(self._static, (steps, *self._static.shape))
        is_in = np.ones((steps, k), dtype=bool)
        if not all_in:
            smallest = np.argpartition(self.rng.random((steps, k)), k // 2 - 1, axis=1)[:, : k // 2]  # a random half
            is_in[:] = False
            np.put_along_axis(is_in, smallest, True, axis=1)
        if self.kind == "random":
            w = self.rng.standard_normal((steps, k, self.support))
            w /= np.linalg.norm(w, axis=2, keepdims=True)
        else:
            w = np.full((steps, k, self.support), 1.0 / np.sqrt(self.support))
        return [(np.array(placed[i]), w[i], is_in[i]) for i in range(steps)]

    def _take(self, t: int, q: int, steps: int) -> np.ndarray:
        """(steps, q, support) pool positions of tensor t, distinct within each step.

        The tensor walks through random permutations of its pool, a fresh one when fewer
        than a step's positions are left, so moving canaries visit every pool coordinate
        before revisiting one.
        """
        take = q * self.support
        order = self._order[t]
        usable = min(len(order) // take, steps)
        parts = [order[: usable * take].reshape(usable, take)]
        order = order[usable * take :]
        need = steps - usable
        if need:
            lo, hi = self.pool_offsets[t], self.pool_offsets[t + 1]
            per_perm = (hi - lo) // take
            perms = lo + np.argsort(self.rng.random((-(-need // per_perm), hi - lo)), axis=1)
            parts.append(perms[:, : per_perm * take].reshape(-1, take)[:need])
            order = perms[-1, (need - (len(perms) - 1) * per_perm) * take :]
        self._order[t] = order
        return np.concatenate(parts).reshape(steps, q, self.support)

    def state_dict(self) -> dict:
        return SAMPLER.dump({
            "rng": self.rng.bit_generator.state,
            "static": self._static,
            "pool": [p.copy() for p in self.pool],
            "order": [o.copy() for o in self._order],
            "block": [[p.copy(), w.copy(), i.copy()] for p, w, i in self._block],
            "block_all_in": self._block_all_in,
        })

    def load_state_dict(self, state: dict) -> None:
        """A state SAMPLER.check passed (the auditor checks the whole state before loading any part)."""
        self.rng.bit_generator.state = state["rng"]
        static = state.get("static")
        if _old_static(static):  # 0.1.0 saved (tensor of each canary, positions)
            static = np.asarray(static[1], dtype=int)
        self._static = static
        if "pool" in state:
            self.pool = [np.asarray(p) for p in state["pool"]]
            self._pool_local = np.concatenate(self.pool)
        if "order" in state:
            self._order = [np.asarray(o, dtype=int) for o in state["order"]]
        self._block = [(np.asarray(p, dtype=int), np.asarray(w, dtype=float), np.asarray(i, dtype=bool))
                       for p, w, i in state.get("block", [])]  # a state of 0.1.0 has none: the next step draws
        self._block_all_in = bool(state.get("block_all_in", False))
