"""Final-model canaries (Steinke, Nasr, Jagielski 2023, "Privacy auditing with one (1) training run").

m canary examples x_1..x_m are public; S_i ~ Bernoulli(1/2) independently, drawn from a
secret seed, decides whether x_i joins the training data. After training only the final
model is seen: a score per canary (scores.py) guesses S_i, and correct guesses beyond
what epsilon-DP allows bound epsilon from below (analysis.final_model).
"""

from __future__ import annotations

import operator
import secrets
import weakref
from typing import Callable, Dict, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from ...analysis import final_model as final_model_analysis
from ...analysis.schema import AuditStateError, Field, Section, StateError
from ..values import integer
from .examples import DataTemplate, Examples, check_examples, check_kind_inputs, fingerprint, make_examples
from .scores import canary_losses, cross_entropy, score_canaries

STATE_VERSION = 1
MAX_CANARIES = 10**6  # m: the examples, the inclusion and every score are held in memory (and scored) at once


_WHY_MAX = " (10**6: the canaries and their scores are held in memory at once)"


def _start_losses(losses, ctx):
    count = ctx.get("count")
    return None if count is None or len(losses) == count else f"holds {len(losses)} losses; the audit has {count} canaries"


# The final-model audit's state: plain values (torch.save and JSON); ctx "count": this audit's m.
FINAL_MODEL = Section(
    "final_model",
    Field("version", "int", rule=lambda v, ctx: None if v == STATE_VERSION else f"is {v}; expected {STATE_VERSION}"),
    Field("seed", "int", low=0),
    Field("count", "int", low=2, high=MAX_CANARIES),
    Field("kind", "str"),
    Field("examples_fingerprint", "str", null=True),
    Field("start_losses", "list", null=True, items=Field("loss", "real", finite="no-nan"), rule=_start_losses),
)


