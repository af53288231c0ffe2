"""Batch sizes against Poisson sampling: an anytime-valid test that sizes vary as Binomial(N, q) says.

Under Poisson sampling at rate q from N records, the steps' batch sizes X_1, X_2, ... are
independent Binomial(N, q). Take them in disjoint pairs (X_1, X_2), (X_3, X_4), ...: a pair is
equal with probability

    p_eq = sum_k P(X = k)^2,

so after n pairs the count K_n of equal pairs is Binomial(n, p_eq). Fixed-size batches (a
shuffled DataLoader, a sampler with replacement or by weight) make nearly every pair equal.
The test refutes Poisson sampling at pair n when P(Binomial(n, p_eq) >= K_n) <= alpha / (n (n + 1)):
the spent levels sum to alpha, so a run sampled as claimed is refuted with probability at most
alpha however long it runs (checked at every pair).

N is known only through the expected size m = N q: p_eq is taken at the smallest N whose
expected size is within one record of m, the largest p_eq of those (smaller variance), so an
inexact N only makes the test more cautious.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
from scipy.stats import binom

MIN_EXPECTED = 4.0  # below this expected batch size equal pairs are too common to tell anything


def equal_pair_probability(expected: float, q: float) -> float:
    """The largest P(X = X') for independent X, X' ~ Binomial(N, q) over the N with N q in [expected - 1, expected + 1]."""
    n = max(1, math.floor((expected - 1.0) / q))
    ks = np.arange(0, n + 1)
    return float(np.sum(binom.pmf(ks, n, q) ** 2))


class BatchSizeTest:
    """Feeds on one batch size per step; `refuted` is set (a sentence) once Poisson sampling is refuted."""

    def __init__(self, expected: float, q: float, alpha: float):
        self.expected, self.q, self.alpha = float(expected), float(q), float(alpha)
        self.usable = 0.0 < q < 1.0 and self.expected >= MIN_EXPECTED
        self.p_equal = equal_pair_probability(self.expected, q) if self.usable else 1.0
        self.pairs = 0
        self.equal = 0
        self.pending: Optional[int] = None
        self.sizes = set()  # the distinct sizes seen (at most a few hundred under Poisson; bounded below)
        self.refuted: Optional[str] = None

    def add(self, size: int) -> Optional[str]:
        """The next step's batch size; the refutation sentence at the pair that refutes, else None."""
        if not self.usable or self.refuted is not None:
            return None
        if len(self.sizes) < 64:
            self.sizes.add(int(size))
        if self.pending is None:
            self.pending = int(size)
            return None
        first, self.pending = self.pending, None
        self.pairs += 1
        if first != size:  # P(Binomial(n, p) >= K) grows with n at a fixed K: an unequal pair refutes nothing
            return None
        self.equal += 1
        level = self.alpha / (self.pairs * (self.pairs + 1))
        p_value = float(binom.sf(self.equal - 1, self.pairs, self.p_equal))
        if p_value <= level:
            seen = sorted(self.sizes)
            shown = ", ".join(map(str, seen[:6])) + (", ..." if len(seen) > 6 else "")
            self.refuted = (
                f"{self.equal} of {self.pairs} pairs of consecutive batches have equal sizes (sizes seen: {shown}), where "
                f"Poisson sampling at q = {self.q:.4g} (expected size {self.expected:.4g}) gives equal sizes with "
                f"probability {self.p_equal:.3f} (p = {p_value:.2g}): the batches are not drawn as the accountant assumes"
            )
        return self.refuted
