"""Statistics that turn audit observations into lower bounds on epsilon (numpy/scipy only)."""

from .bounds import (
    METHODS,
    EpsilonEstimate,
    clopper_pearson_upper,
    epsilon_from_counts,
    epsilon_lower_bound,
    mu_from_counts,
)
from .composition import end_to_end_epsilon
from .gdp import delta_for, epsilon_to_mu, mu_to_epsilon
from .one_run import one_run_epsilon, one_run_p_value
from .one_run_fdp import one_run_fdp_epsilon
from .one_run_guesses import GuessBound, one_run_bounds

__all__ = [
    "METHODS",
    "EpsilonEstimate",
    "GuessBound",
    "clopper_pearson_upper",
    "delta_for",
    "end_to_end_epsilon",
    "epsilon_from_counts",
    "epsilon_lower_bound",
    "epsilon_to_mu",
    "mu_from_counts",
    "mu_to_epsilon",
    "one_run_bounds",
    "one_run_epsilon",
    "one_run_fdp_epsilon",
    "one_run_p_value",
]
