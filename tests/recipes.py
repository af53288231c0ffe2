"""Practitioner DP-SGD recipes, each a correct run and a buggy twin, audited as the guides show.

One definition of each recipe, used by tests/test_recipes.py (one seed, a few steps) and bench/validity/recipes.py (many
seeds, long runs); both put tests/ on the import path. Digits recipes use the bundled digits
(lightning_dpaudit.datasets); the others synthetic tokens or a tiny Hugging Face model built from a config (nothing
is downloaded). sigma 1, C 1 throughout.
"""

from __future__ import annotations

from typing import Dict

import torch
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import Subset

from lightning_dpaudit.datasets import DigitsCNN, digits_dataset, make_private_digits
from lightning_dpaudit.testing import inject_bug
from recipe_models import VIEWS, best_recipe_run, dp_gan_run, lightning_run, lora_run, views_of
from recipe_runs import Audit, Recipe, cross_entropy, loop, private, sgd_step

CE = nn.CrossEntropyLoss()


def digits_run(seed: int, steps: int, *, bug: str = None, autocast=None, **private_options):
    """The digits CNN made private by make_private_digits, in a plain loop; `bug` from the zoo injected first."""
    model, optimizer, loader, _ = make_private_digits(seed=seed, **private_options)
    if bug is not None:
        inject_bug(optimizer, bug)
    loss = cross_entropy(model)
    if autocast is not None:
        plain = loss
        loss = lambda batch: _autocast(plain, batch, autocast)  # noqa: E731  the loop's own loss, as it runs
    audit = Audit(optimizer, module=model, loader=loader, seed=seed, loss=loss)
    loop(sgd_step(model, optimizer, cross_entropy(model), autocast=autocast), loader, steps, audit.alarmed)
    return audit.result()


def _autocast(loss, batch, dtype):
    with torch.autocast("cpu", dtype=dtype):
        return loss(batch)


# ---------------------------------------------------------------------------------------------- 1 plain CNN


def layer_left_out(seed: int, steps: int):
    """The last linear layer kept out of the private model: Opacus's make_private gets the rest, a second plain SGD
    trains the head on the same loss, and the audit watches the whole model."""
    torch.manual_seed(seed)
    cnn = DigitsCNN()
    head = cnn.classifier[3]
    body, optimizer, loader = private(nn.Sequential(cnn.features, *cnn.classifier[:3]), digits_dataset(), seed=seed)
    model = nn.Sequential(body, head)
    plain = torch.optim.SGD(head.parameters(), lr=0.1)
    audit = Audit(optimizer, module=model, loader=loader, seed=seed, loss=cross_entropy(model))

    def step(batch):
        optimizer.zero_grad()
        plain.zero_grad()
        CE(model(batch[0]), batch[1]).backward()
        optimizer.step()
        plain.step()

    loop(step, loader, steps, audit.alarmed)
    return audit.result()


# ---------------------------------------------------------------------------------------------- 2 EMA


