"""Ghost (fast gradient) clipping applied to canary rows by the module's own code.

Under grad_sample_mode="ghost" per-sample gradients never exist: the
GradSampleModuleFastGradientClipping's hooks compute each sample's gradient norm per
parameter (ghost norms for nn.Linear and nn.Embedding, from activations a and
backprops g: ||sum_t g_t a_t^T||^2 = sum_{t,t'} (a_t.a_t')(g_t.g_t'); the norm of a
materialized per-sample gradient for other layers), `get_clipping_coef` turns them into
coefficients c_i = min(1, C / (||g_i|| + 1e-6)), and the second backward pass sums
c_i g_i. The optimizer only adds noise.

A gradient canary is a sparse row: values v_s at coordinates (i_s, j_s) of one tensor.
For a linear weight it is exactly the per-sample gradient of the sequence
a_t = e_{j_t}, g_t = v_t e_{i_t} (t = 1..support); for an embedding table, of the token
ids i_t with backprops v_t e_{j_t}; for a bias, of the backprops alone. So each canary's
norms come from the module's own norm sampler for its layer type (NORM_SAMPLERS, as the
module's hooks look it up), or from Opacus's create_norm_sample for the other layers,
and its coefficient from the module's own get_clipping_coef. K = sum_i c_i row_i then
enters the optimizer's summed gradient as the data's clipped sum does.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Callable, List, Optional, Sequence

import torch


def is_ghost(optimizer) -> bool:
    """True for Opacus's fast-gradient-clipping optimizers (ghost, ghost under DDP, FSDP)."""
    return any("FastGradientClipping" in c.__name__ for c in type(optimizer).__mro__)


def check_ghost_options(optimizer, options) -> None:
    """Input canaries need their own per-sample gradients, which ghost clipping never forms."""
    if options.input and is_ghost(optimizer):
        raise ValueError(
            f"input canaries ({options.kind!r}) need the canaries' own per-sample gradients, which ghost clipping "
            "never forms; audit ghost clipping with gradient canaries ('dirac', 'constant' or 'random'), whose "
            "norms and clipping coefficients come from the module's own ghost-clipping code"
        )


class GhostClipping:
    """K for canary rows through a GradSampleModuleFastGradientClipping's norms and coefficients.

    `module()` gives that module (found when the model first runs forward, or passed).
    rows[l]: (k, m_l) values of tensor l at `columns[l]` (flat coordinates), or (k, *shape)
    when columns[l] is None. Returns one sum per tensor, of the rows' shape without k.
    """

    def __init__(self, params: Sequence[torch.Tensor], module: Callable[[], Optional[torch.nn.Module]],
                 names: Optional[Sequence[str]] = None):
        self.params = list(params)
        # the tensors' names for findings: the kind's list, which the model's first forward pass fills in place
        self.names = names if names is not None else [f"param{i}{tuple(p.shape)}" for i, p in enumerate(self.params)]
        self.module = module
        self._owners = None  # per tensor: the submodule owning it
        self.note_problem: Callable[[str, str, bool], None] = lambda code, message, alarm: None

    def sums(self, rows: List[torch.Tensor], columns) -> List[torch.Tensor]:
        gsm = self.module()
        if gsm is None:
            raise RuntimeError(
                "ghost clipping: the GradSampleModuleFastGradientClipping of the audited parameters was not found "
                "(it is seen at the model's first forward pass); pass module= (the module make_private returned)"
            )
        k = rows[0].shape[0]
        norms = {id(p): self._norms(gsm, l, r.reshape(k, -1), None if c is None else c) for l, (p, r, c) in
                 enumerate(zip(self.params, rows, columns))}
        coef = self._coefficients(gsm, norms, k)
        return [torch.einsum("k,k...->...", coef.to(r.dtype), r) for r in rows]

    def _coefficients(self, gsm, norms: dict, k: int) -> torch.Tensor:
        """The module's get_clipping_coef on the canaries' norms (its own state restored after).

        One more sample, of norm C / 2, is passed with them: a clipping coefficient above 1
        for it means small gradients are scaled up (normalized, not clipped).
        """
        trainable = list(gsm.trainable_parameters)
        hooked = {id(p) for p in trainable}
        missing = [name for p, name in zip(self.params, self.names) if id(p) not in hooked]
        if missing:
            self.note_problem(
                "per_sample_gradients",
                f"{', '.join(f'`{n}`' for n in missing)} reach the optimizer without per-sample norms: the ghost "
                "clipping module does not train them (added after make_private, or hooks never registered), so their "
                "contribution is never clipped",
                True,
            )
        half = 0.5 * float(gsm.max_grad_norm)
        first = id(trainable[0])

        def with_probe(p):  # the canaries' norms of p, and the C/2 sample's
            own = norms.get(id(p), torch.zeros(k, dtype=p.dtype, device=p.device))
            return torch.cat([own, own.new_full((1,), half if id(p) == first else 0.0)])

        from opacus.utils.module_utils import trainable_parameters

        # FSDP's module keeps the norms on each submodule (norm_sample, in parameter order), the others on each parameter
        holders = list(gsm.iterate_submodules(gsm._module)) if _is_fsdp(gsm) else trainable
        attribute = "norm_sample" if _is_fsdp(gsm) else "_norm_sample"
        saved = [getattr(h, attribute, None) for h in holders]
        saved_norms = gsm._per_sample_gradient_norms
        try:
            for h in holders:
                if _is_fsdp(gsm):
                    h.norm_sample = [with_probe(p) for _, p in trainable_parameters(h)]  # as the module's hooks list them
                else:
                    h._norm_sample = with_probe(h)
            coef = gsm.get_clipping_coef().reshape(-1)
        finally:
            for h, s in zip(holders, saved):
                setattr(h, attribute, s)
            gsm._per_sample_gradient_norms = saved_norms
        if float(coef[-1]) > 1.0 + 1e-4:
            self.note_problem(
                "clipping_scales_up",
                f"ghost clipping's coefficient for a gradient of norm C/2 is {float(coef[-1]):.4g} (a clipping "
                "coefficient is at most 1): small per-sample gradients are scaled up to norm C, normalized rather "
                "than clipped. Each sample's contribution stays within C, so the privacy claim holds, but the update "
                "is not DP-SGD's; check get_clipping_coef's clamp(max=1.0)",
                False,
            )
        return coef[:-1]

    def _norms(self, gsm, index: int, flat_rows: torch.Tensor, columns) -> torch.Tensor:
        """Per-row gradient norm of tensor `index`, by the module's code for its layer type.

        Only the rows with values in this tensor are passed on (a canary lives in one
        tensor); the others' norm here is 0."""
        p = self.params[index]
        present = torch.nonzero(flat_rows.abs().sum(dim=1) > 0).reshape(-1)
        norms = torch.zeros(flat_rows.shape[0], dtype=flat_rows.dtype, device=flat_rows.device)
        if len(present) == 0:
            return norms
        rows = flat_rows[present]
        layer = self._owner(gsm, index)
        layer_type = gsm._get_module_type(layer) if _is_fsdp(gsm) else type(layer)  # FSDPLinear counts as Linear
        sampler = gsm.NORM_SAMPLERS.get(layer_type) if gsm.use_ghost_clipping and layer is not None else None
        if sampler is None:
            from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import create_norm_sample

            holder = SimpleNamespace(requires_grad=True)
            create_norm_sample(param=holder, grad_sample=rows, max_batch_len=rows.shape[0])
            norms[present] = holder._norm_sample.to(norms.dtype)
        else:
            activations, backprops = _as_sequence(layer, p, rows, columns)
            norms[present] = sampler(layer, [activations], backprops)[p].to(norms.dtype)
        return norms

    def _owner(self, gsm, index: int):
        if self._owners is None:
            root = gsm if hasattr(gsm, "modules") else gsm._module  # GradSampleHooks (wrap_model=False): its model
            where = {id(q): m for m in root.modules() for q in m.parameters(recurse=False)}
            self._owners = [where.get(id(p)) for p in self.params]
        return self._owners[index]


