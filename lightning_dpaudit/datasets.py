"""Data for examples and first runs, made on the machine (nothing is downloaded): scikit-learn's bundled digits,
a small CNN, Opacus's make_private over both, and a plain training loop."""

from .integrations.digits import DigitsCNN, digits_dataset, digits_holdout, make_private_digits, train_steps

__all__ = ["DigitsCNN", "digits_dataset", "digits_holdout", "make_private_digits", "train_steps"]
