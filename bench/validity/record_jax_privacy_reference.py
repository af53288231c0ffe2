"""Record reference one-run epsilon lower bounds from the PyPI package `jax-privacy`.

The package is NOT a dependency of lightning_dpaudit; run this script with a
separate virtualenv that has it installed, e.g.

    python3 -m venv /tmp/jp-venv
    /tmp/jp-venv/bin/pip install jax-privacy==2.0.0
    /tmp/jp-venv/bin/python bench/validity/record_jax_privacy_reference.py

(jax-privacy 2.0.0 pulls in CPU jax/jaxlib, optax, chex, pydantic and dp_accounting,
about 650 MB, but no torch or tensorflow; the package is imported normally.)

It writes tests/data/jax_privacy_reference.json, which our tests compare against.
Two bounds from jax_privacy/auditing.py are recorded, each for a list of
(m, r, v, delta, confidence) cases: m canaries, r guesses, v of them correct:

  "one_run":     _epsilon_one_run(0, m, r, v, 1 - confidence, delta)
                 (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1)
                 Training Run", arXiv:2305.08846, one-sided guesses only)
  "one_run_fdp": _epsilon_one_run_fdp(0, m, r, v, 1 - confidence, delta)
                 (Mahloujifar, Melis & Chaudhuri 2024, "Auditing f-Differential
                 Privacy in One Run", arXiv:2410.22235, Gaussian f-DP family)

Both functions are private; the public route, CanaryScoreAuditor(in_scores,
out_scores).epsilon_one_run[_fdp](significance, delta,
threshold_strategy=Explicit(t)), calls them with (0, len(in) + len(out), #scores >= t,
#in-scores >= t, significance, delta), and this script checks that it returns the
same value for every case with delta > 0 (the public methods reject delta = 0).

jax-privacy finds each epsilon with scipy.optimize.brentq(..., xtol=1e-6), so its
values ("epsilon") are only accurate to about 1e-6. Each value is also computed with
the same code and only that tolerance tightened to 1e-12 ("epsilon_tight", see
tight_brentq below). The whole run takes a few seconds.
"""

import contextlib
import json
import platform
from importlib.metadata import version

from _path import harness

import numpy as np
import scipy.optimize
from jax_privacy import auditing

OUT = harness.ROOT / "tests" / "data" / "jax_privacy_reference.json"

# (m, r, v, delta, confidence): m canaries, r guesses, v correct guesses.
# "one_run" uses every row; "one_run_fdp" only the rows with delta > 0: the Gaussian
# f-DP curve of an (eps, 0)-DP claim is the trivial one (dp_accounting's
# get_sigma_gaussian(eps, 0) is inf for every eps), so no finite bound exists there.
CASES = [
    (1000, 100, 100, 1e-5, 0.95),  # headline: 100 guesses, all correct
    (1000, 100, 90, 1e-5, 0.95),  # headline: 100 guesses, 90% correct
    (1000, 100, 100, 1e-5, 0.99),  # headline cases at 99% confidence
    (1000, 100, 90, 1e-5, 0.99),
    (100, 10, 10, 0.0, 0.95),  # small m, few guesses, all correct, pure DP
    (100, 30, 30, 1e-5, 0.99),  # small m, all correct
    (100, 50, 40, 1e-5, 0.95),  # small m, half guessed
    (100, 100, 75, 1e-3, 0.99),  # small m, every canary guessed (r = m)
    (500, 50, 45, 0.0, 0.99),  # pure DP, 90% correct
    (500, 200, 150, 1e-3, 0.95),  # large delta, 75% correct
    (500, 500, 260, 1e-5, 0.95),  # r = m, barely above chance
    (1000, 300, 240, 1e-3, 0.95),  # large delta, 80% correct
    (1000, 500, 250, 1e-5, 0.95),  # exactly chance level: bound 0
    (1000, 1000, 700, 1e-5, 0.95),  # r = m, 70% correct
    (2000, 20, 20, 1e-5, 0.99),  # large m, very few guesses
    (2000, 200, 190, 0.0, 0.95),  # large m, pure DP, 95% correct
    # large m and delta, 80% correct: the one-run bound is 0 (its delta term 2 m delta = 4
    # swamps it; 1.2021 at delta = 0), the f-DP bound is not
    (2000, 1000, 800, 1e-3, 0.99),
    (2000, 2000, 1100, 1e-5, 0.95),  # r = m, 55% correct
]

JAX_XTOL = 1e-6  # what jax-privacy passes to brentq for both bounds
TIGHT_XTOL = 1e-12

DEFINITIONS = {
    "cases": (
        "m canaries, each included with probability 1/2; the attack guesses r of them (all as "
        "'included', one-sided) and v guesses are correct. significance = 1 - confidence. Both bounds "
        "return the largest epsilon whose (epsilon, delta)-DP claim is rejected at that significance, "
        "found by brentq over eps >= 0 after doubling an upper bracket from 1, and 0 if even "
        "epsilon = 0 is not rejected."
    ),
    "one_run": (
        "Steinke et al. 2023, p-value as in jax_privacy.auditing._one_run_p_value: "
        "q = expit(eps), beta = P(Binomial(r, q) >= v); for delta = 0 the p-value is beta, otherwise "
        "min(1, beta + 2 m delta max_{1<=i<=v} (P(Binomial(r, q) >= v - i) - beta) / i). "
        "epsilon = root of p-value(eps) = significance."
    ),
    "one_run_fdp": (
        "Mahloujifar et al. 2024, 'audit_rh_with_cap' for the Gaussian f-DP curve of (eps, delta): "
        "sigma = dp_accounting.get_sigma_gaussian(eps, delta), blow_up_inv(x) = Phi(Phi^-1(x) - 1/sigma); "
        "start r_ = significance v / m, h = significance (r - v) / m, then for i = v-1 down to 0: "
        "h' = max(h, blow_up_inv(r_)), stop if h' == h, r_ = min(r_ + i/(r - i) (h' - h), 1), h = h'. "
        "The claim is rejected when r_ + h > r / m; epsilon = root of r_ + h - r/m = 0."
    ),
}

