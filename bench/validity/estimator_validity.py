"""How often each estimator's bound exceeds the truth, over many simulated trials.

    .venv/bin/python bench/validity/estimator_validity.py [--trials 10000] [--check 20] [--out table.md]
    .venv/bin/python bench/validity/estimator_validity.py --part exact   # Bayesian methods, small n, exact

A lower bound at confidence 0.95 may exceed the true value in at most 5% of trials (the
budget, 1 - confidence); on null data (no difference between in and out) the truth is 0,
so the bound may be above 0 in at most 5% of trials. Every estimator is run on data with
a known truth, delta 1e-5 (katz: 0):

  step-audit methods (estimators/bounds.py), default threshold 0.5, n = 20, 50 and 500
  observations a side:
    null      in and out ~ N(0, 1): truth 0
    gaussian  in ~ N(1, 1), out ~ N(0, 1), a mechanism exactly 1-GDP: truth epsilon 4.38
              at delta 1e-5 (katz, pure DP: no finite epsilon)
    rr        randomized response at epsilon 2: a score is 1 with probability
              p = 1 / (1 + e^2) out and 1 - p in: truth log((1 - p - delta) / p)
  one-run bounds (estimators/one_run_guesses.py, "union" and "split" guess selection),
  m canaries each included with probability 1/2, one score each:
    null      scores ~ N(0, 1) whatever the inclusion: truth 0
    gaussian  included ~ N(1, 1), excluded ~ N(0, 1): truth 4.38
    rr        randomized response at epsilon 2 per canary: truth as above

The GDP methods and the f-DP one-run bound assume a Gaussian trade-off curve; on
randomized response that assumption fails and their rows say so. A second row compares
them with the truth under their own assumption: the smallest Gaussian curve randomized
response lies above, mu = 2 Phi^-1(1 - p) (Gaussian curves are convex, so the corner
(p, p) of randomized response's curve decides).

Verdict "over budget": more trials above the truth than the 0.999 quantile of
Binomial(trials, 1 - confidence), which a valid estimator reaches with probability <= 0.001
per row. "upper 95%": one-sided Clopper-Pearson upper limit of the rate.

How it stays fast (one core, a few minutes): the trials' scores are drawn as arrays; the
step-audit methods go through bounds.bound_exceeds (the same bounds, with the Bayesian root
searches replaced by one posterior mass at the truth per distinct count tuple); the one-run
bounds are computed once per distinct (guess rule, right guesses) with one_run_epsilon and
one_run_fdp_epsilon, then taken as one_run_bounds takes them (largest over the rules for
"union"; the rule with the largest bound on the picking half, tested on the other half, for
"split"). --check trials of every row are recomputed with epsilon_lower_bound and
one_run_bounds themselves and must agree.
"""

from __future__ import annotations

import math
import sys
import time
from types import SimpleNamespace

from _path import harness

import numpy as np
from scipy.stats import binom, norm

from lightning_dpaudit.estimators import METHODS, epsilon_lower_bound, mu_to_epsilon, one_run_bounds
from lightning_dpaudit.estimators.bounds import DEFAULT_THRESHOLD, bound_exceeds, clopper_pearson_upper
from lightning_dpaudit.estimators.one_run_guesses import ESTIMATORS, _rescale, guess_rules

