"""Noise freshness: find steps whose noise repeats an earlier step's, or its negation, at any distance.

Each step the auditor measures the noise on a fixed set of `bits` sentinel coordinates
(released update minus the data's clipped sum minus the canaries' known contribution).
The step's fingerprint is the sign pattern of that noise, packed into `bits / 64`
unsigned 64-bit words: 16 bytes per step for the default 128 bits, however long the run.
A step matches an earlier one when their fingerprints differ in at most `h(t)` signs.

Signs are fair, independent coins. Under a correct optimizer the sentinel noise of a
step is a fresh draw of independent N(0, s^2) values, independent of all earlier steps.
A centred Gaussian is symmetric and puts no mass on 0, so each sign is positive with
probability exactly 1/2, independently across coordinates, whatever the scale `s` (which
may change from step to step). The fingerprint F_t of the t-th recorded step is
therefore uniform on {0, 1}^bits and independent of F_1, ..., F_{t-1}; for any j < t,
F_t xor F_j is uniform too, so the Hamming distance d(F_t, F_j) is exactly
Binomial(bits, 1/2), and so is d(not F_t, F_j), the distance to the negated noise's signs.

Union bound, valid at every step. At the t-th recorded step there are t - 1 earlier
fingerprints, each compared with F_t and with its negation. The threshold h(t) is the
largest h with

    2 (t - 1) * P[Binomial(bits, 1/2) <= h] <= alpha * 6 / (pi^2 t^2),

so under fresh noise a false match at step t has probability at most
alpha * 6 / (pi^2 t^2). These budgets sum to alpha over t = 1, 2, ... (sum 1/t^2 =
pi^2 / 6), hence the probability that a correct run reports any match, ever, is at most
alpha. The thresholds depend only on t, never on the data, and the bound covers the
whole unbounded run at once: reading `matches` after every step and stopping at any
time does not raise it. `t` counts recorded steps, so gaps in the step labels the
caller passes do not matter. For 128 bits and alpha = 1e-6, h(t) is 29 at t = 10, 19 at
t = 10^3, 12 at t = 10^5 and 9 at t = 10^6.

Band index. Comparing with every earlier step would cost O(t) per step. The fingerprint
is cut into 32-bit bands (4 for 128 bits); for each band an open-addressing hash table
maps a band value to the earliest recorded step having it (4 bytes a slot, kept at most
half full). The negation is looked up with the complemented bands, without being
inserted. Only the steps found through some band are compared in full. This only
removes comparisons: every reported match still has d <= h(t), so the false-match bound
above holds unchanged. Under fresh noise two steps share a band with probability
2^-32, so candidates are rare and a lookup is O(1).

What is found. Replayed noise c * z (c > 0), up to float rounding, has the same signs
except where a value is within rounding of zero, so d is tiny. A replay is found when
one band is unchanged: always if fewer signs flipped than there are bands (pigeonhole),
and otherwise with probability about 1 - (1 - (1 - p)^32)^bands for a flip rate p.
Noise negated on replay (c < 0) flips every sign and is found the same way, as a
negated repeat (`first_negated`); noise only partly
reused is rarely matched (correlation 0.99 with an earlier step is found about 60% of
the time, 0.95 about 12%, 0.9 about 4%): that is the correlation test's
(noise_correlation.py), within its window of recent steps.

Memory. The saved state is the fingerprints (bits / 8 bytes a step) plus the step
labels, stored as arithmetic runs of 24 bytes (one run in all when the recorded steps
are evenly spaced; every run but the last holds two steps at least, so at most 12 bytes
a step plus one run). The index is rebuilt from the fingerprints on load and adds 8 to 16
bytes a step per band in memory.
"""

from __future__ import annotations

import bisect
import math
import operator
from typing import Optional

import numpy as np
from scipy.stats import binom

from .schema import Field, Section

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_GOLDEN = 0x9E3779B97F4A7C15  # multiplicative hashing constant (2^64 / golden ratio, odd)
_MIN_SLOTS = 1024


def _pair_field(name: str) -> Field:
    return Field(name, "list", null=True, optional=True, since=2, items=Field("step", "int", low=0), most=2,
                 rule=lambda v, ctx: None if len(v) == 2 else f"is {list(v)!r}; expected (step, earlier step)")