def ema_run(seed: int, steps: int, *, shadow_trained: bool = False):
    """An EMA of the DP iterates (AveragedModel with get_ema_multi_avg_fn) beside the DP model; the twin trains a
    shadow copy by plain SGD on the private batch instead."""
    model, optimizer, loader, _ = make_private_digits(seed=seed)
    if shadow_trained:
        average = DigitsCNN()
        average.load_state_dict(model._module.state_dict())
        plain = torch.optim.SGD(average.parameters(), lr=0.1)
    else:
        average = AveragedModel(model._module, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    holder = nn.ModuleDict({"model": model, "ema": average})
    audit = Audit(optimizer, module=holder, loader=loader, seed=seed, loss=cross_entropy(model))

    def step(batch):
        optimizer.zero_grad()
        loss = CE(model(batch[0]), batch[1])
        if shadow_trained:
            plain.zero_grad()
            loss = loss + CE(average(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        if shadow_trained:
            plain.step()
        else:
            average.update_parameters(model._module)

    loop(step, loader, steps, audit.alarmed)
    return audit.result()


# ---------------------------------------------------------------------------------------------- 3 augmentation multiplicity


def augmult_run(seed: int, steps: int, *, average: bool = True):
    """K augmented views of each record (random flips and shifts, drawn from torch's generator), the per-sample
    gradients averaged over each record's views before the step; the twin counts the views as records."""
    model, optimizer, loader, _ = make_private_digits(seed=seed)

    def loss(batch):
        """The step's loss over the records' consecutive views; given to the audit as the loop's own loss."""
        images, labels = batch
        return CE(model(views_of(images)), labels.repeat_interleave(VIEWS))

    audit = Audit(optimizer, module=model, loader=loader, seed=seed, loss=loss)

    def step(batch):
        optimizer.zero_grad()
        loss(batch).backward()
        if average:
            for p in model.parameters():
                p.grad_sample = p.grad_sample.view(len(batch[0]), VIEWS, *p.shape).mean(dim=1)
        optimizer.step()

    loop(step, loader, steps, audit.alarmed)
    return audit.result()


# ---------------------------------------------------------------------------------------------- 4 oversampling


def subset_run(seed: int, steps: int, *, oversample: bool = False):
    """A Subset of the digits; the twin oversamples a rare class by naming its records twice (idx + idx_rare)."""
    data = digits_dataset()
    idx = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:1500].tolist()
    labels = data.tensors[1]
    rare = [i for i in idx if labels[i] == 0]
    torch.manual_seed(seed)
    module, optimizer, loader = private(DigitsCNN(), Subset(data, idx + rare if oversample else idx), seed=seed)
    audit = Audit(optimizer, module=module, loader=loader, seed=seed, loss=cross_entropy(module))
    loop(sgd_step(module, optimizer, cross_entropy(module)), loader, steps, audit.alarmed)
    return audit.result()


# ---------------------------------------------------------------------------------------------- 6 BatchMemoryManager


def memory_managed_run(seed: int, steps: int, *, bug: str = None):
    """A logical batch of 256 in physical batches of at most 64 (Opacus's BatchMemoryManager); `steps` counts
    optimizer steps. The audit watches the loader the loop iterates."""
    model, optimizer, loader, _ = make_private_digits(seed=seed, batch_size=256, lr=0.5)
    if bug is not None:
        inject_bug(optimizer, bug)
    audit = Audit(optimizer, module=model, loader=loader, seed=seed, loss=cross_entropy(model))
    done = 0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=64, optimizer=optimizer) as physical:
        audit.auditor.watch_loader(physical)
        while done < steps and not audit.alarmed():
            for images, labels in physical:
                optimizer.zero_grad()
                CE(model(images), labels).backward()
                optimizer.step()
                done += not optimizer._is_last_step_skipped
                if done >= steps or audit.alarmed():
                    break
    return audit.result()


# ---------------------------------------------------------------------------------------------- 9 ghost clipping


def ghost_run(seed: int, steps: int, *, bug: str = None):
    """Ghost clipping (grad_sample_mode="ghost") on a token classifier; the criterion's loss runs both backward
    passes. The twin halves nn.Linear's ghost norms (the ghost bug zoo)."""
    from ghost_setups import make_ghost

    module, optimizer, criterion, loader = make_ghost(seed=seed)
    if bug is not None:
        inject_bug(optimizer, bug, module=module)
    # the loss the criterion wraps: a replay of criterion(...) itself does not give the recorded gradients, and the
    # independence check then replays the forward pass alone (it says so)
    audit = Audit(optimizer, module=module, loader=loader, seed=seed, loss=cross_entropy(module))

    def step(batch):
        criterion(module(batch[0]), batch[1]).backward()
        optimizer.step()
        optimizer.zero_grad()

    loop(step, loader, steps, audit.alarmed)
    return audit.result()


# ---------------------------------------------------------------------------------------------- 12 sampling


def sampling_run(seed: int, steps: int, *, poisson: bool = True):
    """Poisson sampling (Opacus's DPDataLoader); the twin keeps the shuffled fixed-size loader."""
    return digits_run(seed, steps, poisson_sampling=poisson)


# ---------------------------------------------------------------------------------------------- the recipes

RECIPES: Dict[str, Recipe] = {r.name: r for r in [
    Recipe("plain-cnn", "digits CNN, Opacus hooks", "a layer left out of the DP optimizer, trained by plain SGD",
           lambda s, n: digits_run(s, n), layer_left_out, ("outside_dp",)),
    Recipe("ema", "EMA of the DP iterates (AveragedModel)", "a shadow copy trained by plain SGD on the private batch",
           lambda s, n: ema_run(s, n), lambda s, n: ema_run(s, n, shadow_trained=True), ("outside_dp",)),
    Recipe("augmult", f"{VIEWS} views per record, per-sample gradients averaged", "views counted as records",
           lambda s, n: augmult_run(s, n), lambda s, n: augmult_run(s, n, average=False), ("multiplicity",),
           declines=("none through the training step (the model's batch is not the loader's",)),
    Recipe("oversampling", "a Subset without repeats", "Subset(ds, idx + idx_rare)",
           lambda s, n: subset_run(s, n), lambda s, n: subset_run(s, n, oversample=True), ("multiplicity",)),
    Recipe("bf16-autocast", "torch.autocast to bfloat16 in a plain loop", "clipping skipped (no-clipping)",
           lambda s, n: digits_run(s, n, autocast=torch.bfloat16),
           lambda s, n: digits_run(s, n, autocast=torch.bfloat16, bug="no-clipping"),
           ("canary_clipping", "clipped_sum", "clipping")),
    Recipe("batch-memory-manager", "logical batch 256 in physical batches of 64", "no noise (no-noise)",
           lambda s, n: memory_managed_run(s, n), lambda s, n: memory_managed_run(s, n, bug="no-noise"),
           ("noise_scale",)),
    Recipe("functorch", 'grad_sample_mode="functorch"', "the same noise every step (reused-noise)",
           lambda s, n: digits_run(s, n, grad_sample_mode="functorch"),
           lambda s, n: digits_run(s, n, grad_sample_mode="functorch", bug="reused-noise"), ("noise_repeats",)),
    Recipe("per-layer-clipping", 'clipping="per_layer"', "the last tensor un-noised (unnoised-layer)",
           lambda s, n: digits_run(s, n, clipping="per_layer"),
           lambda s, n: digits_run(s, n, clipping="per_layer", bug="unnoised-layer"), ("layer",)),
    Recipe("ghost-clipping", 'grad_sample_mode="ghost", token classifier', "nn.Linear's ghost norms halved",
           lambda s, n: ghost_run(s, n), lambda s, n: ghost_run(s, n, bug="halved-linear-norms"),
           ("per_sample_gradients", "canary_clipping")),
    Recipe("bert-lora", "BERT (2 layers, 32 wide) with LoRA via peft, adapters and head in DP-SGD",
           "the classifier head trained by a second plain optimizer",
           lambda s, n: lora_run(s, n), lambda s, n: lora_run(s, n, head_outside=True), ("outside_dp",)),
    Recipe("dp-gan", "DP discriminator, generator trained through its output on generated samples",
           "the generator also fed the private batch",
           lambda s, n: dp_gan_run(s, n), lambda s, n: dp_gan_run(s, n, generator_sees_data=True), ("outside_dp",),
           declines=("the model ran forward more than once before one backward pass",)),
    Recipe("poisson-sampling", "Poisson sampling (DPDataLoader)", "a shuffled loader never made private",
           lambda s, n: sampling_run(s, n), lambda s, n: sampling_run(s, n, poisson=False), ("sampling",)),
    Recipe("lightning-bf16", 'Lightning Trainer, precision="bf16-mixed", DPAuditCallback',
           "a second optimizer in configure_optimizers (manual optimization)",
           lambda s, n: lightning_run(s, n), lambda s, n: lightning_run(s, n, second_optimizer=True), ("outside_dp",)),
    Recipe("lightning-best-recipe", "Lightning, bf16-mixed, batch 256, 4 views averaged per record, EMAWeightAveraging",
           "the views' gradients left unaveraged (views clipped as records)",
           lambda s, n: best_recipe_run(s, n), lambda s, n: best_recipe_run(s, n, views_as_records=True),
           ("multiplicity",), declines=("the model's batch is not the loader's",)),
]}
