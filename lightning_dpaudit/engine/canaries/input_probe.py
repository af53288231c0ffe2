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

Memory: the per-sample gradients g that Opacus produced for the canaries (k rows of the
model, as many as k more examples in the batch) are all the audit keeps of the model's
size, for one step. The directions D = diag(f) g (f the clip factors) are never formed:
D D^T and D (R - S) are sums over parameter tensors and over column chunks of g,
accumulated in float64 through one scratch buffer of at most CHUNK elements; the values
at the pool are gathered tensor by tensor; the in-canaries' rows enter the optimizer's
clipping as a view of g, whose rows are rearranged in place.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch
from torch import nn

from .input_canaries import InputCanaries, check_sample, grad_sample_wrapper, hooks_disabled, plain_module

CHUNK = 2**20  # elements of the scratch buffer for products over g, chunk by chunk (8 MB in float64)


class InputProbe:
    """Per-sample gradients g of the canaries, their directions D and observations, tensor by tensor.

    g is the (k, ...) per-sample gradients Opacus produced, one tensor per parameter;
    the directions are D = diag(f) g with f the clip factors (per tensor under per-layer
    clipping: D_l = diag(f_l) g_l), never formed (see the module's docstring).
    """

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
        self.clip_bounds = np.asarray(clip_bounds, dtype=float)
        self.per_layer = per_layer
        self.max_grad_norm = float(max_grad_norm)
        self.loss_reduction = loss_reduction
        self.offsets = np.concatenate([[0], np.cumsum([p.numel() for p in self.params])]).astype(np.int64)
        self.pool = pool  # flat coordinates of the noise-freshness pool
        self._pool_index = self._locate(np.asarray(torch.as_tensor(pool).cpu()))
        self._grads: List[torch.Tensor] = []  # g: per-sample gradients, (k, *p.shape) per parameter
        self._order = None  # the canary whose gradient is in each row of g (canary_rows moves rows)
        self._factors = None  # f: (k, tensors) clip factors, float64, by canary
        self._gram = None  # G = D D^T, (k, k), by canary
        self._observed = None  # indices of the observed canaries
        self._root = None  # F = G^(1/2) on the observed canaries
        self._root_inverse = None  # F^-1

    # ------------------------------------------------------------------ gradients

    def gradients(self) -> List[torch.Tensor]:
        """Per-sample gradients of the canaries from the model's own Opacus hooks.

        The parameters' grad and grad_sample (the user's batch) are set aside for the
        call and restored after it, so the user's step is untouched.
        """
        self.release()  # the previous step's gradients are not kept beside the new ones
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

    def release(self) -> None:
        """Drop the step's per-sample gradients (prepare and gradients take new ones)."""
        self._grads, self._order = [], None

    def prepare(self, grads: List[torch.Tensor]) -> np.ndarray:
        """Clip factors f and Gram matrix G = D D^T of the directions D = diag(f) g; choose which canaries to observe.

        Returns F_mm / C per canary (0 for canaries not observed this step). `grads` (one
        (k, *p.shape) tensor per parameter) is kept, not copied: canary_rows moves its
        rows in place.
        """
        k = grads[0].shape[0]
        self._grads = [g.detach() if g.is_contiguous() else g.detach().contiguous() for g in grads]
        self._order = np.arange(k)
        squares = np.zeros((k, len(grads)))  # squared norm of each canary's gradient, per tensor
        gram = np.zeros((k, k))
        factors = np.zeros((k, len(grads)))
        scratch = self._scratch(torch.float64)
        for i in range(len(grads)):
            block = self._self_products(i, scratch)  # g_l g_l^T
            squares[:, i] = np.diag(block)
            if self.per_layer:
                factors[:, i] = np.minimum(self.clip_bounds[i] / (np.sqrt(squares[:, i]) + 1e-6), 1.0)
                gram += factors[:, i : i + 1] * block * factors[None, :, i]
            else:
                gram += block
        if not self.per_layer:
            total = np.sqrt(squares.sum(axis=1))
            factors[:] = np.minimum(self.max_grad_norm / (total + 1e-6), 1.0)[:, None]
            gram *= factors[:, :1] * factors[None, :, 0]
        self._factors, self._gram = factors, gram
        floor = self.canaries.min_strength * self.max_grad_norm
        self._observed, self._root, self._root_inverse = symmetric_decorrelation(gram, floor)
        strength = np.zeros(k)
        strength[self._observed] = np.diag(self._root) / self.max_grad_norm
        return strength

    def canary_rows(self, which: np.ndarray) -> List[torch.Tensor]:
        """The selected canaries' per-sample gradient rows, one tensor per parameter.

        No copy: the rows of g are rearranged in place so that the selected canaries come
        first, and views of those rows are returned.
        """
        which = np.asarray(which, dtype=bool)
        chosen = np.flatnonzero(which)
        self._arrange(np.concatenate([chosen, np.flatnonzero(~which)]))
        return [g[: len(chosen)] for g in self._grads]

    # ------------------------------------------------------------------ reading the release

    def gather(self, tensors: Sequence[torch.Tensor], coords=None) -> np.ndarray:
        """Values of per-parameter tensors at flat coordinates of the model (default: the pool), as float64.

        Each tensor is read at its own coordinates; the model is never concatenated.
        """
        index = self._pool_index if coords is None else self._locate(np.asarray(coords, dtype=np.int64))
        out = np.zeros(index[0], dtype=np.float64)
        for i, where, local in index[1]:
            out[where] = tensors[i].detach().reshape(-1)[local].double().cpu().numpy()
        return out

    def at_pool(self, tensors: Sequence[torch.Tensor]) -> np.ndarray:
        """Values of per-parameter tensors at the pool coordinates, as float64."""
        return self.gather(tensors)

    def project(
        self,
        released: Sequence[torch.Tensor],
        data_sum: Sequence[torch.Tensor],
        is_in: np.ndarray,
        predicted_at_pool: Optional[np.ndarray] = None,
    ):
        """(observed, values): which canaries are observed and their observations b_m + noise.

        Reads D (R - S - P) with R the released tensors, S the data's clipped sum and P a
        prediction of the noise given on the pool coordinates (zero elsewhere; None: no
        prediction): D (R - S) per tensor and chunk, in float64, minus D[:, pool] P.
        """
        b = np.asarray(is_in, dtype=float)
        observed = self._observed
        hidden = np.ones(len(b), dtype=bool)
        hidden[observed] = False
        along = self._apply(released, data_sum)
        if predicted_at_pool is not None and np.any(predicted_at_pool):
            along -= self._at_pool_directions() @ np.asarray(predicted_at_pool, dtype=np.float64)
        along = along[observed]
        along -= self._gram[np.ix_(observed, hidden)] @ b[hidden]  # canaries not observed, known
        y = self._root_inverse @ along
        root, b_observed = self._root, b[observed]
        diag = np.diag(root)
        values = (y - root @ b_observed + diag * b_observed) / diag
        return observed, values

    # ------------------------------------------------------------------ tensor by tensor

    def _rows(self, i: int) -> torch.Tensor:
        """g_l as a (k, numel) view."""
        g = self._grads[i]
        return g.reshape(g.shape[0], -1)

    def _scratch(self, dtype: torch.dtype) -> torch.Tensor:
        """One buffer of at most CHUNK elements, reused for every chunk of a call."""
        k = self._grads[0].shape[0]
        widest = max(self._rows(i).shape[1] for i in range(len(self._grads)))
        return torch.empty(k * max(1, min(CHUNK // k, widest)), dtype=dtype, device=self._grads[0].device)

    def _columns(self, i: int, scratch: torch.Tensor):
        """(columns of g_l, a (k, width) view of scratch, (a, b)) for column ranges filling scratch at most."""
        rows = self._rows(i)
        k, n = rows.shape
        width = scratch.numel() // k
        for a in range(0, n, width):
            b = min(a + width, n)
            yield rows[:, a:b], scratch[: k * (b - a)].view(k, b - a), (a, b)

    def _self_products(self, i: int, scratch: torch.Tensor) -> np.ndarray:
        """g_l g_l^T in float64, chunk by chunk (rows in the order of g)."""
        k = self._grads[i].shape[0]
        block = torch.zeros((k, k), dtype=torch.float64, device=scratch.device)
        for part, chunk, _ in self._columns(i, scratch):
            chunk.copy_(part)
            block.addmm_(chunk, chunk.T)
        return block.cpu().numpy()

    def _apply(self, released: Sequence[torch.Tensor], data_sum: Sequence[torch.Tensor]) -> np.ndarray:
        """D (R - S) by canary, float64: sum over tensors of f_l * (g_l (R_l - S_l)), chunk by chunk."""
        k = self._grads[0].shape[0]
        scratch = self._scratch(torch.float64)
        difference = torch.empty(scratch.numel() // k, dtype=torch.float64, device=scratch.device)
        along = np.zeros(k)
        factors = self._factors[self._order]  # by row of g
        for i in range(len(self._grads)):
            r, s = released[i].detach().reshape(-1), data_sum[i].detach().reshape(-1)
            total = torch.zeros(k, dtype=torch.float64, device=scratch.device)
            for part, chunk, (a, b) in self._columns(i, scratch):
                chunk.copy_(part)
                v = difference[: b - a]
                v.copy_(r[a:b])
                v.sub_(s[a:b])  # R - S in float64, as exact as the reference
                total.addmv_(chunk, v)
            along += factors[:, i] * total.cpu().numpy()
        out = np.empty(k)
        out[self._order] = along
        return out

    def _at_pool_directions(self) -> np.ndarray:
        """D[:, pool] by canary, float64: (k, pool size)."""
        k = self._grads[0].shape[0]
        size, index = self._pool_index
        columns = np.zeros((k, size))
        factors = self._factors[self._order]
        for i, where, local in index:
            columns[:, where] = factors[:, i : i + 1] * self._rows(i)[:, local].double().cpu().numpy()
        out = np.empty_like(columns)
        out[self._order] = columns
        return out

    def _arrange(self, order: np.ndarray) -> None:
        """Move the rows of g in place so that row r holds canary order[r].

        Column chunk by chunk through one scratch buffer of at most CHUNK elements.
        """
        position = np.empty(len(order), dtype=np.int64)
        position[self._order] = np.arange(len(order))
        source = position[order]  # row r takes the current row source[r]
        if np.array_equal(source, np.arange(len(order))):
            return
        source = torch.as_tensor(source, device=self._grads[0].device)
        scratch = {}
        with torch.no_grad():
            for i, g in enumerate(self._grads):
                if g.dtype not in scratch:
                    scratch[g.dtype] = self._scratch(g.dtype)
                for part, chunk, _ in self._columns(i, scratch[g.dtype]):
                    torch.index_select(part, 0, source, out=chunk)
                    part.copy_(chunk)
        self._order = np.asarray(order)

    def _locate(self, coords: np.ndarray):
        """(len(coords), [(tensor, positions in coords, index into the tensor)]) for flat coordinates."""
        coords = np.asarray(coords, dtype=np.int64).reshape(-1)
        tensor = np.searchsorted(self.offsets, coords, side="right") - 1
        index = []
        for i in np.unique(tensor):
            where = np.flatnonzero(tensor == i)
            local = torch.as_tensor(coords[where] - self.offsets[i], device=self.params[i].device)
            index.append((int(i), where, local))
        return len(coords), index


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
    if len(x) >= 2:
        check_summed_loss(canaries.loss_fn, out, labels[:2] if labels is not None else torch.zeros(2, dtype=torch.int64))


def check_summed_loss(loss_fn, outputs: torch.Tensor, labels: torch.Tensor) -> None:
    """The canaries' loss must sum over the batch: a mean divides each canary's gradient by the
    batch size, below the clipping bound, and the canaries go unobserved."""
    with torch.no_grad():
        both = loss_fn(outputs, labels)
        each = loss_fn(outputs[:1], labels[:1]) + loss_fn(outputs[1:2], labels[1:2])
    if not torch.is_tensor(both) or both.numel() != 1:
        raise ValueError(f"`loss_fn` must return one number for a batch (a summed loss); it returned shape {tuple(torch.as_tensor(both).shape)}")
    if not torch.allclose(both, each, rtol=1e-4, atol=1e-6):
        raise ValueError(
            f"`loss_fn` must sum over the batch (e.g. nn.CrossEntropyLoss(reduction='sum')): on two canaries it gives "
            f"{float(both):.4g}, their losses add up to {float(each):.4g}. A mean-reduced loss shrinks every canary's "
            "gradient by the batch size and no canary would be observed."
        )