# The noise-repeat test's state (`load_state_dict` reads a state FINGERPRINTS.check passed). An audit state of
# format 2 holds every field (since=2); the optional ones are absent only from 0.1.0 states.
FINGERPRINTS = Section(
    "fingerprints",
    Field("bits", "int", low=64, rule=lambda v, ctx: None if v == ctx.get("sentinels", v) else
          f"is {v}; this audit fingerprints {ctx['sentinels']} sentinel coordinates"),
    Field("alpha", "real", low=0.0, high=1.0),
    Field("fingerprints", "array", dtype="int", low=0),
    Field("step_runs", "array", dtype="int"),
    Field("matches", "int", low=0, optional=True, since=2),
    _pair_field("first_repeat"), _pair_field("last_repeat"),
    Field("first_negated", "bool", optional=True, since=2), Field("last_negated", "bool", optional=True, since=2),
)


class NoiseFingerprints:
    """Sign fingerprints of each step's sentinel noise; reports steps that repeat one."""

    BAND_BITS = 32

    def __init__(self, bits: int = 128, *, alpha: float = 1e-6):
        bits = operator.index(bits)
        if bits < 64 or bits % 64:
            raise ValueError(f"bits must be a positive multiple of 64, got {bits}")
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        self.bits = bits
        self.alpha = float(alpha)
        self.words = bits // 64
        self.bands = bits // self.BAND_BITS
        logcdf = binom.logcdf(np.arange(bits + 1), bits, 0.5)
        self._logcdf = np.asarray(logcdf, dtype=np.float64)
        self._logcdf_list = self._logcdf.tolist()
        self._log_alpha = math.log(self.alpha * 3.0 / math.pi**2)  # 6 / pi^2, halved: a step and its negation
        self._ones = (1 << bits) - 1
        self._reset()

    # ----------------------------------------------------------------- thresholds

    def threshold(self, t):
        """h(t): largest Hamming distance accepted as a match at the t-th recorded step.

        Accepts an int or an integer array. -1 means no distance is accepted. For t = 1
        there is nothing to compare with and h = bits.
        """
        t_arr = np.asarray(t, dtype=np.float64)
        if np.any(t_arr < 1):
            raise ValueError("t counts recorded steps and starts at 1")
        with np.errstate(divide="ignore"):
            log_budget = self._log_alpha - 2.0 * np.log(t_arr) - np.log(t_arr - 1.0)
        h = np.searchsorted(self._logcdf, log_budget, side="right") - 1
        return int(h) if np.ndim(h) == 0 else h

    def _threshold_at(self, t: int) -> int:
        if t == 1:
            return self.bits
        log_budget = self._log_alpha - 2.0 * math.log(t) - math.log(t - 1)
        return bisect.bisect_right(self._logcdf_list, log_budget) - 1

    # ----------------------------------------------------------------- checking

    def fingerprint(self, noise: np.ndarray) -> int:
        """The sign pattern of `noise` as an integer: bit `bits - 1 - i` is set when noise[i] > 0.

        Band b (bits 32 b to 32 b + 31) holds the signs of 32 consecutive coordinates.
        """
        noise = np.asarray(noise)
        if noise.shape != (self.bits,):
            raise ValueError(f"expected noise of shape ({self.bits},), got {noise.shape}")
        if not math.isfinite(noise.sum(dtype=np.float64)) and not np.isfinite(noise).all():
            raise ValueError("noise has non-finite values")
        return int.from_bytes(np.packbits(noise > 0).tobytes(), "big")

    def check(self, noise: np.ndarray, step: int) -> Optional[int]:
        """Record this step's noise; return the earliest earlier step it repeats, or None.

        `step` labels the step and must increase from call to call.
        """
        step = operator.index(step)
        if self._n and step <= self._last_step:
            raise ValueError(f"step {step} does not follow the last recorded step {self._last_step}")
        fp = self.fingerprint(noise)
        negative = fp ^ self._ones
        h = self._threshold_at(self._n + 1)
        found, negated, free_slots = -1, False, []
        for b in range(self.bands):
            key = (fp >> (self.BAND_BITS * b)) & _M32
            row, slot = self._probe(b, key)
            free_slots.append(slot if row < 0 else -1)
            if row >= 0 and (found < 0 or row < found) and (fp ^ self._row_int(row)).bit_count() <= h:
                found, negated = row, False
            row, _ = self._probe(b, key ^ _M32)  # the band of the negated noise
            if row >= 0 and (found < 0 or row < found) and (negative ^ self._row_int(row)).bit_count() <= h:
                found, negated = row, True
        row = self._append(fp, step)
        for b, slot in enumerate(free_slots):
            if slot >= 0:
                self._tables[b, slot] = row
                self._entries[b] += 1
        if 2 * max(self._entries) > self._tables.shape[1]:
            self._rebuild_index()
        if found < 0:
            return None
        earlier = self._step_of(found)
        self.matches += 1
        self.last_repeat, self.last_negated = (step, earlier), negated
        if self.first_repeat is None:
            self.first_repeat, self.first_negated = self.last_repeat, negated
        return earlier

    def _probe(self, b: int, key: int) -> tuple:
        """(earliest row whose band b is `key`, or -1; the slot it is in, or the free slot that ends the probe)."""
        table, mask = self._tables[b], self._mask
        slot = ((key * _GOLDEN) & _M64) >> self._shift
        while True:
            row = int(table[slot])
            if row < 0 or self._band(row, b) == key:
                return row, slot
            slot = (slot + 1) & mask

    def __len__(self) -> int:
        return self._n

    # ----------------------------------------------------------------- storage

    def _reset(self) -> None:
        self._fp = np.zeros((64, self.words), dtype=np.uint64)
        self._n = 0
        # step labels as arithmetic runs: (first row, its step, stride; 0 while unknown)
        self._step_runs = np.zeros((8, 3), dtype=np.int64)
        self._runs = 0
        self._stride = 0
        self._last_step = 0
        self.matches = 0
        self.first_repeat: Optional[tuple[int, int]] = None
        self.last_repeat: Optional[tuple[int, int]] = None
        self.first_negated = self.last_negated = False  # the repeat is of the negated noise
        self._set_slots(_MIN_SLOTS)

    def _set_slots(self, slots: int) -> None:
        self._tables = np.full((self.bands, slots), -1, dtype=np.int32)
        self._mask = slots - 1
        self._shift = 64 - (slots.bit_length() - 1)
        self._entries = [0] * self.bands

    def _append(self, fp: int, step: int) -> int:
        row = self._n
        if row == len(self._fp):
            self._fp = _grown(self._fp, 2 * row)
        for w in range(self.words):
            self._fp[row, w] = (fp >> (64 * w)) & _M64
        if row and self._stride == 0:  # second step of the run fixes its stride
            self._stride = step - self._last_step
            self._step_runs[self._runs - 1, 2] = self._stride
        elif row == 0 or step - self._last_step != self._stride:
            if self._runs == len(self._step_runs):
                self._step_runs = _grown(self._step_runs, 2 * self._runs)
            self._step_runs[self._runs] = (row, step, 0)
            self._runs += 1
            self._stride = 0
        self._last_step = step
        self._n = row + 1
        return row

    def _row_int(self, row: int) -> int:
        words = self._fp[row]
        return sum(int(words[w]) << (64 * w) for w in range(self.words))

    def _band(self, row: int, b: int) -> int:
        return (int(self._fp[row, b >> 1]) >> (self.BAND_BITS * (b & 1))) & _M32

    def _step_of(self, row: int) -> int:
        run = int(np.searchsorted(self._step_runs[: self._runs, 0], row, side="right")) - 1
        first_row, first_step, stride = (int(v) for v in self._step_runs[run])
        return first_step + (row - first_row) * stride

    def _rebuild_index(self) -> None:
        """Rebuild the band tables from the recorded fingerprints, a quarter to half full."""
        fps = self._fp[: self._n]
        firsts = []
        for b in range(self.bands):
            keys = (fps[:, b >> 1] >> np.uint64(self.BAND_BITS * (b & 1))) & np.uint64(_M32)
            uniq, first = np.unique(keys, return_index=True)  # earliest row per band value
            firsts.append((uniq, first))
        most = max((len(u) for u, _ in firsts), default=0)
        slots = max(_MIN_SLOTS, 1 << (2 * most + 1).bit_length())
        self._set_slots(slots)
        for b, (uniq, first) in enumerate(firsts):
            self._fill(self._tables[b], uniq, first.astype(np.int32))
            self._entries[b] = len(uniq)

    def _fill(self, table: np.ndarray, keys: np.ndarray, rows: np.ndarray) -> None:
        """Linear-probing insertion of distinct keys, all at once.

        Each round, the pending keys whose slot is empty take it (one per slot) and the
        others move one slot on; a key only passes occupied slots, as in one-by-one
        insertion, so lookups from its home slot reach it.
        """
        pos = ((keys * np.uint64(_GOLDEN)) >> np.uint64(self._shift)).astype(np.int64)
        pending = np.arange(len(keys))
        while len(pending):
            free = table[pos] < 0
            _, winners = np.unique(np.where(free, pos, -1), return_index=True)
            winners = winners[free[winners]]
            table[pos[winners]] = rows[pending[winners]]
            keep = np.ones(len(pending), dtype=bool)
            keep[winners] = False
            pending, pos = pending[keep], (pos[keep] + 1) & self._mask

    # ----------------------------------------------------------------- state

    def state_dict(self) -> dict:
        """Plain values and numpy arrays; the band index is not saved."""
        return FINGERPRINTS.dump({
            "bits": self.bits,
            "alpha": self.alpha,
            "fingerprints": self._fp[: self._n].copy(),
            "step_runs": self._step_runs[: self._runs].copy(),
            "matches": self.matches,
            "first_repeat": self.first_repeat,
            "last_repeat": self.last_repeat,
            "first_negated": self.first_negated,
            "last_negated": self.last_negated,
        })

    def load_state_dict(self, state: dict) -> None:
        """Replace this object's history by a saved one and rebuild the index.

        `alpha` stays the one this object was built with (a run resumed with another
        alpha has a false-match probability at most the larger of the two).
        """
        if int(state["bits"]) != self.bits:
            raise ValueError(f"state has {state['bits']} bits, this object {self.bits}")
        fps = np.asarray(state["fingerprints"], dtype=np.uint64).reshape(-1, self.words)
        step_runs = np.asarray(state["step_runs"], dtype=np.int64).reshape(-1, 3)
        if (len(fps) > 0) != (len(step_runs) > 0):
            raise ValueError("inconsistent step labels in state")
        self._reset()
        n = len(fps)
        self._fp = _grown(fps, max(64, n))
        self._n = n
        self._step_runs = _grown(step_runs, max(8, len(step_runs)))
        self._runs = len(step_runs)
        if n:
            self._stride = int(step_runs[-1, 2])
            self._last_step = self._step_of(n - 1)
        self.matches = int(state.get("matches", 0))
        self.first_repeat = _pair(state.get("first_repeat"))
        self.last_repeat = _pair(state.get("last_repeat"))
        self.first_negated = bool(state.get("first_negated", False))
        self.last_negated = bool(state.get("last_negated", False))
        self._rebuild_index()

    def memory_bytes(self) -> dict:
        """Bytes held: saved arrays (fingerprints, step labels), index, and all allocated."""
        fingerprints = self._n * self.words * 8
        labels = self._runs * 24
        index = self._tables.nbytes
        allocated = self._fp.nbytes + self._step_runs.nbytes + index
        per_step = 1.0 / max(self._n, 1)
        return {
            "fingerprints": fingerprints,
            "step_labels": labels,
            "index": index,
            "allocated": allocated,
            "saved_per_step": (fingerprints + labels) * per_step,
            "allocated_per_step": allocated * per_step,
        }


def _grown(array: np.ndarray, length: int) -> np.ndarray:
    out = np.zeros((length,) + array.shape[1:], dtype=array.dtype)
    out[: len(array)] = array
    return out


def _pair(value) -> Optional[tuple[int, int]]:
    return None if value is None else (int(value[0]), int(value[1]))