class FinalModelCanaries:
    """m canaries for a final-model audit: the examples, the secret inclusion, the scores.

    count: m, 2 to MAX_CANARIES (10**6). kind: "ood", "mislabeled", "blank" or "crafted" (examples.py); or pass
    your own `inputs` and `labels` (kind "custom", m = len(inputs), `count` unused).
    held_out=(inputs, labels): examples not trained on ("mislabeled", "crafted").
    num_classes: labels lie in [0, num_classes); default max held-out label + 1, else
    (for "ood" and "blank" without held_out) max label + 1 among the training items read
    at wrap() (TEMPLATE_ITEMS of them, all of a TensorDataset).
    model: the initial model ("crafted" only; not kept). example_seed: the public examples.
    seed: the secret inclusion, S = default_rng(seed).random(m) < 1/2 (None: 63 bits of
    OS entropy, independent of every global random state). loss_fn(outputs, labels): one
    loss per example (reduction="none"; default cross-entropy). batch_size: scoring batches.

    The inclusion is fixed at the first use of a wrapped dataset or of `included`; until
    then load_state_dict may replace the seed (a checkpoint restored before the data
    loader is built), after it a different seed is refused.
    """

    def __init__(self, count: int = 1000, kind: str = "ood", *, inputs=None, labels=None, held_out=None,
                 num_classes: Optional[int] = None, model: Optional[torch.nn.Module] = None, seed: Optional[int] = None,
                 example_seed: int = 0, loss_fn: Optional[Callable] = None, batch_size: int = 256):
        self._batch_size = integer("batch_size", batch_size, 1)
        self._example_seed = integer("example_seed", example_seed, 0)
        self._seed = secrets.randbits(63) if seed is None else integer("seed", seed, 0)
        if num_classes is not None:
            num_classes = integer("num_classes", num_classes, 2)
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError(
                f"Unexpected value for `loss_fn`: {loss_fn!r}; use a callable (outputs, labels) -> per-example losses"
            )
        self._loss_fn = loss_fn
        self._frozen = False
        self._wrapped = False  # wrap() made a training dataset
        self._start: Optional[np.ndarray] = None
        self._pending_fingerprint: Optional[str] = None
        self._examples: Optional[Examples] = None
        if inputs is not None or labels is not None:
            if inputs is None or labels is None:
                raise ValueError("custom canaries need both `inputs` and `labels`; got only one of them")
            checked = check_examples("inputs", inputs, labels)
            self._kind, self._count = "custom", integer("len(inputs)", len(inputs), 2, MAX_CANARIES, _WHY_MAX)
            self._examples = tuple(t.clone() for t in checked)
            self._num_classes = num_classes or int(self._examples[1].max()) + 1
            if int(self._examples[1].max()) >= self._num_classes:
                raise ValueError(f"Unexpected value for `num_classes`: {num_classes}; `labels` go up to {int(labels.max())}")
            return
        self._count = integer("count", count, 2, MAX_CANARIES, _WHY_MAX)
        held_out = check_kind_inputs(kind, self._count, held_out, model)
        self._kind = kind
        if num_classes is None and held_out is not None:
            num_classes = int(held_out[1].max()) + 1
            if num_classes < 2:
                raise ValueError("`held_out` has one class only; pass `num_classes`")
        self._num_classes = num_classes
        if kind in ("mislabeled", "crafted") or (kind == "blank" and held_out is not None):
            self._examples = make_examples(kind, self._count, num_classes=num_classes, example_seed=self._example_seed,
                                           held_out=held_out, model=model, loss_fn=loss_fn or cross_entropy)

    @property
    def count(self) -> int:
        return self._count

    @property
    def kind(self) -> str:
        """The kind of canary, "custom" for the user's own examples."""
        return self._kind

    @property
    def examples(self) -> Examples:
        """The public canary examples (inputs (m, ...), labels (m,) int64)."""
        if self._examples is None:
            raise ValueError(f"{self._kind!r} canaries are made from the training data: call wrap(dataset) first")
        return self._examples

    @property
    def included(self) -> np.ndarray:
        """The secret inclusion S (bool, (m,)); reading it fixes it."""
        self._frozen = True
        return np.random.default_rng(self._seed).random(self._count) < 0.5

    @property
    def wrapped(self) -> bool:
        """True once wrap() has made a training dataset with the included canaries (CanaryDataModule calls it)."""
        return self._wrapped

    @property
    def num_included(self) -> int:
        return int(self.included.sum())

    @property
    def start_losses(self) -> Optional[np.ndarray]:
        """Per-canary losses recorded by record_start (float64, (m,)), or None."""
        return None if self._start is None else self._start.copy()

    def wrap(self, dataset) -> "CanaryDataset":
        """`dataset` (items (input, label)) followed by the included canaries."""
        if dataset is None or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ValueError(
                f"Unexpected value for `dataset`: {type(dataset).__name__}; pass a map-style dataset of (input, label) items"
            )
        if isinstance(dataset, CanaryDataset):
            raise ValueError("Unexpected value for `dataset`: it is already a CanaryDataset; wrap the base dataset once")
        template = DataTemplate.of(dataset)
        if self._examples is None:
            self._build(template)
        shape = tuple(self._examples[0].shape[1:])
        if shape != template.shape:
            raise ValueError(f"the canary inputs have shape {shape} and the training inputs {template.shape}")
        self._wrapped = True
        return CanaryDataset(dataset, self, template.dtype, template.label_dtype)

    def _build(self, template: DataTemplate) -> None:
        num_classes = self._num_classes or template.classes_seen
        if num_classes < 2:
            raise ValueError(
                f"could not infer `num_classes` for {self._kind!r} canaries: the training labels read go up to "
                f"{num_classes - 1}; pass num_classes="
            )
        if self._kind == "ood" and not template.low < template.high:
            raise ValueError(f"the training inputs read are all {template.low}; 'ood' noise needs a range of values")
        examples = make_examples(self._kind, self._count, num_classes=num_classes, example_seed=self._example_seed,
                                 template=template)
        self._check_fingerprint(self._pending_fingerprint, examples)
        self._examples, self._num_classes, self._pending_fingerprint = examples, num_classes, None

    def _check_fingerprint(self, saved: Optional[str], examples: Optional[Examples]) -> None:
        if saved is None or examples is None or fingerprint(*examples) == saved:
            return
        raise ValueError(
            f"the saved audit's {self._kind!r} canary examples (sha256 {saved[:12]}...) differ from this one's "
            f"({fingerprint(*examples)[:12]}...); make them with the same example_seed, held_out, initial model "
            "('crafted') and training data ('ood', 'blank')"
        )

    def _included_examples(self) -> Examples:
        """The included canaries, for CanaryDataset; fixes the inclusion."""
        mask = torch.from_numpy(self.included)
        inputs, labels = self.examples
        return inputs[mask], labels[mask]

    def record_start(self, model: torch.nn.Module) -> None:
        """Record each canary's loss l_i(theta_0) under the model before training ("loss_change")."""
        _check_model(model)
        if self._start is not None:
            raise ValueError(
                "the start losses are already recorded (or loaded from a checkpoint); record them once, before training"
            )
        self._start = canary_losses(model, *self.examples, loss_fn=self._loss_fn, batch_size=self._batch_size)

    def score(self, model: torch.nn.Module) -> Dict[str, np.ndarray]:
        """{"loss", "logit_margin"[, "loss_change"]} per canary (scores.py); larger = more likely included."""
        _check_model(model)
        return score_canaries(model, *self.examples, loss_fn=self._loss_fn, batch_size=self._batch_size,
                              start_losses=self._start)

    def audit(self, model: torch.nn.Module, *, delta: float, confidence: float = 0.95,
              accountant_epsilon: Optional[float] = None, epoch: Optional[int] = None, step: Optional[int] = None,
              selection: str = "union"):
        """Epsilon lower bounds from the model's scores and the inclusion (analysis.final_model)."""
        epoch = None if epoch is None else integer("epoch", epoch, 0)
        step = None if step is None else integer("step", step, 0)
        if accountant_epsilon is not None:  # nan: not known (the accountant's epsilon skipped at this call)
            if (isinstance(accountant_epsilon, bool) or not isinstance(accountant_epsilon, (int, float, np.integer, np.floating))
                    or accountant_epsilon < 0):
                raise ValueError(
                    f"Unexpected value for `accountant_epsilon`: {accountant_epsilon!r}; use a number >= 0, nan (not "
                    "known) or None"
                )
        return final_model_analysis.audit_final_model(
            self.score(model), self.included, delta=delta, confidence=confidence, accountant_epsilon=accountant_epsilon,
            epoch=epoch, step=step, selection=selection, kind=self._kind,
        )

    def state_dict(self) -> dict:
        """Plain values (torch.save and JSON): the seed, what the canaries are, the start losses."""
        built = self._examples is not None
        return FINAL_MODEL.dump({
            "version": STATE_VERSION,
            "seed": int(self._seed),
            "count": self._count,
            "kind": self._kind,
            "examples_fingerprint": fingerprint(*self._examples) if built else self._pending_fingerprint,
            "start_losses": None if self._start is None else [float(v) for v in self._start],
        })

    def load_state_dict(self, state: dict) -> None:
        """Take the saved seed and start losses after checking them (FINAL_MODEL) and that the canaries are the
        same; nothing changes on error (AuditStateError, a ValueError, naming the field)."""
        check_final_model(state)
        if (state["count"], state["kind"]) != (self._count, self._kind):
            raise ValueError(
                f"saved audit has {state['count']} {state['kind']!r} canaries, this one {self._count} {self._kind!r}"
            )
        self._check_fingerprint(state["examples_fingerprint"], self._examples)
        seed = integer("seed", state["seed"], 0)
        if self._frozen and seed != self._seed:
            raise ValueError(
                "the saved audit's inclusion seed differs from the one this audit already used: the training data "
                "already holds this audit's canaries, not the saved ones; load the saved state before the wrapped "
                "dataset is first used (len or indexing) or `included` is read"
            )
        start = state["start_losses"]
        if start is not None:
            start = np.asarray(start, dtype=np.float64)
            if start.shape != (self._count,):
                raise ValueError(f"the saved start losses have shape {start.shape}; expected ({self._count},)")
        self._seed, self._start = seed, start
        if self._examples is None:
            self._pending_fingerprint = state["examples_fingerprint"]


