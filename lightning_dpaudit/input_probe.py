"""Tensor plumbing for input canaries: their gradients, directions and observations.

Each noised step the k canary examples go through the model's forward pass and a
backward pass; Opacus's own hooks produce their per-sample gradients g_i (the user's
batch gradients are set aside and restored). The rows of the in-canaries then enter the
optimizer's own clipping (GradientProbe.clip_alone). The observation direction of
canary i is its clipped gradient d_i = clip(g_i).

Observations, one per observed canary. With D the (k, d) matrix of directions of the
observed canaries, G = D D^T and F = G^(1/2) its symmetric square root, q = F^-1 D is
orthonormal, and with b the in/out vector (the known contributions of canaries that are
not observed subtracted first):

    y = q (R - S) = F b + z,   z ~ N(0, s^2 C^2 I)     (s the noise multiplier)
    obs_m = (y_m - sum_{j != m} F_mj b_j) / F_mm = b_m + z_m / F_mm

Removing the other canaries' known contributions is allowed (the adversary of DP knows
everything but the noise and the one canary's presence), and the orthonormal q make the
z_m independent. obs_m is N(b_m, (s C / F_mm)^2): the canary is (F_mm / (s C))-GDP, at
most the claimed 1/s since F_mm^2 <= sum_j F_mj^2 = G_mm = ||d_m||^2 <= C^2. Of all
factors F with F F^T = G, the symmetric root has the largest trace, so it keeps the most
of the canaries' strength on average (a triangular Cholesky factor keeps the first
canary whole and charges every overlap to the later ones). Canaries are chosen before
the noise is seen, from their gradients alone: a pivoted Cholesky factorization takes
those keeping at least min_strength * C of their direction beyond the earlier ones (so
near-duplicates, and gradients shorter than the bound, are left out), then the weakest
is dropped until every F_mm >= min_strength * C.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np
import torch
from torch import nn

from .input_canaries import InputCanaries, check_sample, grad_sample_wrapper, hooks_disabled, plain_module


class InputProbe:
    def __init__(
        self,
        params: Sequence[torch.Tensor],
        model: nn.Module,
        canaries: InputCanaries,
        clip_bounds: np.ndarray,
        *,
        per_layer: bool,
        max_grad_norm: float,
        loss_reduction: str,
        pool: torch.Tensor,
    ):
        self.params = list(params)
        self.model = model
        self.canaries = canaries
        self.clip_bounds = torch.as_tensor(np.asarray(clip_bounds, dtype=float))
        self.per_layer = per_layer
        self.max_grad_norm = float(max_grad_norm)
        self.loss_reduction = loss_reduction
        self.pool = pool  # flat coordinates of the noise-freshness pool
        self._grads: List[torch.Tensor] = []
        self._directions = None  # D, (k, d) float64
        self._gram = None  # D D^T, (k, k)
        self._observed = None  # indices of the observed canaries
        self._root = None  # F = G^(1/2) on the observed canaries
        self._root_inverse = None  # F^-1

    # ------------------------------------------------------------------ gradients

    def gradients(self) -> List[torch.Tensor]:
        """Per-sample gradients of the canaries from the model's own Opacus hooks.

        The parameters' grad and grad_sample (the user's batch) are set aside for the
        call and restored after it, so the user's step is untouched.
        """
        x, y = self.canaries.x, self.canaries.y
        saved = [(p.grad, getattr(p, "grad_sample", None)) for p in self.params]
        try:
            for p in self.params:
                p.grad = None
                p.grad_sample = None
            with torch.enable_grad():
                loss = self.canaries.loss_fn(self.model(x), y)
                if self.loss_reduction == "mean":  # Opacus rescales by the batch size under "mean"
                    loss = loss / len(x)
                torch.autograd.backward(loss, inputs=self.params)
            grads = [p.grad_sample for p in self.params]
        finally:
            for p, (g, sample) in zip(self.params, saved):
                p.grad = g
                p.grad_sample = sample
        missing = [i for i, g in enumerate(grads) if not isinstance(g, torch.Tensor) or g.shape[0] != len(x)]
        if missing:
            raise TypeError(
                f"the model produced no per-sample gradients for {len(missing)} of {len(grads)} parameter tensors: "
                "input canaries need the Opacus GradSampleModule (grad_sample_mode='hooks') made by make_private"
            )
        self._grads = [g.detach() for g in grads]
        return self._grads

    def prepare(self, grads: List[torch.Tensor]) -> np.ndarray:
        """Clip the canaries' gradients into directions D and choose which to observe; returns F_mm / C.

        Canaries that are not observed this step get strength 0.
        """
        k = grads[0].shape[0]
        flat = [g.reshape(k, -1).double() for g in grads]
        norms = torch.stack([f.norm(dim=1) for f in flat], dim=1)  # (k, tensors)
        if self.per_layer:
            factors = (self.clip_bounds[None, :] / (norms + 1e-6)).clamp(max=1.0)
        else:
            total = norms.norm(dim=1, keepdim=True)
            factors = (self.max_grad_norm / (total + 1e-6)).clamp(max=1.0).expand_as(norms)
        self._directions = torch.cat([f * factors[:, i : i + 1] for i, f in enumerate(flat)], dim=1)
        self._gram = (self._directions @ self._directions.T).numpy()
        floor = self.canaries.min_strength * self.max_grad_norm
        self._observed, self._root, self._root_inverse = symmetric_decorrelation(self._gram, floor)
        strength = np.zeros(k)
        strength[self._observed] = np.diag(self._root) / self.max_grad_norm
        return strength

    def canary_rows(self, which: np.ndarray) -> List[torch.Tensor]:
        """The selected canaries' per-sample gradient rows, one tensor per parameter."""
        index = torch.as_tensor(np.flatnonzero(which))
        return [g[index] for g in self._grads]

    # ------------------------------------------------------------------ reading the release

    def flat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-parameter tensors as one float64 vector."""
        return torch.cat([t.detach().reshape(-1).double() for t in tensors])

    def at_pool(self, flat: torch.Tensor) -> np.ndarray:
        return flat[self.pool].numpy()

    def without(self, flat: torch.Tensor, predicted_at_pool: np.ndarray) -> torch.Tensor:
        """flat minus a prediction given on the pool coordinates."""
        if not np.any(predicted_at_pool):
            return flat
        out = flat.clone()
        out[self.pool] -= torch.as_tensor(predicted_at_pool, dtype=out.dtype)
        return out

    def project(self, difference: torch.Tensor, is_in: np.ndarray):
        """(observed, values): which canaries are observed and their observations b_m + noise."""
        b = np.asarray(is_in, dtype=float)
        observed = self._observed
        hidden = np.ones(len(b), dtype=bool)
        hidden[observed] = False
        along = (self._directions @ difference).numpy()[observed]
        along -= self._gram[np.ix_(observed, hidden)] @ b[hidden]  # canaries not observed, known
        y = self._root_inverse @ along
        root, b_observed = self._root, b[observed]
        diag = np.diag(root)
        values = (y - root @ b_observed + diag * b_observed) / diag
        return observed, values


def symmetric_decorrelation(gram: np.ndarray, floor: float):
    """(observed, F, F^-1): canaries to observe and the symmetric root F of their Gram matrix.

    Pivoted Cholesky keeps the canaries whose residual norm is at least `floor`; then the
    one with the smallest F_mm is dropped until every F_mm >= floor.
    """
    chol, order = pivoted_cholesky(gram)
    observed = np.sort(order[np.diag(chol) >= floor])
    while len(observed):
        values, vectors = np.linalg.eigh(gram[np.ix_(observed, observed)])
        roots = np.sqrt(np.clip(values, 1e-300, None))
        root = (vectors * roots) @ vectors.T
        diag = np.diag(root)
        if diag.min() >= floor:
            return observed, root, (vectors / roots) @ vectors.T
        observed = np.delete(observed, np.argmin(diag))
    return observed, np.zeros((0, 0)), np.zeros((0, 0))


def pivoted_cholesky(gram: np.ndarray):
    """(L, order): gram[order][:, order] = L L^T, the largest remaining residual taken first (LAPACK pstrf).

    Past the numerical rank the factor is zero: those canaries have nothing of their own.
    """
    from scipy.linalg.lapack import dpstrf

    factor, pivots, rank, _ = dpstrf(np.asarray(gram, dtype=float), lower=1, tol=-1)
    chol = np.tril(factor)
    chol[rank:, rank:] = 0.0
    return chol, pivots - 1


def check_input_model(model, params, canaries: InputCanaries) -> None:
    """Clear errors at attach time: a model without Opacus hooks, inputs it cannot take, bad labels."""
    if model is None:
        raise ValueError("input canaries need the model: pass `module=` (the GradSampleModule from make_private)")
    if grad_sample_wrapper(model) is None:
        raise TypeError(
            f"input canaries need per-sample gradients from Opacus, but {type(model).__name__} is not an Opacus "
            "GradSampleModule and carries no GradSampleModule hooks: pass the module returned by "
            "PrivacyEngine.make_private"
        )
    x = canaries.inputs
    dtype = params[0].dtype
    if not torch.is_tensor(x) or x.dtype != dtype:
        raise ValueError(
            f"canary inputs must be a tensor of the model's dtype {dtype}; got "
            f"{x.dtype if torch.is_tensor(x) else type(x).__name__}"
        )
    try:
        with torch.no_grad(), hooks_disabled(model):
            out = plain_module(model)(x[:2])
    except Exception as error:  # the model's own message says what it expected
        raise ValueError(f"the model cannot take canary inputs of shape {tuple(x.shape[1:])}: {error}") from error
    width = out.shape[-1]
    canaries.num_classes = canaries.num_classes or int(width)
    labels = canaries.labels
    if canaries.kind != "blank" or labels is not None:
        check_sample(x, labels, canaries.num_classes)
