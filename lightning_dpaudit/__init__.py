"""lightning_dpaudit: audit differentially private training while it runs."""

from .estimators import EpsilonEstimate, end_to_end_epsilon, epsilon_lower_bound, mu_to_epsilon

__version__ = "0.1.0"

__all__ = ["EpsilonEstimate", "end_to_end_epsilon", "epsilon_lower_bound", "mu_to_epsilon", "__version__"]
