"""The names of the audited parameter tensors, as the model calls them."""

from __future__ import annotations

import weakref


def layer_names(params, module, optimizer=None, owner=None) -> list:
    """The names of the parameter tensors as the model calls them, without Opacus's `_module` wrapping (at the
    root, or inside a LightningModule: `model._module.fc.weight` is `model.fc.weight`).

    With `module` they are read from it at once. Without it they come from the Opacus
    GradSampleModule that computes the parameters' per-sample gradients. Neither the
    DPOptimizer nor its parameters lead to that module (Opacus 1.6: the optimizer holds
    the original optimizer, the noise generator and the accountant's step hook; a
    parameter carries only grad_sample, _forward_counter and summed_grad), but its hooks
    sit on the submodules that own the parameters, so the model's next forward pass
    shows it: NameWatch fills the list in place then. Until then, and for a tensor no
    module names, the name is ``param{i}{shape}``. `owner` (a ModuleRef) is given the
    GradSampleModule when it is found.
    """
    names = [f"param{i}{tuple(p.shape)}" for i, p in enumerate(params)]
    if module is not None:
        name_from(names, params, module)
    elif optimizer is not None and params:
        NameWatch(names, params, optimizer, owner)
    return names


def name_from(names: list, params, module) -> bool:
    """Fill `names` in place from module.named_parameters(); True when every tensor has a name. Opacus's
    GradSampleHooks (wrap_model=False) names them by the model it hooks."""
    if not hasattr(module, "named_parameters"):
        module = module._module
    found = {id(p): ".".join(part for part in n.split(".") if part != "_module") for n, p in module.named_parameters()}
    for i, p in enumerate(params):
        if id(p) in found:
            names[i] = found[id(p)]
    return all(id(p) in found for p in params)


class NameWatch:
    """Waits for the first forward pass through the audited parameters and names them.

    A global forward pre-hook (torch.nn.modules.module.register_module_forward_pre_hook)
    sees every module called. A GradSampleModule holding one of the parameters (never
    another model's, trained in the same process), or a submodule owning one of the
    parameters whose forward hooks belong to a GradSampleModule (Opacus hooks modules in
    place, as under Lightning), gives the names. The hook removes itself when the names
    are found, when a module owning the parameters carries no Opacus hooks (nothing to
    find), or when the auditor has been detached.
    """

    def __init__(self, names: list, params, optimizer, owner=None):
        from torch.nn.modules.module import register_module_forward_pre_hook

        self.names, self.params, self.owner = names, list(params), owner
        self.ids = {id(p) for p in self.params}
        self.optimizer = weakref.ref(optimizer)
        self.handle = register_module_forward_pre_hook(self)

    def __call__(self, module, args):
        from opacus.grad_sample.gsm_base import AbstractGradSampleModule

        optimizer = self.optimizer()
        auditor = getattr(optimizer, "_dpaudit_auditor", None)
        if auditor is None or auditor.kind.layer_names is not self.names:
            self.handle.remove()  # detached, or the auditor never finished attaching
            return
        if isinstance(module, AbstractGradSampleModule):
            if not any(id(p) in self.ids for p in module.parameters()):
                return  # another model's wrapper, in the same process
            owner = module
        elif any(p is not None and id(p) in self.ids for p in module._parameters.values()):
            owner = next((o for o in map(hook_owner, module._forward_hooks.values()) if o is not None), None)
            if owner is None:
                self.handle.remove()  # these parameters are trained without Opacus hooks to follow
                return
        else:
            return
        if self.owner is not None:
            self.owner.set(owner)
        if name_from(self.names, self.params, owner):
            self.handle.remove()


def hook_owner(hook):
    """The Opacus object whose hook this is: a GradSampleModule, or under make_private(wrap_model=False) the
    GradSampleHooks on the user's model (not a module itself: its model is its `_module`); None otherwise."""
    from opacus.grad_sample.gsm_base import AbstractGradSampleHooks

    owner = getattr(getattr(hook, "func", hook), "__self__", None)
    return owner if isinstance(owner, AbstractGradSampleHooks) else None
