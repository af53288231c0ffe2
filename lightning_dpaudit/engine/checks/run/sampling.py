"""Sampling: are the batches drawn as the accountant assumes (Poisson at its rate q, fresh every step)?

Three views, each alarming as finding `sampling`:

loader       the training loader's batch sampler against what the accountant composes: Opacus's
             Poisson sampler (UniformWithReplacementSampler, its distributed twin, under
             BatchMemoryManager's splitting wrapper or not) at the accountant's q. A torch
             BatchSampler (shuffled, in order, with replacement, by weight) draws fixed-size
             batches: certain at attach.
sizes        the batch sizes against Binomial(N, q) (estimators/batch_sizes.py; false-alarm budget
             SIZE_ALPHA over the whole run).
repeats      a batch equal to an earlier step's (fingerprints.py): under Poisson sampling two
             batches of k >= 2 records are equal with probability sum_k P(k)^2 / C(N, k), far
             below REPEAT_BOUND for any real dataset; the alarm is given only where the union over
             the run's pairs of steps stays below it.

Where the sampling used is shuffled fixed-size batches (each record in one batch per epoch),
a valid epsilon still exists without amplification by sampling: each epoch is one Gaussian
step per record, `epochs` steps at sample rate 1 composed by the run's accountant.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
from scipy.special import gammaln, logsumexp
from scipy.stats import binom

from ....estimators.batch_sizes import BatchSizeTest
from .base import DOES_NOT_DESCRIBE, RunCheck
from .fingerprints import BatchPrints, RepeatIndex
from .multiplicity import CODE as MULTIPLICITY

CODE = "sampling"
SIZE_ALPHA = 1e-6  # the batch-size test's false-alarm budget over a run
REPEAT_BOUND = 1e-9  # a batch repeat alarms only where Poisson sampling repeats a batch with less probability
RATE_RTOL = 1e-6


def describe_loader(loader, q: Optional[float]):
    """(kind, problem): kind "poisson", "shuffled", "replacement", "weighted", "ordered" or "unknown"; problem
    a sentence when the loader does not sample as the accountant assumes (None when it does or cannot tell)."""
    from opacus.utils.batch_memory_manager import BatchSplittingSampler
    from opacus.utils.uniform_sampler import DistributedUniformWithReplacementSampler, UniformWithReplacementSampler
    from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler, WeightedRandomSampler
    from torch.utils.data.distributed import DistributedSampler

    batch_sampler = getattr(loader, "batch_sampler", None)
    while isinstance(batch_sampler, BatchSplittingSampler):
        batch_sampler = batch_sampler.sampler
    if isinstance(batch_sampler, (UniformWithReplacementSampler, DistributedUniformWithReplacementSampler)):
        rate = float(batch_sampler.sample_rate)
        if q is not None and not math.isclose(rate, q, rel_tol=RATE_RTOL):
            return "poisson", (f"the loader's Poisson sampler draws each record with probability {rate:.6g}, the "
                               f"accountant composes {q:.6g}")
        return "poisson", None
    if not isinstance(batch_sampler, BatchSampler):
        return "unknown", None
    size, sampler = batch_sampler.batch_size, batch_sampler.sampler
    named = f"{type(sampler).__name__}"
    if isinstance(sampler, WeightedRandomSampler):
        kind, how = "weighted", f"fixed-size batches of {size} drawn by weight ({named})"
    elif isinstance(sampler, RandomSampler) and sampler.replacement:
        kind, how = "replacement", f"fixed-size batches of {size} drawn with replacement ({named}(replacement=True))"
    elif isinstance(sampler, (RandomSampler, DistributedSampler)):
        kind, how = "shuffled", f"shuffled fixed-size batches of {size} ({named}: a DataLoader never made private)"
    elif isinstance(sampler, SequentialSampler):
        kind, how = "ordered", f"fixed-size batches of {size} in the dataset's order ({named})"
    else:
        return "unknown", None
    return kind, f"the loader draws {how}, not Poisson sampling at q = {q:.4g}" if q else f"the loader draws {how}, not Poisson sampling"


def repeat_log_probability(expected: float, q: float, pairs: float) -> float:
    """log of a bound on the chance that Poisson sampling gives two equal batches of >= 2 records among `pairs`
    pairs of steps: pairs * sum_{k >= 2} P(k)^2 / C(N, k), N = expected / q."""
    n = max(2, int(round(expected / q)))
    k = range(2, n + 1)
    terms = [2 * binom.logpmf(i, n, q) - (gammaln(n + 1) - gammaln(i + 1) - gammaln(n - i + 1)) for i in k]
    return math.log(max(pairs, 1.0)) + float(logsumexp(terms))


def shuffled_epsilon(accountant, steps: int, batches_per_epoch: int, delta: float) -> float:
    """Epsilon at `delta` without amplification: ceil(steps / batches_per_epoch) Gaussian steps at sample rate 1,
    each at the smallest noise multiplier the run used, composed by an accountant of the run's own type."""
    history = getattr(accountant, "history", None)
    if not history or batches_per_epoch <= 0:
        return math.nan
    epochs = math.ceil(steps / batches_per_epoch)
    fresh = type(accountant)()
    fresh.history = [(min(float(entry[0]) for entry in history), 1.0, epochs)]
    return float(fresh.get_epsilon(delta=delta))


