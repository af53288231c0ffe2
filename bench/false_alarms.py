"""False alarms on correct Opacus: how often a correct run ever shows violation=True.

Each run trains the digits CNN with Opacus's own DPOptimizer under a PrivacyAuditor at
default settings (alarm checked after every step) with its own seed, except that the exact
data-path checks run at step 1 and every 100 steps without their time budget (FULL_CADENCE: every
step the default may check is checked); any exact finding on these correct runs is counted. The same runs are
also judged by the naive rule the alarm replaces: fixed-sample 95% Clopper-Pearson mu
bounds for the pool and each tensor, recomputed after every step.

    .venv/bin/python bench/false_alarms.py [--runs 200] [--steps 1000] [--workers 2] [--mode MODE] [--first-run K]

(--first-run K: runs K, K+1, ... with their own seeds, so a long measurement can be taken in parts.)

Modes (the naive rule is replayed for `hooks` only):
  hooks       the digits CNN, Opacus's hooks (the default)
  functorch   the same, grad_sample_mode="functorch"
  ew          the same, grad_sample_mode="ew" (torch's expanded weights)
  paired      the same, hooks, the audit in paired mode
  adaclip     the same under AdaClipDPOptimizer (clipping="adaptive", its count noised at 2 sigma)
  mislabeled  the same, hooks, input canaries (held-out digits with wrong labels)
  ddp         two processes (gloo, 127.0.0.1) training an MLP with Opacus's DistributedDPOptimizer,
              fixed batches; runs one after another in the same two processes (--workers ignored)
  blank, adversarial, crafted   the same, hooks, the other input canary kinds
  ghost       the token classifier of tests/ghost_setups.py (Embedding, Linear on flattened
              tokens, LayerNorm) under Opacus's ghost clipping
  adaptive-ghost  the same under PrivacyEngineAdaptiveClipping (the bound moves after each step)
  fsdp        two processes training the token classifier under Opacus's FSDP2Wrapper and
              grad_sample_mode="ghost_fsdp" (the exact checks are off there); as ddp otherwise
"""

import argparse
import time
from multiprocessing import Pool

import numpy as np
from scipy.stats import beta, norm

from lightning_dpaudit.testing import train_audited

FULL_CADENCE = dict(per_sample_check_budget=1.0)  # the exact checks at every due step, whatever they cost
EXACT_CODES = {"per_sample_gradients", "clipped_sum", "claim_unaccounted"}  # the data path's exact checks


def _naive_alarm(obs: dict, claimed: float) -> bool:
    """Would a fixed-sample CP check, repeated after every step, have alarmed?"""
    steps = obs["step"].max() + 1
    said = obs["value"] >= 0.5
    groups = [np.ones_like(said)] + [obs["layer"] == l for l in np.unique(obs["layer"])]
    for keep in groups:
        def cum(mask):
            return np.cumsum(np.bincount(obs["step"][mask & keep], minlength=steps))
        tp, fn = cum(obs["is_in"] & said), cum(obs["is_in"] & ~said)
        fp, tn = cum(~obs["is_in"] & said), cum(~obs["is_in"] & ~said)
        ok = (tp + fn > 0) & (fp + tn > 0)
        fpr = np.where(fp < fp + tn, beta.ppf(0.975, fp + 1, np.maximum(tn, 1)), 1.0)
        fnr = np.where(fn < tp + fn, beta.ppf(0.975, fn + 1, np.maximum(tp, 1)), 1.0)
        if np.any(ok & (norm.isf(fpr) - norm.ppf(fnr) > claimed)):
            return True
    return False


def _run_ghost(seed, steps, sigma, adaptive=False):
    import sys
    import warnings
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from ghost_setups import make_ghost, train_ghost

    from lightning_dpaudit import PrivacyAuditor

    module, optimizer, criterion, loader = make_ghost(seed=10_000 + seed, noise_multiplier=sigma, adaptive=adaptive)
    auditor = PrivacyAuditor(optimizer, seed=10_000 + seed, on_violation=lambda result: None, **FULL_CADENCE)
    train_ghost(module, optimizer, criterion, loader, steps)
    result = auditor.result()
    return result.violation, None, sorted({f.code for f in result.findings} & EXACT_CODES)


ADAPTIVE = dict(target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0, min_clipbound=0.01,
                unclipped_num_std=2.0)
DIGITS_MODES = {  # train_audited's arguments beyond steps, sigma and seed
    "functorch": dict(private_options={"grad_sample_mode": "functorch"}),
    "ew": dict(private_options={"grad_sample_mode": "ew"}),
    "paired": dict(mode="paired"),
    "adaclip": dict(clipping="adaptive", private_options=ADAPTIVE),
    "mislabeled": dict(canary="mislabeled"),
    "blank": dict(canary="blank"),
    "adversarial": dict(canary="adversarial"),
    "crafted": dict(canary="crafted"),
}


