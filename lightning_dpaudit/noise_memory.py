"""Noise freshness: predict this step's noise from earlier steps when it repeats.

DP-SGD must draw fresh noise every step. Canaries at fresh coordinates cannot see noise
that repeats across steps: each draw still looks Gaussian. The auditor therefore keeps
the noise it measured at a fixed pool of coordinates over the last `capacity` steps. At a
new step it correlates the current noise on `probes` sentinel coordinates of the pool
(those without a canary this step) with each stored vector. If the best match exceeds
`min_correlation` (a correct run's correlations are about N(0, 1/probes) and never come
near it), the stored vector, scaled by least squares, predicts the noise at the canary
coordinates, and the prediction is subtracted from the observations.

Validity: the match and its scale depend only on earlier steps and on coordinates the
canaries do not touch; with fresh isotropic Gaussian noise those are independent of the
canaries' coordinates, so the adjusted observation is a post-processing of the step's
output and the bound stays valid. With repeated noise the adjusted observations lose
their noise, and the bound exposes the leak.
"""

from __future__ import annotations

import numpy as np


class NoiseMemory:
    def __init__(self, pool_size: int, *, capacity: int = 512, probes: int = 256, min_correlation: float = 0.5):
        self.capacity = int(capacity)
        self.min_correlation = float(min_correlation)
        self.probes = np.linspace(0, pool_size - 1, min(probes, pool_size)).astype(int)
        self.vectors = np.zeros((self.capacity, pool_size), dtype=np.float32)
        self.sentinels = np.zeros((self.capacity, len(self.probes)), dtype=np.float32)
        self.sentinel_sq = np.zeros(self.capacity, dtype=np.float64)
        self.count = 0
        self.matches = 0

    def predict(self, noise: np.ndarray, canary_positions: np.ndarray) -> np.ndarray:
        """Predicted noise on the pool (zeros when no earlier step matches)."""
        stored = min(self.count, self.capacity)
        if stored == 0:
            return np.zeros_like(noise)
        current = noise[self.probes].astype(np.float32)
        carrying = np.zeros(noise.shape[0], dtype=bool)
        carrying[canary_positions.ravel()] = True
        busy = carrying[self.probes]  # sentinels that carry a canary now
        current[busy] = 0.0
        history = self.sentinels[:stored]
        dots = history @ current
        sq = self.sentinel_sq[:stored] - np.sum(history[:, busy].astype(np.float64) ** 2, axis=1)
        norms = np.sqrt(np.maximum(sq, 0.0)) * np.linalg.norm(current)
        with np.errstate(invalid="ignore", divide="ignore"):
            corr = np.where(norms > 0, dots / norms, 0.0)
        best = int(np.argmax(corr))
        if corr[best] < self.min_correlation:
            return np.zeros_like(noise)
        self.matches += 1
        scale = dots[best] / max(float(sq[best]), 1e-30)
        return scale * self.vectors[best].astype(noise.dtype)

    def add(self, noise: np.ndarray) -> None:
        slot = self.count % self.capacity
        self.vectors[slot] = noise
        self.sentinels[slot] = noise[self.probes]
        self.sentinel_sq[slot] = float(np.sum(self.sentinels[slot].astype(np.float64) ** 2))
        self.count += 1

    def state_dict(self) -> dict:
        stored = min(self.count, self.capacity)
        return {"vectors": self.vectors[:stored].copy(), "count": self.count, "matches": self.matches}

    def load_state_dict(self, state: dict) -> None:
        saved = np.asarray(state["vectors"], dtype=np.float32)
        for noise in saved:
            self.add(noise)
        self.count = int(state.get("count", len(saved)))
        self.matches = int(state.get("matches", 0))