DELTA = 1e-5
CONFIDENCE = 0.95
MU = 1.0
RR_EPSILON = 2.0
SIDES_N = (20, 50, 500)
CANARIES = 1000
SPLIT_SEED = 0  # one_run_bounds' default: the picking half is the same for every trial
GAUSSIAN_ASSUMED = ("gdp-cp", "gdp-bayes", "fdp")


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(f"\r[{self.done}/{self.total}] {elapsed:6.1f} s  {what:<60}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def rr_p(epsilon: float) -> float:
    return 1.0 / (1.0 + math.exp(epsilon))


def rr_truth(epsilon: float, delta: float) -> float:
    """Smallest epsilon' with randomized response (epsilon', delta)-DP: its curve's corner (p, p)."""
    p = rr_p(epsilon)
    return max(math.log((1.0 - p - delta) / p), 0.0)


def rr_gaussian_envelope(epsilon: float, delta: float) -> float:
    """epsilon at delta of the smallest Gaussian curve above randomized response's: mu = 2 Phi^-1(1 - p)."""
    return mu_to_epsilon(2.0 * norm.isf(rr_p(epsilon)), delta)


def draw(kind: str, rng, trials: int, n: int, *, paired: bool):
    """(in, out) score arrays (trials, n) for the step audit, or (scores, included) for one run."""
    if paired:  # one-run: each canary included with probability 1/2
        included = rng.random((trials, n)) < 0.5
        if kind == "null":
            scores = rng.normal(size=(trials, n))
        elif kind == "gaussian":
            scores = rng.normal(size=(trials, n)) + MU * included
        else:
            flip = rng.random((trials, n)) < rr_p(RR_EPSILON)
            scores = (included ^ flip).astype(float)
        return scores, included
    if kind == "null":
        return rng.normal(size=(trials, n)), rng.normal(size=(trials, n))
    if kind == "gaussian":
        return rng.normal(MU, 1.0, size=(trials, n)), rng.normal(size=(trials, n))
    p = rr_p(RR_EPSILON)
    return (rng.random((trials, n)) >= p).astype(float), (rng.random((trials, n)) < p).astype(float)


def truths(kind: str, estimator: str):
    """[(truth label, truth epsilon, assumption met)] for a data kind and estimator."""
    delta = 0.0 if estimator == "katz" else DELTA
    if kind == "null":
        return [("0", 0.0, True)]
    if kind == "gaussian":
        if estimator == "katz":
            return [("inf (no pure-DP epsilon)", math.inf, True)]
        eps = mu_to_epsilon(MU, delta)
        return [(f"{eps:.2f} (mu {MU:g})", eps, True)]
    eps = rr_truth(RR_EPSILON, delta)
    rows = [(f"{eps:.4f}", eps, estimator not in GAUSSIAN_ASSUMED)]
    if estimator in GAUSSIAN_ASSUMED:
        envelope = rr_gaussian_envelope(RR_EPSILON, delta)
        rows.append((f"{envelope:.2f} (Gaussian curve above rr, mu {2 * norm.isf(rr_p(RR_EPSILON)):.2f})", envelope, True))
    return rows


# ---------------------------------------------------------------- step-audit methods


def step_rows(kind, n, trials, rng, check, progress):
    ins, outs = draw(kind, rng, trials, n, paired=False)
    tp = (ins >= DEFAULT_THRESHOLD).sum(axis=1)
    fp = (outs >= DEFAULT_THRESHOLD).sum(axis=1)
    rows = []
    for method in METHODS:
        delta = 0.0 if method == "katz" else DELTA
        for label, truth, met in truths(kind, method):
            progress.step(f"{method} on {kind}, n={n}")
            if math.isinf(truth):
                over = np.zeros(trials, dtype=bool)
            else:
                over = bound_exceeds(tp, n - tp, fp, n - fp, epsilon=truth, delta=delta, method=method,
                                     confidence=CONFIDENCE)
            for t in range(min(check, trials)):
                est = epsilon_lower_bound(ins[t], outs[t], delta=delta, method=method, confidence=CONFIDENCE)
                if (est.epsilon > truth) != bool(over[t]):
                    raise AssertionError(f"{method} on {kind}, n={n}, trial {t}: bound {est.epsilon} vs truth {truth}")
            rows.append((method, kind, f"{n} a side", label, int(over.sum()), trials, met))
    return rows


# ---------------------------------------------------------------- one-run bounds


def _ranked_counts(scores, included):
    """Per trial: included canaries among the k highest scores and excluded ones among the k
    lowest, for k = 0..m (ties by canary index, as one_run_guesses ranks them)."""
    order = np.argsort(-scores, axis=1, kind="stable")
    inc = np.take_along_axis(included, order, axis=1)
    zero = np.zeros((len(inc), 1), dtype=np.int32)
    top = np.concatenate([zero, np.cumsum(inc, axis=1, dtype=np.int32)], axis=1)
    bottom = np.concatenate([zero, np.cumsum(~inc[:, ::-1], axis=1, dtype=np.int32)], axis=1)
    return top, bottom


def _rule_counts(top, bottom, m, k_in, k_out):
    """(r, v per trial) as one_run_guesses._counts."""
    k_in = min(k_in, m)
    k_out = min(k_out, m - k_in)
    return k_in + k_out, top[:, k_in] + bottom[:, k_out]


class BoundTable:
    """Each estimator's bound for (m, r, v, confidence), computed once."""

    def __init__(self):
        self.cache = {}

    def __call__(self, name, m, r, v_values, confidence):
        values, inverse = np.unique(v_values, return_inverse=True)
        out = np.empty(len(values))
        for i, v in enumerate(values):
            key = (name, m, r, int(v), confidence)
            if key not in self.cache:
                self.cache[key] = ESTIMATORS[name](m, r, int(v), delta=DELTA, confidence=confidence)
            out[i] = self.cache[key]
        return out[inverse.reshape(-1)]


def union_bounds(name, scores, included, table):
    m = scores.shape[1]
    rules = guess_rules(["score"], m)
    level = (1.0 - CONFIDENCE) / len(rules)
    top, bottom = _ranked_counts(scores, included)
    best = np.zeros(len(scores))
    for _, k_in, k_out in rules:
        r, v = _rule_counts(top, bottom, m, k_in, k_out)
        eps = np.where(2 * v > r, table(name, m, r, v, 1.0 - level), 0.0)
        best = np.maximum(best, eps)
    return best


def split_bounds(name, scores, included, table):
    m = scores.shape[1]
    half = np.random.default_rng(SPLIT_SEED).permutation(m)
    pick, test = half[: m // 2], half[m // 2:]
    m_pick, m_test = len(pick), len(test)
    rules = guess_rules(["score"], m_pick)
    top, bottom = _ranked_counts(scores[:, pick], included[:, pick])
    picked = []
    for _, k_in, k_out in rules:
        r, v = _rule_counts(top, bottom, m_pick, k_in, k_out)
        picked.append(np.where(2 * v > r, table(name, m_pick, r, v, CONFIDENCE), 0.0))
    chosen = np.argmax(np.stack(picked, axis=1), axis=1)  # the first of equal bounds, as _best keeps it
    top, bottom = _ranked_counts(scores[:, test], included[:, test])
    out = np.zeros(len(scores))
    for j, (_, k_in, k_out) in enumerate(rules):
        rows = chosen == j
        if not rows.any():
            continue
        k_in_t, k_out_t = _rescale(SimpleNamespace(guesses_in=k_in, guesses_out=k_out), m_pick, m_test)
        r, v = _rule_counts(top[rows], bottom[rows], m_test, k_in_t, k_out_t)
        out[rows] = table(name, m_test, r, v, CONFIDENCE)
    return out


def one_run_rows(kind, m, trials, rng, check, progress, table, chunk=2500):
    """The one-run rows of one data kind; trials in chunks of `chunk` (a (chunk, m) array each)."""
    combos = [(selection, compute, name) for selection, compute in (("union", union_bounds), ("split", split_bounds))
              for name in ESTIMATORS]
    bounds = {(selection, name): [] for selection, _, name in combos}
    for first in range(0, trials, chunk):
        scores, included = draw(kind, rng, min(chunk, trials - first), m, paired=True)
        for selection, compute, name in combos:
            progress.step(f"{name} {selection} on {kind}, m={m}, trials {first:,}+")
            values = compute(name, scores, included, table)
            for t in range(min(check, len(values)) if first == 0 else 0):
                ref = one_run_bounds({"score": scores[t]}, included[t], delta=DELTA, confidence=CONFIDENCE,
                                     selection=selection, seed=SPLIT_SEED)[name].epsilon
                if not math.isclose(ref, values[t], rel_tol=1e-12, abs_tol=1e-12):
                    raise AssertionError(f"{name} {selection} on {kind}, trial {t}: {ref} vs {values[t]}")
            bounds[selection, name].append(values)
    rows = []
    for selection, _, name in combos:
        values = np.concatenate(bounds[selection, name])
        for label, truth, met in truths(kind, name):
            rows.append((f"{name} ({selection})", kind, f"m = {m}", label, int((values > truth).sum()), trials, met))
    return rows


# ---------------------------------------------------------------- exact rates of the Bayesian methods

EXACT_N = (10, 20, 30, 40, 60, 100)
EXACT_PARAMETERS = (0.5, 1.0, 2.0, 3.0, 4.0)


def exact_rate(n, fnr, fpr, truth, method, delta=DELTA):
    """P[bound > truth] summed over the counts' binomial distributions (no sampling)."""
    ks = np.arange(n + 1)
    w_fn, w_fp = binom.pmf(ks, n, fnr), binom.pmf(ks, n, fpr)
    keep_fn, keep_fp = w_fn > 1e-8, w_fp > 1e-8
    fn, fp = np.meshgrid(ks[keep_fn], ks[keep_fp], indexing="ij")
    over = bound_exceeds(n - fn, fn, fp, n - fp, epsilon=truth, delta=delta, method=method)
    return float((np.outer(w_fn[keep_fn], w_fp[keep_fp]) * over).sum())


def exact_table(progress):
    """Rates of epsdelta-bayes on randomized response at epsilon 0.5-4 and of gdp-bayes on
    mu-GDP data (threshold mu/2) at mu 0.5-4, n a side: where error counts are small."""
    lines = [harness.header("method", "data", *(f"n = {n}" for n in EXACT_N))]
    for method in ("epsdelta-bayes", "gdp-bayes"):
        for value in EXACT_PARAMETERS:
            progress.step(f"{method} exact, {value:g}")
            if method == "epsdelta-bayes":
                p = rr_p(value)
                rates = [exact_rate(n, p, p, rr_truth(value, DELTA), method) for n in EXACT_N]
                data = f"rr, epsilon {value:g}"
            else:
                p = norm.cdf(-value / 2)
                rates = [exact_rate(n, p, p, mu_to_epsilon(value, DELTA), method) for n in EXACT_N]
                data = f"Gaussian, mu {value:g}"
            lines.append(f"| {method} | {data} | " + " | ".join(f"{r:.4f}" for r in rates) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- table


def verdict(over, trials, met):
    budget = 1.0 - CONFIDENCE
    if not met:
        return "assumption not met: Gaussian curve"
    return "over budget" if over > binom.ppf(0.999, trials, budget) else "ok"


def markdown(rows):
    lines = [harness.header("estimator", "data", "size", "truth (epsilon)", "trials above truth", "rate", "upper 95%",
                            "budget", "verdict")]
    for estimator, kind, size, label, over, n, met in rows:
        upper = float(clopper_pearson_upper(over, n, 0.95))
        lines.append(f"| {estimator} | {kind} | {size} | {label} | {over:,} / {n:,} | {over / n:.4f} | {upper:.4f} | "
                     f"{1 - CONFIDENCE:.2f} | {verdict(over, n, met)} |")
    return "\n".join(lines)


def main():
    parser = harness.parser(__doc__)
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--check", type=int, default=20, help="trials per row recomputed by the estimators themselves")
    parser.add_argument("--canaries", type=int, default=CANARIES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--part", choices=("all", "step", "one-run", "exact"), default="all",
                        help="exact: the Bayesian methods' exact rates at small n (not part of all)")
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    if args.part == "exact":
        progress = Progress(2 * len(EXACT_PARAMETERS))
        text = exact_table(progress)
        progress.close()
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        return
    kinds = ("null", "gaussian", "rr")
    step = args.part in ("all", "step")
    one_run = args.part in ("all", "one-run")
    step_count = sum(len(truths(k, m)) for k in kinds for m in METHODS) * len(SIDES_N)
    chunks = -(-args.trials // 2500)
    progress = Progress(step * step_count + one_run * 2 * len(ESTIMATORS) * len(kinds) * chunks)
    start = time.perf_counter()
    rows = []
    for kind in kinds if step else ():
        for n in SIDES_N:
            rows += step_rows(kind, n, args.trials, rng, args.check, progress)
    table = BoundTable()
    for kind in kinds if one_run else ():
        rows += one_run_rows(kind, args.canaries, args.trials, rng, args.check, progress, table)
    progress.close()
    text = markdown(rows)
    print(text)
    print(f"\n{time.perf_counter() - start:.0f} s; delta {DELTA:g} (katz 0), confidence {CONFIDENCE}, seed {args.seed}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