def _run(args):
    seed, steps, sigma, mode = args
    if mode in ("ghost", "adaptive-ghost"):
        return _run_ghost(seed, steps, sigma, adaptive=mode == "adaptive-ghost")
    import torch
    import warnings

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from lightning_dpaudit.engine.options import DEFAULT_GRADIENT_CANARIES

    if mode != "hooks":
        result = train_audited(steps=steps, noise_multiplier=sigma, seed=10_000 + seed, **FULL_CADENCE,
                               **DIGITS_MODES[mode])
        failed = [] if result.audit_failed is None else ["audit_failed"]
        return result.violation, None, sorted({f.code for f in result.findings} & EXACT_CODES) + failed
    result, obs = train_audited(
        steps=steps, noise_multiplier=sigma, seed=10_000 + seed, return_observations=True,
        observation_window=steps * DEFAULT_GRADIENT_CANARIES,  # the naive rule replays every observation
        **FULL_CADENCE,
    )
    exact = sorted({f.code for f in result.findings} & EXACT_CODES)  # certainties: any is a false finding here
    return result.violation, _naive_alarm(obs, result.mu_claimed), exact


SCRIPTS = {"ddp": "ddp_scenarios.py", "fsdp": "sharded_scenarios.py"}  # the two-process modes' scenario scripts


def _ddp(args, runs, start):
    """The ddp and fsdp modes: batches of runs in two fresh processes each, a rank's outcome per run (both ranks
    must agree)."""
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from ddp_scenarios import launch

    alarms, exact, failed, disagree = 0, [], [], 0
    for done in range(0, len(runs), 10):
        seeds = list(runs[done:done + 10])
        with tempfile.TemporaryDirectory() as out:
            ranks = launch("false_alarms", Path(out), timeout=60.0 * len(seeds) * max(1, args.steps // 100),
                           script=SCRIPTS[args.mode], seeds=seeds, steps=args.steps, sigma=args.sigma)
        for seed, outcome, other in zip(seeds, ranks[0]["outcomes"], ranks[1]["outcomes"]):
            disagree += outcome["violation"] != other["violation"]
            alarms += outcome["violation"] or other["violation"]
            codes = sorted(set(outcome["codes"] + other["codes"]) & EXACT_CODES)
            if codes:
                exact.append((seed, codes))
            if outcome["audit_failed"] or other["audit_failed"]:
                failed.append(seed)
        print(f"  {done + len(seeds)}/{args.runs} runs, {alarms} alarms, {len(exact)} with exact findings, "
              f"{len(failed)} audits failed", flush=True)
    print(f"mode={args.mode} runs={args.runs} (from run {args.first_run}) steps={args.steps} sigma={args.sigma} "
          f"({time.perf_counter() - start:.0f} s)")
    print(f"anytime alarm (default): {alarms}/{args.runs} = {alarms / args.runs:.1%} false alarms (allowed 5%); "
          f"ranks disagreeing: {disagree}; audits failed: {len(failed)}")
    print(f"exact data-path findings (per-sample gradients, clipped sum, accounting): {len(exact)}/{args.runs} runs "
          f"{exact or ''}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--first-run", type=int, default=0,
                        help="the first run's index (its seed); a long measurement can be taken in parts")
    parser.add_argument("--mode", choices=["hooks", "ghost", "adaptive-ghost", *SCRIPTS, *DIGITS_MODES], default="hooks")
    args = parser.parse_args()
    start = time.perf_counter()
    runs = range(args.first_run, args.first_run + args.runs)  # each run's seed
    if args.mode in SCRIPTS:
        return _ddp(args, runs, start)
    jobs = [(seed, args.steps, args.sigma, args.mode) for seed in runs]
    with Pool(args.workers) as pool:
        outcomes = []
        for i, outcome in enumerate(pool.imap_unordered(_run, jobs), 1):
            outcomes.append(outcome)
            if i % 10 == 0:
                print(f"  {i}/{args.runs} runs, {sum(o[0] for o in outcomes)} alarms, "
                      f"{sum(bool(o[2]) for o in outcomes)} with exact findings", flush=True)
    alarms = sum(o[0] for o in outcomes)
    exact = [o[2] for o in outcomes if o[2]]
    naive = [o[1] for o in outcomes if o[1] is not None]
    print(f"mode={args.mode} runs={args.runs} (from run {args.first_run}) steps={args.steps} sigma={args.sigma} "
          f"({time.perf_counter() - start:.0f} s)")
    print(f"anytime alarm (default): {alarms}/{args.runs} = {alarms / args.runs:.1%} false alarms (allowed 5%)")
    print(f"exact data-path findings (per-sample gradients, clipped sum, accounting): {len(exact)}/{args.runs} runs "
          f"{exact or ''}")
    if naive:
        print(f"naive repeated CP checks: {sum(naive)}/{len(naive)} = {sum(naive) / len(naive):.1%} false alarms")


if __name__ == "__main__":
    main()