def _is_fsdp(gsm) -> bool:
    from opacus.grad_sample import GradSampleHooksFastGradientClippingFSDP

    return isinstance(gsm, GradSampleHooksFastGradientClippingFSDP)


def _as_sequence(layer, p: torch.Tensor, rows: torch.Tensor, columns):
    """(activations, backprops) of a sequence whose per-sample gradient of `p` is each row.

    Row r's nonzero entries (coordinate c_t, value v_t), t = 0..T-1, become position t
    of sample r: for a linear weight (out, in) a_t = e_{c_t mod in}, g_t = v_t e_{c_t div in};
    for a linear bias g_t = v_t e_{c_t} (a_t = 0); for an embedding table (n, d) the token
    c_t div d with g_t = v_t e_{c_t mod d}. Unused positions are zero (token 0 with g = 0).
    """
    k = rows.shape[0]
    r, c = rows.nonzero(as_tuple=True)
    values = rows[r, c]
    coords = c if columns is None else columns[c]
    counts = torch.bincount(r, minlength=k)
    T = max(int(counts.max()), 1) if len(r) else 1
    start = torch.cumsum(counts, 0) - counts
    t = torch.arange(len(r), device=rows.device) - start[r]
    dtype, device = rows.dtype, rows.device
    if isinstance(layer, torch.nn.Embedding):
        d = layer.embedding_dim
        ids = torch.zeros((k, T), dtype=torch.long, device=device)
        ids[r, t] = coords // d
        backprops = torch.zeros((k, T, d), dtype=dtype, device=device)
        backprops[r, t, coords % d] = values
        return ids, backprops
    out_features, in_features = layer.out_features, layer.in_features
    activations = torch.zeros((k, T, in_features), dtype=dtype, device=device)
    backprops = torch.zeros((k, T, out_features), dtype=dtype, device=device)
    if p is layer.weight:
        activations[r, t, coords % in_features] = 1.0
        backprops[r, t, coords // in_features] = values
    else:
        backprops[r, t, coords] = values
    return activations, backprops


def grad_sample_module_in(module, params) -> Optional[torch.nn.Module]:
    """The Opacus GradSampleModule training `params` inside `module` (itself, a submodule, or hooked in place)."""
    from opacus.grad_sample.gsm_base import AbstractGradSampleModule

    from ..support.tensor_names import hook_owner

    ids = {id(p) for p in params}
    for m in module.modules():
        if isinstance(m, AbstractGradSampleModule):
            return m
        if any(id(q) in ids for q in m.parameters(recurse=False)):
            owner = next((o for o in map(hook_owner, m._forward_hooks.values()) if o is not None), None)
            if owner is not None:
                return owner
    return None


class ModuleRef:
    """A weak reference filled in once (by module= or at the model's first forward pass)."""

    def __init__(self):
        self._ref = None

    def set(self, module) -> bool:
        self._ref = weakref.ref(module)
        return True

    def __call__(self):
        return None if self._ref is None else self._ref()
