"""The final-model audit's canary examples: public, deterministic from `example_seed`.

Kinds (m examples each, labels in [0, num_classes)):

    ood         uniform noise over [min, max] of the training inputs, in their shape and
                dtype, with uniformly random labels
    mislabeled  m distinct held-out examples, each with a uniformly random wrong label
    blank       all-zero inputs, labels cycling through the classes from a random start.
                Weak here: blanks of one label are the same example, so including one
                raises the others' scores and their memberships look alike
    crafted     mislabeled examples moved by Algorithm 3 (Tight Auditing, Nasr et al.
                2023) on the initial model so that grad_theta l(theta_0; x, y) is nearly
                orthogonal to the held-out data's mean gradient, i.e. to what the data
                pushes (input_canaries.craft, in chunks of CRAFT_CHUNK)
    custom      the user's own (inputs, labels)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np
import torch

from ..canaries.input_canaries import craft, make_input_canaries, mean_gradient

FINAL_MODEL_KINDS = ("ood", "mislabeled", "blank", "crafted")
TEMPLATE_ITEMS = 256  # training items read for the input shape, dtype, value range and labels
CRAFT_STEPS, CRAFT_STEP_SIZE, CRAFT_CHUNK = 50, 0.05, 64

Examples = Tuple[torch.Tensor, torch.Tensor]


def _is_label(y) -> bool:
    if torch.is_tensor(y):
        return y.dim() == 0 and not y.is_floating_point() and not y.is_complex() and y.dtype != torch.bool
    return isinstance(y, (int, np.integer)) and not isinstance(y, bool)


def split_item(item, index: int):
    """(input tensor, class label) of one training item, or a ValueError naming what it is."""
    if not (isinstance(item, (tuple, list)) and len(item) == 2 and torch.is_tensor(item[0]) and _is_label(item[1])):
        what = type(item).__name__
        if isinstance(item, (tuple, list)):
            what += f" ({', '.join(type(v).__name__ for v in item)})"
        raise ValueError(
            f"final-model canaries need a dataset of (input tensor, integer class label) pairs; item {index} is a {what}"
        )
    return item


@dataclass(frozen=True)
class DataTemplate:
    """What the canaries take from the training data: one input's shape and dtype, the
    inputs' value range [low, high], the label type (None: Python int) and max label + 1."""

    shape: tuple
    dtype: torch.dtype
    low: float
    high: float
    label_dtype: Optional[torch.dtype]
    classes_seen: int

    @classmethod
    def of(cls, dataset) -> "DataTemplate":
        """Read from the first TEMPLATE_ITEMS items (all labels of a TensorDataset)."""
        n = len(dataset)
        if n == 0:
            raise ValueError("Unexpected value for `dataset`: it is empty; the canaries are added to training data")
        items = [split_item(dataset[i], i) for i in range(min(n, TEMPLATE_ITEMS))]
        x0, y0 = items[0]
        for i, (x, _) in enumerate(items):
            if x.shape != x0.shape or x.dtype != x0.dtype:
                raise ValueError(
                    f"training inputs differ in shape or dtype (item 0: {tuple(x0.shape)} {x0.dtype}, item {i}: "
                    f"{tuple(x.shape)} {x.dtype}); final-model canaries need one input shape"
                )
        tensors = getattr(dataset, "tensors", None)
        labels = tensors[1] if tensors is not None and len(tensors) == 2 else torch.as_tensor([int(y) for _, y in items])
        low = min(float(x.min()) for x, _ in items)
        high = max(float(x.max()) for x, _ in items)
        return cls(tuple(x0.shape), x0.dtype, low, high, y0.dtype if torch.is_tensor(y0) else None, int(labels.max()) + 1)


def check_examples(name: str, inputs, labels) -> Examples:
    """inputs (m, ...) and labels (m,) integer class indices, m >= 2, or a ValueError naming `name`."""
    if not torch.is_tensor(inputs) or not torch.is_tensor(labels):
        got = f"{type(inputs).__name__} and {type(labels).__name__}"
        raise ValueError(f"Unexpected value for `{name}`: {got}; pass an inputs tensor and a labels tensor")
    if inputs.dim() < 1 or labels.dim() != 1 or len(inputs) != len(labels):
        raise ValueError(
            f"Unexpected value for `{name}`: inputs of shape {tuple(inputs.shape)} and labels of shape "
            f"{tuple(labels.shape)}; use (m, ...) inputs and (m,) labels"
        )
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8) or (len(labels) and labels.min() < 0):
        raise ValueError(f"Unexpected value for `{name}`: labels {labels.dtype}; use class indices >= 0 (not one-hot)")
    if inputs.is_floating_point() and not bool(inputs.isfinite().all()):
        bad = int((~inputs.isfinite()).sum())
        raise ValueError(f"Unexpected value for `{name}`: {bad} of its {inputs.numel()} input values are not finite; use finite inputs")
    return inputs.detach().cpu(), labels.detach().cpu().long()


