"""The final-model audit (Steinke, Nasr, Jagielski 2023): canaries each trained on with
probability 1/2 from a secret seed, scored with the final model only."""

from .canaries import CanaryDataset, FinalModelCanaries
from .examples import FINAL_MODEL_KINDS, DataTemplate, fingerprint, make_examples
from .scores import cross_entropy, logit_margin, score_canaries

__all__ = [
    "FINAL_MODEL_KINDS", "CanaryDataset", "DataTemplate", "FinalModelCanaries", "cross_entropy", "fingerprint",
    "logit_margin", "make_examples", "score_canaries",
]
