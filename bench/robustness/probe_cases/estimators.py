"""Probe cases: the estimators' bad and unusual input."""

from __future__ import annotations

import math

from .common import Case, HANDLED, INF, NAN, REFUSED, refusal


def estimator_cases():
    import numpy as np

    from lightning_dpaudit import estimators as est

    def bounded(value):  # a valid number
        ok = isinstance(value, (int, float)) and not math.isnan(value) and value >= 0
        return ok, f"returned {value!r}"

    def estimate_ok(e):
        ok = math.isfinite(e.epsilon) and e.epsilon >= 0
        return ok, f"epsilon {e.epsilon:.3g}, n_in {e.n_in}, n_out {e.n_out}"

    def zero_estimate(e):
        return e.epsilon == 0, f"epsilon {e.epsilon:.3g} from {e.n_in}/{e.n_out} scores"

    def bounds_ok(b):
        ok = all(math.isnan(v.epsilon) or v.epsilon >= 0 for v in b.values())
        return ok, "; ".join(f"{k}={v.epsilon:.3g}" for k, v in b.items())

    rng = np.random.default_rng(0)
    same = rng.normal(size=200)
    calls = [
        # (label, call, names, expected, valid)
        ("elb/empty both", lambda: est.epsilon_lower_bound([], [], delta=1e-5), ["in_scores", "scores", "empty"], HANDLED, zero_estimate),
        ("elb/empty in", lambda: est.epsilon_lower_bound([], [0.1, 0.2], delta=1e-5), ["in_scores", "empty"], HANDLED, zero_estimate),
        ("elb/nan", lambda: est.epsilon_lower_bound([NAN], [0.0], delta=1e-5), ["in_scores"], REFUSED, None),
        ("elb/inf out", lambda: est.epsilon_lower_bound([1.0], [INF], delta=1e-5), ["out_scores"], REFUSED, None),
        ("elb/strings", lambda: est.epsilon_lower_bound(["a"], [0.0], delta=1e-5), ["in_scores"], REFUSED, None),
        ("elb/2-D", lambda: est.epsilon_lower_bound(np.zeros((2, 2)), [0.0], delta=1e-5), ["in_scores"], REFUSED, None),
        ("elb/dict", lambda: est.epsilon_lower_bound({"a": 1}, [0.0], delta=1e-5), ["in_scores"], REFUSED, None),
        ("elb/None", lambda: est.epsilon_lower_bound(None, [0.0], delta=1e-5), ["in_scores"], REFUSED, None),
        ("elb/scalar", lambda: est.epsilon_lower_bound(1.0, 0.0, delta=1e-5), ["in_scores"], HANDLED, estimate_ok),
        ("elb/same distribution", lambda: est.epsilon_lower_bound(same[:100], same[100:], delta=1e-5), ["x"], HANDLED,
         lambda e: (e.epsilon < 0.5, f"epsilon {e.epsilon:.3g}")),
        ("elb/identical scores", lambda: est.epsilon_lower_bound([0.5] * 50, [0.5] * 50, delta=1e-5), ["x"], HANDLED, zero_estimate),
        ("elb/delta=0 gdp", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=0), ["delta"], REFUSED, None),
        ("elb/delta=nan", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=NAN), ["delta"], REFUSED, None),
        ("elb/delta=True", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=True), ["delta"], REFUSED, None),
        ("elb/method=x", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=1e-5, method="x"), ["method"], REFUSED, None),
        ("elb/method=None", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=1e-5, method=None), ["method"], REFUSED, None),
        ("elb/threshold=inf", lambda: est.epsilon_lower_bound([1.0] * 9, [0.0] * 9, delta=1e-5, threshold=INF), ["threshold"], HANDLED, estimate_ok),
        ("elb/threshold=True", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=1e-5, threshold=True), ["threshold"], REFUSED, None),
        ("elb/threshold='0.5'", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=1e-5, threshold="0.5"), ["threshold"], REFUSED, None),
        ("elb/threshold=[0.5]", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=1e-5, threshold=[0.5]), ["threshold"], REFUSED, None),
        ("elb/confidence=0", lambda: est.epsilon_lower_bound([1.0], [0.0], delta=1e-5, confidence=0), ["confidence"], REFUSED, None),
        ("elb/best 10**6", lambda: est.epsilon_lower_bound(rng.normal(1, 1, 10**6), rng.normal(0, 1, 10**6), delta=1e-5, threshold="best"), ["x"], HANDLED, estimate_ok),
        ("elb/bool scores", lambda: est.epsilon_lower_bound([True, False], [False], delta=1e-5), ["in_scores"], HANDLED, estimate_ok),
        ("efc/negative", lambda: est.epsilon_from_counts(-1, 1, 1, 1, delta=1e-5), ["tp"], REFUSED, None),
        ("efc/float", lambda: est.epsilon_from_counts(0.5, 1, 1, 1, delta=1e-5), ["tp"], REFUSED, None),
        ("efc/probabilities", lambda: est.epsilon_from_counts(0.9, 0.1, 0.2, 0.8, delta=1e-5), ["tp"], REFUSED, None),
        ("efc/nan", lambda: est.epsilon_from_counts(NAN, 1, 1, 1, delta=1e-5), ["tp"], REFUSED, None),
        ("efc/all zero", lambda: est.epsilon_from_counts(0, 0, 0, 0, delta=1e-5), ["tp", "counts"], HANDLED,
         lambda e: (e.epsilon == 0, f"epsilon {e.epsilon}")),
        ("efc/huge", lambda: est.epsilon_from_counts(10**15, 0, 0, 10**15, delta=1e-5), ["tp"], HANDLED, estimate_ok),
        ("efc/string", lambda: est.epsilon_from_counts("5", 1, 1, 1, delta=1e-5), ["tp"], REFUSED, None),
        ("efc/array", lambda: est.epsilon_from_counts([5, 6], 1, 1, 1, delta=1e-5), ["tp"], REFUSED, None),
        ("efc/bool", lambda: est.epsilon_from_counts(True, 1, 1, 1, delta=1e-5), ["tp"], REFUSED, None),
        ("efc/katz delta", lambda: est.epsilon_from_counts(5, 1, 1, 5, delta=1e-5, method="katz"), ["katz", "method"], REFUSED, None),
        ("efc/bayes", lambda: est.epsilon_from_counts(50, 10, 10, 50, delta=1e-5, method="epsdelta-bayes"), ["x"], HANDLED, estimate_ok),
        ("mfc/mismatch", lambda: est.mu_from_counts([1, 2], [1, 2, 3], [1, 2], [1, 2]), ["shape"], REFUSED, None),
        ("mfc/empty arrays", lambda: est.mu_from_counts([], [], [], []), ["tp"], HANDLED,
         lambda v: (np.size(v) == 0, f"returned {v!r}")),
        ("mfc/bool arrays", lambda: est.mu_from_counts([True], [False], [True], [False]), ["tp"], REFUSED, None),
        ("mfc/nan", lambda: est.mu_from_counts([NAN], [1], [1], [1]), ["tp"], REFUSED, None),
        ("mfc/epsdelta method", lambda: est.mu_from_counts(5, 5, 5, 5, method="epsdelta-cp"), ["method"], REFUSED, None),
        ("mfc/object array", lambda: est.mu_from_counts(np.array([1, "a"], dtype=object), [1, 1], [1, 1], [1, 1]), ["tp"], REFUSED, None),
        ("m2e/negative mu", lambda: est.mu_to_epsilon(-1, 1e-5), ["mu"], REFUSED, None),
        ("m2e/nan mu", lambda: est.mu_to_epsilon(NAN, 1e-5), ["mu"], REFUSED, None),
        ("m2e/inf mu", lambda: est.mu_to_epsilon(INF, 1e-5), ["mu"], HANDLED, lambda v: (v == INF, f"{v}")),
        ("m2e/huge mu", lambda: est.mu_to_epsilon(1e6, 1e-5), ["mu"], HANDLED, bounded),
        ("m2e/delta=0", lambda: est.mu_to_epsilon(1.0, 0), ["delta"], REFUSED, None),
        ("m2e/delta=1", lambda: est.mu_to_epsilon(1.0, 1), ["delta"], REFUSED, None),
        ("m2e/mu str", lambda: est.mu_to_epsilon("1", 1e-5), ["mu"], REFUSED, None),
        ("m2e/tiny delta", lambda: est.mu_to_epsilon(1.0, 1e-300), ["delta"], HANDLED, bounded),
        ("e2m/huge eps", lambda: est.epsilon_to_mu(1e6, 1e-5), ["epsilon"], REFUSED, None),
        ("e2m/nan", lambda: est.epsilon_to_mu(NAN, 1e-5), ["epsilon"], REFUSED, None),
        ("e2m/zero", lambda: est.epsilon_to_mu(0.0, 1e-5), ["epsilon"], HANDLED, bounded),
        ("delta_for/neg eps", lambda: est.delta_for(1.0, -1), ["epsilon"], REFUSED, None),
        ("delta_for/inf eps", lambda: est.delta_for(1.0, INF), ["epsilon"], HANDLED, lambda v: (v == 0, f"{v}")),
        ("cpu/k>n", lambda: est.clopper_pearson_upper(5, 3, 0.95), ["k", "n"], REFUSED, None),
        ("cpu/n=0", lambda: est.clopper_pearson_upper(0, 0, 0.95), ["n"], HANDLED, lambda v: (v == 1.0, f"{v}")),
        ("cpu/level=2", lambda: est.clopper_pearson_upper(1, 3, 2.0), ["level"], REFUSED, None),
        ("cpu/negative", lambda: est.clopper_pearson_upper(-1, 3, 0.95), ["k"], REFUSED, None),
        ("e2e/mu=0", lambda: est.end_to_end_epsilon(0, delta=1e-5, sample_rate=0.1, steps=10), ["mu"], HANDLED, lambda v: (v == 0, f"{v}")),
        ("e2e/mu=inf", lambda: est.end_to_end_epsilon(INF, delta=1e-5, sample_rate=0.1, steps=10), ["mu"], HANDLED, lambda v: (v == INF, f"{v}")),
        ("e2e/steps=0", lambda: est.end_to_end_epsilon(1, delta=1e-5, sample_rate=0.1, steps=0), ["steps"], HANDLED, lambda v: (v == 0, f"{v}")),
        ("e2e/steps=True", lambda: est.end_to_end_epsilon(1, delta=1e-5, sample_rate=0.1, steps=True), ["steps"], REFUSED, None),
        ("e2e/rate=0", lambda: est.end_to_end_epsilon(1, delta=1e-5, sample_rate=0, steps=10), ["sample_rate"], REFUSED, None),
        ("e2e/rate=nan", lambda: est.end_to_end_epsilon(1, delta=1e-5, sample_rate=NAN, steps=10), ["sample_rate"], REFUSED, None),
        ("e2e/history empty", lambda: est.end_to_end_epsilon(1, delta=1e-5, history=[]), ["history"], HANDLED, lambda v: (v == 0, f"{v}")),
        ("e2e/history bad entry", lambda: est.end_to_end_epsilon(1, delta=1e-5, history=[(1.0, 0.1)]), ["history"], REFUSED, None),
        ("e2e/history=str", lambda: est.end_to_end_epsilon(1, delta=1e-5, history="abc"), ["history"], REFUSED, None),
        ("e2e/history=None entries", lambda: est.end_to_end_epsilon(1, delta=1e-5, history=[None]), ["history"], REFUSED, None),
        ("e2e/both", lambda: est.end_to_end_epsilon(1, delta=1e-5, history=[(1, 0.1, 5)], steps=5), ["history"], REFUSED, None),
        ("e2e/gdp acct", lambda: est.end_to_end_epsilon(1, delta=1e-5, sample_rate=0.01, steps=100, accountant="gdp"), ["x"], HANDLED, bounded),
        ("e2e/steps=10**8 rdp", lambda: est.end_to_end_epsilon(0.5, delta=1e-5, sample_rate=0.001, steps=10**8), ["steps"], HANDLED, bounded),
        ("e2e/mu huge rdp", lambda: est.end_to_end_epsilon(1e4, delta=1e-5, sample_rate=0.5, steps=10), ["mu"], HANDLED, bounded),
        ("or/m=0", lambda: est.one_run_epsilon(0, 0, 0), ["num_canaries"], HANDLED, lambda v: (v == 0, f"{v}")),
        ("or/m=10**7", lambda: est.one_run_epsilon(10**7, 1000, 1000), ["num_canaries"], HANDLED, bounded),
        ("or/float counts", lambda: est.one_run_epsilon(100.0, 10.0, 9.0), ["num_canaries"], HANDLED, bounded),
        ("or/probability", lambda: est.one_run_epsilon(100, 10, 0.9), ["num_correct"], REFUSED, None),
        ("or/delta=1", lambda: est.one_run_epsilon(100, 10, 9, delta=1), ["delta"], REFUSED, None),
        ("or/str", lambda: est.one_run_epsilon("100", 10, 9), ["num_canaries"], REFUSED, None),
        ("orp/eps inf", lambda: est.one_run_p_value(INF, num_canaries=10, num_guesses=5, num_correct=5, delta=0), ["epsilon"], HANDLED,
         lambda v: (0 <= v <= 1, f"p={v}")),
        ("orp/eps nan", lambda: est.one_run_p_value(NAN, num_canaries=10, num_guesses=5, num_correct=5, delta=0), ["epsilon"], REFUSED, None),
        ("orf/delta=0", lambda: est.one_run_fdp_epsilon(100, 10, 9, delta=0), ["delta"], REFUSED, None),
        ("orf/delta=nan", lambda: est.one_run_fdp_epsilon(100, 10, 9, delta=NAN), ["delta"], REFUSED, None),
        ("orf/confidence=1", lambda: est.one_run_fdp_epsilon(100, 10, 9, delta=1e-5, confidence=1), ["confidence"], REFUSED, None),
        ("orf/r>m", lambda: est.one_run_fdp_epsilon(10, 20, 9, delta=1e-5), ["num_guesses"], REFUSED, None),
        ("orf/all right", lambda: est.one_run_fdp_epsilon(1000, 100, 100, delta=1e-5), ["x"], HANDLED, bounded),
        ("orb/probabilities", lambda: est.one_run_bounds({"loss": [0.1, 0.2, 0.3]}, [0.2, 0.7, 0.9], delta=1e-5), ["included"], REFUSED, None),
        ("orb/mismatch", lambda: est.one_run_bounds({"loss": [0.1, 0.2]}, [True, False, True], delta=1e-5), ["scores"], REFUSED, None),
        ("orb/empty scores", lambda: est.one_run_bounds({}, [True, False], delta=1e-5), ["scores"], REFUSED, None),
        ("orb/empty included", lambda: est.one_run_bounds({"loss": []}, [], delta=1e-5), ["canaries", "included"], REFUSED, None),
        ("orb/nan score", lambda: est.one_run_bounds({"loss": [NAN, 0.1]}, [True, False], delta=1e-5), ["scores"], REFUSED, None),
        ("orb/scores=list", lambda: est.one_run_bounds([0.1, 0.2], [True, False], delta=1e-5), ["scores"], REFUSED, None),
        ("orb/scores=array", lambda: est.one_run_bounds(np.array([0.1, 0.2]), [True, False], delta=1e-5), ["scores"], REFUSED, None),
        ("orb/selection=x", lambda: est.one_run_bounds({"loss": [0.1, 0.2]}, [True, False], delta=1e-5, selection="x"), ["selection"], REFUSED, None),
        ("orb/seed=-1 split", lambda: est.one_run_bounds({"loss": list(range(10))}, [True, False] * 5, delta=1e-5, selection="split", seed=-1), ["seed"], REFUSED, None),
        ("orb/all included", lambda: est.one_run_bounds({"loss": list(range(10))}, [True] * 10, delta=1e-5), ["x"], HANDLED, bounds_ok),
        ("orb/2-D scores", lambda: est.one_run_bounds({"loss": np.zeros((2, 2))}, [True, False], delta=1e-5), ["scores"], REFUSED, None),
        ("orb/delta=0", lambda: est.one_run_bounds({"loss": list(range(10))}, [True, False] * 5, delta=0), ["delta"], HANDLED, bounds_ok),
        ("orb/random scores", lambda: est.one_run_bounds({"loss": rng.normal(size=1000)}, rng.random(1000) < 0.5, delta=1e-5), ["x"], HANDLED,
         lambda b: (all(v.epsilon < 1.0 or math.isnan(v.epsilon) for v in b.values()), "; ".join(f"{k}={v.epsilon:.3g}" for k, v in b.items()))),
    ]
    return [Case(f"estimator/{label}", "estimators", expect, _estimator_case(call, names, valid))
            for label, call, names, expect, valid in calls]


def _estimator_case(call, names, valid):
    def run():
        return refusal(call, names, valid)
    return run