def make_examples(
    kind: str,
    count: int,
    *,
    num_classes: int,
    example_seed: int,
    held_out: Optional[Examples] = None,
    model: Optional[torch.nn.Module] = None,
    loss_fn: Optional[Callable] = None,
    template: Optional[DataTemplate] = None,
) -> Examples:
    """`count` canaries of `kind` as (inputs (count, ...), labels (count,) int64) on the CPU.

    held_out: examples not trained on ("mislabeled", "crafted"; the shape of "blank").
    template: the training data's (DataTemplate: "ood"; "blank" without held_out).
    loss_fn(outputs, labels) -> per-example losses (crafting sums them).
    """
    generator = torch.Generator().manual_seed(example_seed)
    if kind == "ood":
        shape, low, high = (count, *template.shape), template.low, template.high
        if template.dtype.is_floating_point:
            uniform = torch.rand(shape, generator=generator, dtype=torch.float64)
            inputs = (low + (high - low) * uniform).to(template.dtype)
        else:
            inputs = torch.randint(int(low), int(high) + 1, shape, generator=generator, dtype=template.dtype)
        return inputs, torch.randint(num_classes, (count,), generator=generator)
    if kind == "blank":
        like = held_out[0][:1] if held_out is not None else torch.zeros((1, *template.shape), dtype=template.dtype)
        return make_input_canaries("blank", None, like, None, count=count, num_classes=num_classes, generator=generator)
    x, y = make_input_canaries(
        "mislabeled", None, held_out[0], held_out[1], count=count, num_classes=num_classes, generator=generator
    )
    if kind == "crafted":
        summed = lambda outputs, labels: loss_fn(outputs, labels).sum()  # noqa: E731
        reference = mean_gradient(model, summed, *held_out)
        x = torch.cat([
            craft(model, summed, x[i : i + CRAFT_CHUNK], y[i : i + CRAFT_CHUNK], reference, steps=CRAFT_STEPS,
                  step_size=CRAFT_STEP_SIZE)
            for i in range(0, count, CRAFT_CHUNK)
        ])
    return x, y


def check_kind_inputs(kind: str, count: int, held_out, model) -> Optional[Examples]:
    """held_out checked for `kind` (None where the kind does not use it), or a ValueError."""
    if kind not in FINAL_MODEL_KINDS:
        raise ValueError(
            f"Unexpected value for `kind`: {kind!r}; final-model canary kinds are {', '.join(FINAL_MODEL_KINDS)} "
            "(or pass your own `inputs` and `labels`)"
        )
    if kind == "crafted" and model is None:
        raise ValueError("'crafted' canaries need `model=`: the initial model, before training, to craft them on")
    if held_out is None:
        if kind in ("mislabeled", "crafted"):
            raise ValueError(f"{kind!r} canaries need `held_out=(inputs, labels)`: examples not in the training data")
        return None
    if not isinstance(held_out, (tuple, list)) or len(held_out) != 2:
        raise ValueError(f"Unexpected value for `held_out`: {type(held_out).__name__}; use a tuple (inputs, labels)")
    held_out = check_examples("held_out", *held_out)
    if kind in ("mislabeled", "crafted") and len(held_out[0]) < count:
        raise ValueError(
            f"Unexpected value for `count`: {count}; {kind!r} canaries are distinct held-out examples and `held_out` "
            f"has {len(held_out[0])} (repeats would make the canaries' memberships depend on each other)"
        )
    return held_out


def fingerprint(inputs: torch.Tensor, labels: torch.Tensor) -> str:
    """sha256 hex of the examples' shapes, dtypes and bytes."""
    digest = hashlib.sha256()
    for t in (inputs, labels):
        t = t.detach().cpu().contiguous()
        digest.update(f"{tuple(t.shape)} {t.dtype};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
