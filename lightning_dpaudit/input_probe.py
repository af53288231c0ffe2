"""Tensor plumbing for input canaries: their gradients, directions and observations.

Each noised step the k canary examples go through the model's forward pass and a
backward pass; Opacus's own hooks produce their per-sample gradients g_i (the user's
batch gradients are set aside and restored). The rows of the in-canaries then enter the
optimizer's own clipping (GradientProbe.clip_alone). The observation direction of
canary i is its clipped gradient d_i = clip(g_i).

Observations, one per canary. With D the (k, d) matrix of directions, Cholesky
D D^T = L L^T gives orthonormal q = L^-1 D, and with b the in/out vector:

    y = q (R - S) = L^T b + z,   z ~ N(0, s^2 C^2 I)     (s the noise multiplier)
    obs_m = (y_m - sum_{j > m} L_jm b_j) / L_mm = b_m + z_m / L_mm

Removing the other canaries' known contributions is allowed (the adversary of DP knows
everything but the noise and the one canary's presence), and the orthonormal q make the
z_m independent. obs_m is N(b_m, (s C / L_mm)^2): the canary is (L_mm / (s C))-GDP, at
most the claimed 1/s since L_mm <= ||d_m|| <= C. Canaries whose direction lies almost in
the span of the earlier ones (L_mm < min_strength * C, for example two blank canaries
with one label, or gradients shorter than the bound) are not observed: that choice
depends on the gradients, not the noise.
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
        self._chol = None  # L, lower triangular (k, k), float64
        self._directions = None  # D, (k, d) float64

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
        """Clip the canaries' gradients into directions D and factor D D^T; returns each canary's L_mm / C.

        Pivoted Cholesky: canaries are taken in the order that keeps the most of each
        one's own direction, so near-duplicates end up last and unobserved.
        """
        k = grads[0].shape[0]
        flat = [g.reshape(k, -1).double() for g in grads]
        norms = torch.stack([f.norm(dim=1) for f in flat], dim=1)  # (k, tensors)
        if self.per_layer:
            factors = (self.clip_bounds[None, :] / (norms + 1e-6)).clamp(max=1.0)
        else:
            total = norms.norm(dim=1, keepdim=True)
            factors = (self.max_grad_norm / (total + 1e-6)).clamp(max=1.0).expand_as(norms)
        directions = torch.cat([f * factors[:, i : i + 1] for i, f in enumerate(flat)], dim=1)
        chol, order = pivoted_cholesky((directions @ directions.T).numpy())
        self._order = order
        self._chol = torch.as_tensor(chol)
        self._directions = directions[torch.as_tensor(order)]
        strength = np.zeros(k)
        strength[order] = np.diag(chol) / self.max_grad_norm
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
        """(observed, values): which canaries are observed (in pivot order) and their observations."""
        chol, order = self._chol, self._order
        y = torch.linalg.solve_triangular(chol, (self._directions @ difference)[:, None], upper=False)[:, 0]
        b = torch.as_tensor(np.asarray(is_in)[order], dtype=chol.dtype)
        diag = torch.diagonal(chol)
        kept = (diag / self.max_grad_norm).numpy() >= self.canaries.min_strength
        others = chol.T @ b - diag * b  # sum_{j > m} L_jm b_j
        values = ((y - others) / torch.where(diag > 0, diag, torch.ones_like(diag))).numpy()
        return order[kept], values[kept]


def pivoted_cholesky(gram: np.ndarray):
    """(L, order): gram[order][:, order] = L L^T, the largest remaining residual taken first."""
    k = gram.shape[0]
    order = np.arange(k)
    chol = np.zeros((k, k))
    residual = np.diag(gram).astype(float).copy()
    tiny = 1e-12 * max(float(residual.max(initial=0.0)), 1e-300)
    for m in range(k):
        j = m + int(np.argmax(residual[order[m:]]))
        order[[m, j]] = order[[j, m]]
        chol[[m, j], :m] = chol[[j, m], :m]
        pivot = residual[order[m]]
        if pivot <= tiny:
            break
        chol[m, m] = np.sqrt(pivot)
        rest = order[m + 1 :]
        chol[m + 1 :, m] = (gram[rest, order[m]] - chol[m + 1 :, :m] @ chol[m, :m]) / chol[m, m]
        residual[rest] -= chol[m + 1 :, m] ** 2
    return chol, order


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
