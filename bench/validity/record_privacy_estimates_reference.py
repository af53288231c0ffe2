"""Record reference epsilon lower bounds from the PyPI package `privacy-estimates`.

The package is NOT a dependency of lightning_dpaudit; run this script with a
separate virtualenv that has it installed, e.g.

    python3 -m venv /tmp/pe-venv
    /tmp/pe-venv/bin/pip install privacy-estimates==0.1.0.post1
    /tmp/pe-venv/bin/python bench/validity/record_privacy_estimates_reference.py

It writes tests/data/privacy_estimates_reference.json, which our tests compare
against. Each "joint-beta" case is evaluated twice with the package's own code:
"epsilon_lower" at its default numerics (~10 s per value, accurate to ~3e-3) and
"epsilon_lower_tight" with only the numerical tolerances tightened by monkeypatching
(see tight_numerics below; ~5-150 s per value), so the whole run takes ~15 minutes.
"""

import contextlib
import json
import platform
import time
import warnings
from importlib.metadata import version

from _path import harness

import privacy_estimates.joint_density as joint_density
import scipy.integrate
import scipy.optimize
from privacy_estimates import AttackResults, compute_eps_lo

OUT = harness.ROOT / "tests" / "data" / "privacy_estimates_reference.json"

# (tp, fn, fp, tn, confidence, delta); every count >= 1, n per side in [50, 2000].
# "joint-beta" uses the first JOINT_BETA_CASES rows, "beta" uses all of them. Very
# concentrated posteriors (e.g. 1499/1/1/499) are kept out of default "joint-beta": its
# dblquad (epsabs=5e-3) loses most of their mass and returns a wrong, too-high eps_lo.
CASES = [
    (40, 10, 10, 40, 0.95, 0.0),  # balanced, n=50
    (90, 10, 5, 95, 0.95, 1e-5),  # balanced, n=100
    (150, 50, 50, 150, 0.99, 0.0),  # balanced, n=200
    (900, 100, 100, 900, 0.95, 1e-3),  # balanced, n=1000
    (600, 400, 10, 990, 0.99, 1e-5),  # low-FPR attack
    (1990, 10, 10, 1990, 0.95, 0.0),  # strong attack, n=2000
    (45, 5, 40, 1960, 0.99, 1e-3),  # unbalanced: P=50, N=2000
    (1900, 100, 3, 97, 0.95, 1e-5),  # unbalanced: P=2000, N=100
    (200, 100, 30, 970, 0.99, 0.0),  # unbalanced: P=300, N=1000
    (100, 900, 150, 50, 0.95, 1e-3),  # inverted attack (FPR + FNR > 1)
    (52, 48, 45, 55, 0.95, 0.0),  # near chance: "beta" gives 0
    (250, 250, 25, 475, 0.99, 1e-3),  # balanced, n=500
    (1000, 1000, 2, 1998, 0.95, 1e-5),  # low-FPR attack, n=2000
    (1499, 1, 1, 499, 0.99, 1e-5),  # unbalanced, one error per side
    (70, 30, 400, 1600, 0.95, 0.0),  # weak, unbalanced: P=100, N=2000
    (480, 20, 30, 70, 0.99, 0.0),  # unbalanced: P=500, N=100
    (1200, 300, 60, 1440, 0.99, 1e-3),  # balanced-ish, n=1500
    (95, 5, 100, 1900, 0.95, 1e-5),  # unbalanced: P=100, N=2000
]
JOINT_BETA_CASES = 12
# "joint-beta" cases recorded with the tight value only ("epsilon_lower" is null): the
# default numerics get them badly wrong (1499/1/1/499: 6.80), the tight ones do not
# (5.7797 vs a Monte Carlo quantile of 5.7798, 95% CI [5.7793, 5.7803], from 5e7 draws).
JOINT_BETA_TIGHT_ONLY_CASES = [
    (1499, 1, 1, 499, 0.99, 1e-5),  # unbalanced, one error per side
]

# Tight numerics for "joint-beta": the package's own Beta(count).eps_lo code path,
# with only the tolerances of its two numerical calls overridden (see tight_numerics).
TIGHT_DBLQUAD = dict(epsabs=1e-9, epsrel=1e-9)
TIGHT_ROOT_SCALAR = dict(xtol=1e-10, rtol=1e-12)

CALL = (
    "privacy_estimates.compute_eps_lo(count=AttackResults(TP=tp, FN=fn, FP=fp, TN=tn), "
    "delta=delta, alpha=1 - confidence, method=method)  # bracket left at None"
)