class SamplingCheck(RunCheck):
    name = "sampling"
    codes = (CODE,)

    def __init__(self):
        self.repeats = RepeatIndex()
        self.kind: Optional[str] = None  # what the loader draws, once it is known
        self.batches_per_epoch = 0
        self.sizes: Optional[BatchSizeTest] = None
        self.steps = 0
        self.seen_batches = 0
        self.duplicates = 0  # rows equal to another row of their batch
        self.found = False

    def attach(self, run) -> None:
        super().attach(run)
        # the fingerprints' own torch generator: seeded from the audit's seed (any size numpy takes), within torch's range
        seed = run.seed
        self.prints = BatchPrints(int(np.random.default_rng(None if seed is None else [seed, 29]).integers(2**62)))
        self.delta = run.delta
        q = self.rate()
        expected = getattr(run.optimizer, "expected_batch_size", None)
        if q is not None and expected:
            self.sizes = BatchSizeTest(float(expected), q, SIZE_ALPHA)

    def rate(self) -> Optional[float]:
        from ...release.distributed import sample_rate_of

        history = getattr(self.run.accountant, "history", None)
        return float(history[-1][1]) if history else sample_rate_of(self.run.optimizer)

    def loader(self, loader) -> None:
        self.kind, problem = describe_loader(loader, self.rate())
        try:
            self.batches_per_epoch = len(loader)
        except TypeError:
            self.batches_per_epoch = 0
        if problem is not None:
            self._found(f"{problem}; {self.actual_privacy()}", self.steps)

    def actual_privacy(self) -> str:
        if self.kind in ("shuffled", "ordered"):
            return ("each record is in one batch an epoch: without amplification by sampling the run is one Gaussian "
                    "step per record an epoch (`epsilon_sampling`)")
        if self.kind in ("replacement", "weighted"):
            return "a record can be drawn into any number of batches: no valid epsilon follows from the noise alone"
        return "the accountant's sample rate does not describe the batches"

    def epsilon(self) -> float:
        """Epsilon under the sampling the run used, where a valid bound exists (nan otherwise or where it is Poisson)."""
        if self.kind not in ("shuffled", "ordered") or not self.steps:
            return math.inf if self.kind in ("replacement", "weighted") else math.nan
        return shuffled_epsilon(self.run.accountant, self.steps, self.batches_per_epoch, self.delta)

    def epsilon_or_nan(self) -> float:
        """`epsilon()`, or nan once stopped or where the accountant cannot compose a fresh history (no figure
        rather than a fault)."""
        try:
            return math.nan if self.stopped else self.epsilon()
        except Exception:
            return math.nan

    def batch(self, batch) -> None:
        """A batch's tensors and its records, fingerprinted."""
        self.seen_batches += 1
        self.prints.add(batch.tensors, self.steps + 1, batch.records)
        if self.prints.due():
            self._read_prints()

    def step(self, seen) -> None:
        """The records of the step's batch (all its physical batches): from the loader, else the rows the optimizer
        clipped (one per record when the rows check finds nothing), against the sizes Poisson sampling gives."""
        self.steps = seen.step
        # the loader's records; the rows clipped only where no loader feeds the audit (where one does and its
        # records are unknown, the rows may not be records: no evidence about sampling)
        records = seen.records if seen.fed else seen.rows
        if self.sizes is not None and not self.found and records:
            refuted = self.sizes.add(records)
            if refuted:
                self._found(refuted, seen.step)

    def _read_prints(self) -> None:
        for p in self.prints.take():
            self.duplicates += p.records - p.distinct
            if p.distinct < 2 or self.found:
                continue
            earlier = self.repeats.seen(p)
            if earlier is not None and earlier != p.step and self._repeat_is_certain(p.step):
                self._found(f"the batch of step {p.step} holds exactly the records of step {earlier}'s: the sampler "
                            "repeats its draws (a generator re-seeded?), where Poisson sampling draws each step afresh",
                            p.step)

    def _repeat_is_certain(self, steps: int) -> bool:
        q = self.rate()
        expected = getattr(self.run.optimizer, "expected_batch_size", None)
        if not q or not expected or q >= 1:
            return False
        return repeat_log_probability(float(expected), q, steps * steps / 2.0) < math.log(REPEAT_BOUND)

    def _found(self, message: str, step: int) -> None:
        self.found = True
        self.run.report(CODE, f"{DOES_NOT_DESCRIBE}: {message}", max(step, 0))

    def flush(self) -> None:
        self._read_prints()

    def notes(self) -> list:
        """Rows equal to another row of their batch: duplicate records in the data, or copies."""
        self.flush()
        if not self.duplicates:
            return []
        return [(MULTIPLICITY, f"{self.duplicates} row(s) equal to another row of their batch: duplicate records in "
                 "the data, or copies (the claim is one record per person)")]

    def status(self) -> str:
        self.flush()
        loader = {None: "loader not seen", "unknown": "loader's sampler not recognised"}.get(self.kind, f"loader: {self.kind}")
        return f"sampling ({loader}; {self.seen_batches} batches fingerprinted)"