def check_final_model(state, count: Optional[int] = None) -> None:
    """AuditStateError naming the field unless `state` is a final-model audit's state (of `count` canaries)."""
    try:
        FINAL_MODEL.check(state, {"count": count if count is not None else (state.get("count") if isinstance(state, dict) else None)},
                          path="final_model")
    except StateError as error:
        raise AuditStateError(f"the saved final-model audit's {error}; it is damaged or not a final-model audit's state") from None


def _check_model(model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"Unexpected value for `model`: {type(model).__name__}; pass the trained torch.nn.Module")


class CanaryDataset(Dataset):
    """The base dataset's n items, then the k included canaries as (input, label) pairs.

    Inputs take the base inputs' dtype, labels the base labels' type (int or a 0-d tensor).
    It holds neither the seed nor the inclusion: until first used (len or indexing) a weak
    reference to the audit, after that only the included examples, which it asks the
    audit for. Pickling (data-loader workers) uses it first.
    """

    def __init__(self, base, audit: FinalModelCanaries, input_dtype: torch.dtype, label_dtype: Optional[torch.dtype]):
        self.base = base
        self._audit = weakref.ref(audit)
        self._input_dtype, self._label_dtype = input_dtype, label_dtype
        self._inputs: Optional[torch.Tensor] = None
        self._labels: Optional[torch.Tensor] = None

    def _canaries(self) -> Examples:
        if self._inputs is None:
            audit = self._audit()
            if audit is None:
                raise RuntimeError(
                    "the FinalModelCanaries that wrapped this dataset no longer exists; keep a reference to it: it "
                    "holds the secret inclusion and scores the trained model"
                )
            inputs, self._labels = audit._included_examples()
            self._inputs, self._audit = inputs.to(self._input_dtype), None
        return self._inputs, self._labels

    def __len__(self) -> int:
        return len(self.base) + len(self._canaries()[0])

    def __getitem__(self, index):
        inputs, labels = self._canaries()
        n, total = len(self.base), len(self.base) + len(inputs)
        index = operator.index(index)
        if index < 0:
            index += total
        if not 0 <= index < total:
            raise IndexError(f"index {index} out of range for a CanaryDataset of {total} items")
        if index < n:
            return self.base[index]
        label = labels[index - n]
        return inputs[index - n], int(label) if self._label_dtype is None else label.to(self._label_dtype)

    def __getstate__(self) -> dict:
        self._canaries()
        return dict(self.__dict__)