DEFINITIONS = {
    "alpha": (
        "alpha = 1 - confidence; eps_lo is a one-sided lower bound, P(eps >= eps_lo) >= 1 - alpha. "
        "FPR = FP/(FP+TN), FNR = FN/(FN+TP)."
    ),
    "eps_of_point": (
        "eps*(fnr, fpr, delta): if fpr > 1 - fnr, replace (fpr, fnr) by (1 - fnr, 1 - fpr); "
        "lo = min(fpr, fnr), hi = max(fpr, fnr); return 0 if hi > 1 - delta - lo, "
        "inf if lo == 0, else log((1 - delta - hi) / lo)."
    ),
    "beta": (
        "Clopper-Pearson interval for each rate with alpha/2 in EACH tail (i.e. the central two-sided "
        "1-alpha interval, so a one-sided 1-alpha/2 bound per rate; union bound gives 1-alpha overall): "
        "fpr_hi = Beta.ppf(1 - alpha/2, FP + 1, TN), fpr_lo = Beta.ppf(alpha/2, FP, TN + 1) (0 if FP == 0), "
        "same for FNR with (FN, TP). eps_lo = min(eps*(fnr_lo, fpr_lo), eps*(fnr_hi, fpr_hi)), and 0 if "
        "the rectangle straddles the fnr + fpr = 1 line. For an attack with FPR + FNR < 1 this is "
        "max(0, log((1 - delta - max(fpr_hi, fnr_hi)) / min(fpr_hi, fnr_hi))). No cap on epsilon."
    ),
    "joint-beta": (
        "Independent posteriors FNR ~ Beta(FN + 0.5, TP + 0.5), FPR ~ Beta(FP + 0.5, TN + 0.5) "
        "(Jeffreys priors). P(eps) = posterior mass of the full (eps, delta)-DP region, both sides of "
        "fpr = 1 - fnr: max(0, 1-delta-fnr*e^eps, (1-delta-fnr)*e^-eps) <= fpr <= "
        "min(1, 1+(delta-fnr)*e^-eps, delta+(1-fnr)*e^eps), by scipy dblquad (epsabs 5e-3). "
        "This equals the posterior CDF of eps*(FNR, FPR), so eps_lo is its alpha-quantile (the full "
        "alpha, one tail; not alpha/2). Returns 0 if P(0) > alpha; otherwise brentq root of "
        "P(eps) = alpha with xtol 1e-2 (values only good to ~1e-2), bracketed by Jeffreys intervals "
        "clipped to max_eps = 10, then [0, 10]. If the root is above 10 it raises ValueError "
        "('f(a) and f(b) must have different signs'); it does not clamp to 10."
    ),
    "joint-beta numerics": (
        "'epsilon_lower' (package defaults) agrees with a Monte Carlo alpha-quantile of eps*(FNR, FPR) "
        "to about 3e-3; 'epsilon_lower_tight' (same code, tight tolerances, see source.tight_tolerances) "
        "to within Monte Carlo error (<= 2.4e-4 with 5e7 draws). For very concentrated posteriors the default dblquad misses "
        "mass: TP=1499, FN=1, FP=1, TN=499, confidence 0.99, delta 1e-5 gives 6.80 where the true quantile "
        "is about 5.78, so such cases are recorded for 'joint-beta' with the tight value only "
        "('epsilon_lower' null)."
    ),
}

TIGHT_TOLERANCES = {
    "field": "epsilon_lower_tight (joint-beta records only)",
    "code_path": (
        "privacy_estimates.compute_eps_lo(..., method='joint-beta') -> Beta(count).eps_lo(delta, alpha), "
        "unchanged: same Jeffreys-prior Beta posteriors, same (eps, delta)-DP region boundaries "
        "(privacy_boundary_lo/hi), same objective P(eps) - alpha, same P(0) > alpha -> 0 rule, same "
        "Jeffreys brackets and [0, max_eps=10] fallback."
    ),
    "patch": (
        "While the tight value is computed (and restored afterwards), the names the package looks up in "
        "privacy_estimates.joint_density are replaced: `integrate` by a proxy of scipy.integrate whose "
        "dblquad forces the keyword arguments below (overriding the epsabs = xtol/2 = 5e-3 the package "
        "passes; scipy's default epsrel 1.49e-8 is also overridden), and `root_scalar` by a wrapper of "
        "scipy.optimize.root_scalar that forces the keyword arguments below (overriding the package's "
        "xtol = 1e-2; brentq is still chosen by scipy from the bracket). Only tolerances change."
    ),
    "dblquad": TIGHT_DBLQUAD,
    "root_scalar": TIGHT_ROOT_SCALAR,
    "time_per_value": (
        "6-146 s per value (median ~45 s; ~12 min for all 13 joint-beta cases, one core): each tight dblquad "
        "takes ~1-13 s and one eps_lo makes ~10-40 of them (incl. the failed Jeffreys brackets). dblquad at "
        "1e-7 was only ~20-25% faster, so these tolerances were kept."
    ),
    "accuracy": (
        "A single tight dblquad of P(eps) changes by < 1e-11 when epsabs/epsrel go from 1e-9 to 1e-11, and "
        "the tight eps_lo changes by < 2e-7 when they go from 1e-9 to 1e-7; so epsilon_lower_tight is the "
        "package's definition to well below 1e-6."
    ),
    "monte_carlo_check": (
        "Every epsilon_lower_tight was compared with the alpha-quantile of eps*(FNR, FPR) over 5e7 draws "
        "from the same Beta posteriors (numpy default_rng(0)): |tight - MC| <= 2.4e-4 (median ~5e-5), each "
        "inside the MC 95% order-statistic interval; |default - MC| is up to 2.5e-3."
    ),
}