TIGHT = {
    "field": "epsilon_tight",
    "patch": (
        "While epsilon_tight is computed, scipy.optimize.brentq is replaced by a wrapper that calls the "
        "original with xtol = min(xtol passed, 1e-12); jax-privacy passes xtol=1e-6 (rtol left at scipy's "
        "default 4 * machine eps). dp_accounting.get_sigma_gaussian also calls brentq, with xtol=1e-12 "
        "already, so it is unchanged. Only the root-finding tolerance changes."
    ),
    "accuracy": "'epsilon' is within about 1e-6 of 'epsilon_tight'; see max_abs_diff.",
}


@contextlib.contextmanager
def tight_brentq():
    """Run jax-privacy's code with brentq's xtol tightened to TIGHT_XTOL."""
    original = scipy.optimize.brentq
    hits = []

    def brentq(*args, **kwargs):
        if kwargs.get("xtol") == JAX_XTOL:
            hits.append(1)
        kwargs["xtol"] = min(kwargs.get("xtol", TIGHT_XTOL), TIGHT_XTOL)
        return original(*args, **kwargs)

    scipy.optimize.brentq = brentq
    try:
        yield hits
    finally:
        scipy.optimize.brentq = original


def via_auditor(method, m, r, v, delta, confidence):
    """The same bound through the public CanaryScoreAuditor with an explicit threshold."""
    n_in = v + (m - r) // 2  # any split with v <= n_in and r - v <= m - n_in works
    in_scores = np.r_[np.ones(v), np.zeros(n_in - v)]
    out_scores = np.r_[np.ones(r - v), np.zeros(m - n_in - (r - v))]
    auditor = auditing.CanaryScoreAuditor(in_scores, out_scores)
    return getattr(auditor, method)(1 - confidence, delta,
                                    threshold_strategy=auditing.Explicit(0.5))


def main() -> None:
    out = {}
    max_diff = 0.0
    for key, fn, method in (
        ("one_run", auditing._epsilon_one_run, "epsilon_one_run"),
        ("one_run_fdp", auditing._epsilon_one_run_fdp, "epsilon_one_run_fdp"),
    ):
        records = []
        for m, r, v, delta, confidence in CASES:
            if key == "one_run_fdp" and delta == 0:
                continue
            eps = float(fn(0, m, r, v, 1 - confidence, delta))
            with tight_brentq() as hits:
                tight = float(fn(0, m, r, v, 1 - confidence, delta))
            # brentq is skipped only when the bound is 0 (claim not rejected at eps = 0).
            assert hits or (eps == 0 and tight == 0), (key, m, r, v)
            if delta > 0:
                public = float(via_auditor(method, m, r, v, delta, confidence))
                assert public == eps, (key, m, r, v, delta, confidence, public, eps)
            max_diff = max(max_diff, abs(eps - tight))
            records.append(dict(m=m, r=r, v=v, delta=delta, confidence=confidence,
                                epsilon=eps, epsilon_tight=tight))
            print(f"{key:12s} m={m:5d} r={r:5d} v={v:5d} delta={delta:g} conf={confidence} "
                  f"eps={eps:.6f} tight={tight:.9f} diff={eps - tight:+.1e}", flush=True)
        out[key] = records
    source = {
        "package": "jax-privacy",
        "version": version("jax-privacy"),
        "functions": {
            "one_run": "jax_privacy.auditing._epsilon_one_run(0, m, r, v, 1 - confidence, delta)",
            "one_run_fdp": "jax_privacy.auditing._epsilon_one_run_fdp(0, m, r, v, 1 - confidence, delta)",
            "public_check": (
                "for delta > 0, CanaryScoreAuditor(in_scores, out_scores).epsilon_one_run[_fdp]("
                "1 - confidence, delta, threshold_strategy=Explicit(0.5)) with v in-scores and r - v "
                "out-scores equal to 1, the other m - r scores 0, returns exactly 'epsilon'"
            ),
        },
        "root_finder": (
            f"scipy.optimize.brentq with xtol={JAX_XTOL:g}: 'epsilon' is accurate to about 1e-6 only; "
            "'epsilon_tight' is the same code with xtol 1e-12"
        ),
        "environment": {p: version(p) for p in ("dp_accounting", "numpy", "scipy", "jax")}
        | {"python": platform.python_version(), "platform": platform.platform()},
        "definitions": DEFINITIONS,
        "tight_tolerance": TIGHT | {"max_abs_diff": max_diff},
    }
    OUT.write_text(json.dumps({"source": source, **out}, indent=1) + "\n")
    print(f"wrote {sum(map(len, out.values()))} records to {OUT}; max |epsilon - tight| = {max_diff:.1e}")


if __name__ == "__main__":
    main()