class _TightIntegrate:
    """Stands in for scipy.integrate inside privacy_estimates.joint_density."""

    def __init__(self):
        self.calls = 0

    def __getattr__(self, name):
        return getattr(scipy.integrate, name)

    def dblquad(self, *args, **kwargs):
        self.calls += 1
        return scipy.integrate.dblquad(*args, **{**kwargs, **TIGHT_DBLQUAD})


@contextlib.contextmanager
def tight_numerics():
    """Run the package's joint-beta code with tight dblquad/root_scalar tolerances."""
    integrate = _TightIntegrate()

    def root_scalar(*args, **kwargs):
        return scipy.optimize.root_scalar(*args, **{**kwargs, **TIGHT_ROOT_SCALAR})

    saved = joint_density.integrate, joint_density.root_scalar
    joint_density.integrate, joint_density.root_scalar = integrate, root_scalar
    try:
        yield
    finally:
        joint_density.integrate, joint_density.root_scalar = saved
    # The patch must actually have been hit (guards against the package renaming its imports).
    assert integrate.calls > 0, "tight dblquad was never called"


def joint_beta_tight(count, delta, confidence):
    with tight_numerics():
        return float(compute_eps_lo(count=count, delta=delta, alpha=1 - confidence, method="joint-beta"))


def main() -> None:
    warnings.simplefilter("ignore")  # scipy IntegrationWarnings from dblquad in joint-beta
    records = []
    for method, cases in (("beta", CASES), ("joint-beta", CASES[:JOINT_BETA_CASES])):
        for tp, fn, fp, tn, confidence, delta in cases:
            start = time.time()
            count = AttackResults(TP=tp, FN=fn, FP=fp, TN=tn)
            eps = compute_eps_lo(count=count, delta=delta, alpha=1 - confidence, method=method)
            record = dict(method=method, tp=tp, fn=fn, fp=fp, tn=tn, confidence=confidence,
                          delta=delta, epsilon_lower=float(eps))
            line = (f"{method:10s} {tp:5d} {fn:5d} {fp:5d} {tn:5d} conf={confidence} delta={delta:g} "
                    f"eps_lo={eps:.4f} ({time.time() - start:.1f}s)")
            if method == "joint-beta":
                start = time.time()
                record["epsilon_lower_tight"] = joint_beta_tight(count, delta, confidence)
                line += (f" tight={record['epsilon_lower_tight']:.6f} "
                         f"diff={eps - record['epsilon_lower_tight']:+.2e} ({time.time() - start:.1f}s)")
            records.append(record)
            print(line, flush=True)
    for tp, fn, fp, tn, confidence, delta in JOINT_BETA_TIGHT_ONLY_CASES:
        start = time.time()
        count = AttackResults(TP=tp, FN=fn, FP=fp, TN=tn)
        tight = joint_beta_tight(count, delta, confidence)
        records.append(dict(method="joint-beta", tp=tp, fn=fn, fp=fp, tn=tn, confidence=confidence,
                            delta=delta, epsilon_lower=None, epsilon_lower_tight=tight))
        print(f"joint-beta {tp:5d} {fn:5d} {fp:5d} {tn:5d} conf={confidence} delta={delta:g} "
              f"eps_lo=(not recorded) tight={tight:.6f} ({time.time() - start:.1f}s)", flush=True)
    source = {
        "package": "privacy-estimates",
        "version": version("privacy-estimates"),
        "function": CALL,
        "environment": {p: version(p) for p in ("numpy", "scipy", "statsmodels")}
        | {"python": platform.python_version()},
        "definitions": DEFINITIONS,
        "tight_tolerances": TIGHT_TOLERANCES,
    }
    OUT.write_text(json.dumps({"source": source, "records": records}, indent=1) + "\n")
    print(f"wrote {len(records)} records to {OUT}")


if __name__ == "__main__":
    main()
