"""False alarms on correct Opacus: how often a correct run ever shows violation=True.

Each run trains the digits CNN with Opacus's own DPOptimizer under a PrivacyAuditor at
default settings (alarm checked after every step) with its own seed, except that the exact
data-path checks run at step 1 and every 100 steps without their time budget (FULL_CADENCE: every
step the default may check is checked); any exact finding on these correct runs is counted. The run
checks see what a user following the guides gives them: the loader the loop iterates (data_loader=,
or watch_loader for BatchMemoryManager's), or under Lightning what DPAuditCallback reads itself; every
run samples as make_private(poisson_sampling=True) does, so any pipeline finding (sampling,
multiplicity, coupled_examples, outside_dp) on these runs is counted as false, with its message. The
run checks' status line of the first run (its lowest seed) is printed, to show what they compared. The same
runs are also judged by the naive rule the alarm replaces: fixed-sample 95% Clopper-Pearson mu
bounds for the pool and each tensor, recomputed after every step.

    .venv/bin/python bench/validity/false_alarms.py [--runs 200] [--steps 1000] [--workers 2] [--mode MODE] [--first-run K]

(--first-run K: runs K, K+1, ... with their own seeds, so a long measurement can be taken in parts.)

Modes (the naive rule is replayed for `hooks` only):
  hooks       the digits CNN, Opacus's hooks (the default)
  functorch   the same, grad_sample_mode="functorch"
  ew          the same, grad_sample_mode="ew" (torch's expanded weights)
  paired      the same, hooks, the audit in paired mode
  adaclip     the same under AdaClipDPOptimizer (clipping="adaptive", its count noised at 2 sigma)
  mislabeled  the same, hooks, input canaries (held-out digits with wrong labels)
  blank, adversarial, crafted   the same, hooks, the other input canary kinds
  bmm         the digits CNN, hooks, under Opacus's BatchMemoryManager (physical batches of at most
              16 for the expected 64), its memory-safe loader given to watch_loader and the step's
              loss as training_loss
  lightning   the digits CNN as a LightningModule (lightning_dpaudit.app.demo's PrivateDigitsModule:
              make_private in configure_optimizers) on Opacus's DPLightningDataModule (batches of 64
              of the demo's 1,500 training digits), audited by DPAuditCallback with its default
              options (its own seed per run) but FULL_CADENCE; counted from callback.auditor.result()
  ddp         two processes (gloo, 127.0.0.1) training an MLP under DPDDP with Opacus's
              DistributedDPOptimizer, Poisson sampling as make_private(poisson_sampling=True) gives
              it there (a DPDataLoader over DistributedUniformWithReplacementSampler, each rank its
              shard and generator), the loader given as data_loader and the model as module= (as
              examples/ddp_torchrun.py does); runs one after another in the same two processes
              (--workers ignored)
  ghost       the token classifier of tests/ghost_setups.py (Embedding, Linear on flattened
              tokens, LayerNorm) under Opacus's ghost clipping, Poisson sampling, the loader and
              model given as data_loader and module=
  adaptive-ghost  the same under PrivacyEngineAdaptiveClipping (the bound moves after each step)
  fsdp        two processes training the token classifier under Opacus's FSDP2Wrapper and
              grad_sample_mode="ghost_fsdp" (each rank's exact checks replay from the gathered tensors); as ddp otherwise
              (tests/ddp_scenarios.py's false_alarms, setup "fsdp")
"""

import time
from multiprocessing import Pool

from _path import harness

import numpy as np
from scipy.stats import beta, norm

from lightning_dpaudit.analysis.results import PIPELINE_CODES
from lightning_dpaudit.testing import train_audited

FULL_CADENCE = dict(per_sample_check_budget=1.0)  # the exact checks at every due step, whatever they cost
# the data path's exact checks, and the causes that are not privacy findings (any of them on a correct run is wrong)
EXACT_CODES = {"per_sample_gradients", "clipped_sum", "claim_unaccounted", "canary_clipping", "training_diverged",
               "opacus_error"}
PHYSICAL_BATCH = 16  # bmm: BatchMemoryManager's max_physical_batch_size (the expected batch is 64)


def _outcome(seed, result, naive=None) -> dict:
    """A run's outcome: whether the alarm ever fired, the naive rule's verdict (hooks only), the exact data-path
    findings (and the audit's own failure), the run checks' findings as (code, message, step) and status line."""
    exact = sorted({f.code for f in result.findings} & EXACT_CODES)
    return {"seed": seed, "violation": bool(result.violation), "naive": naive,
            "exact": exact + ([] if result.audit_failed is None else ["audit_failed"]),
            "pipeline": [(f.code, f.message, f.first_step) for f in result.findings if f.code in PIPELINE_CODES],
            "status": result.pipeline, "data_path": result.data_path}


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
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    harness.on_path("tests")
    from ghost_setups import make_ghost, train_ghost

    from lightning_dpaudit import PrivacyAuditor

    module, optimizer, criterion, loader = make_ghost(seed=10_000 + seed, noise_multiplier=sigma, adaptive=adaptive,
                                                     poisson_sampling=True)
    auditor = PrivacyAuditor(optimizer, module=module, seed=10_000 + seed, on_violation=lambda result: None,
                             data_loader=loader, **FULL_CADENCE)
    train_ghost(module, optimizer, criterion, loader, steps)
    result = auditor.result()
    auditor.detach()
    return _outcome(seed, result)


def _run_bmm(seed, steps, sigma):
    """Hooks under BatchMemoryManager: each step's Poisson batch split into physical batches of PHYSICAL_BATCH, as
    Opacus's guides write the loop (a new memory-safe loader each epoch, handed to the audit)."""
    import torch
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.datasets import make_private_digits

    model, optimizer, loader, engine = make_private_digits(noise_multiplier=sigma, seed=10_000 + seed, batch_size=64)
    loss_fn = torch.nn.CrossEntropyLoss()
    auditor = PrivacyAuditor(optimizer, module=model, seed=10_000 + seed, check_every=1,
                             on_violation=lambda result: None,
                             training_loss=lambda batch: loss_fn(model(batch[0]), batch[1]), **FULL_CADENCE)

    def noised_steps():  # the accountant's count: physical batches that only accumulate are not steps
        return sum(entry[-1] for entry in engine.accountant.history)

    while noised_steps() < steps:
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=PHYSICAL_BATCH,
                                optimizer=optimizer) as memory_safe_loader:
            auditor.watch_loader(memory_safe_loader)
            for images, labels in memory_safe_loader:
                optimizer.zero_grad()
                loss_fn(model(images), labels).backward()
                optimizer.step()
                if noised_steps() >= steps:
                    break
    result = auditor.result()
    auditor.detach()
    return _outcome(seed, result)


def _run_lightning(seed, steps, sigma):
    """The digits CNN as a LightningModule (make_private in configure_optimizers) on DPLightningDataModule, under
    DPAuditCallback; Lightning's and the callback's printed output (its report's table) is kept out of the bench's."""
    import contextlib
    import io
    import logging
    import tempfile

    import pytorch_lightning as pl
    import torch
    from opacus.lightning import DPLightningDataModule

    from lightning_dpaudit import DPAuditCallback
    from lightning_dpaudit.app.demo import DigitsDataModule, PrivateDigitsModule

    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    pl.seed_everything(10_000 + seed, verbose=False)
    datamodule = DPLightningDataModule(DigitsDataModule(batch_size=64),
                                       generator=torch.Generator().manual_seed(10_000 + seed))
    module = PrivateDigitsModule(noise_multiplier=sigma, lr=0.1)
    callback = DPAuditCallback(seed=10_000 + seed, **FULL_CADENCE)
    with tempfile.TemporaryDirectory() as root, contextlib.redirect_stdout(io.StringIO()):
        trainer = pl.Trainer(max_steps=steps, callbacks=[callback], accelerator="cpu", devices=1, logger=False,
                             default_root_dir=root, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0)
        trainer.fit(module, datamodule=datamodule)
    return _outcome(seed, callback.auditor.result())


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
    if mode in OWN_LOOPS:
        return OWN_LOOPS[mode](seed, steps, sigma)
    from lightning_dpaudit.engine.options import DEFAULT_GRADIENT_CANARIES

    if mode != "hooks":
        result = train_audited(steps=steps, noise_multiplier=sigma, seed=10_000 + seed, **FULL_CADENCE,
                               **DIGITS_MODES[mode])
        return _outcome(seed, result)
    result, obs = train_audited(
        steps=steps, noise_multiplier=sigma, seed=10_000 + seed, return_observations=True,
        observation_window=steps * DEFAULT_GRADIENT_CANARIES,  # the naive rule replays every observation
        **FULL_CADENCE,
    )
    # exact and pipeline findings are certainties (or tests with their own small budgets): any is false here
    return _outcome(seed, result, naive=_naive_alarm(obs, result.mu_claimed))


OWN_LOOPS = {"bmm": _run_bmm, "lightning": _run_lightning}  # modes with a loop of their own
SETUPS = ("ddp", "fsdp")  # the two-process modes: ddp_scenarios.py's false_alarms with this setup


def _pipeline_lines(found: list) -> str:
    """The pipeline findings of the runs that had any: seed, then each finding's code, step and message."""
    return "".join(f"\n  run {seed}: {code} at step {step}: {message}" for seed, findings in found
                   for code, message, step in findings)


def _ddp(args, runs, start):
    """The ddp and fsdp modes: batches of runs in two fresh processes each, a rank's outcome per run (both ranks
    must agree)."""
    import tempfile
    from pathlib import Path

    harness.on_path("tests")
    from ddp_scenarios import launch

    alarms, exact, pipeline, failed, disagree, status = 0, [], [], [], 0, None
    for done in range(0, len(runs), 10):
        seeds = list(runs[done:done + 10])
        with tempfile.TemporaryDirectory() as out:
            ranks = launch("false_alarms", Path(out), timeout=60.0 * len(seeds) * max(1, args.steps // 100),
                           seeds=seeds, steps=args.steps, sigma=args.sigma, setup=args.mode)
        for seed, outcome, other in zip(seeds, ranks[0]["outcomes"], ranks[1]["outcomes"]):
            disagree += outcome["violation"] != other["violation"]
            alarms += outcome["violation"] or other["violation"]
            codes = sorted(set(outcome["codes"] + other["codes"]) & EXACT_CODES)
            if codes:
                exact.append((seed, codes))
            found = [(f"rank {r}: {code}", message, step) for r, o in enumerate((outcome, other))
                     for code, message, step in o["pipeline_findings"]]
            if found:
                pipeline.append((seed, found))
            if outcome["audit_failed"] or other["audit_failed"]:
                failed.append(seed)
            if status is None:
                status = (seed, outcome["pipeline"], outcome.get("data_path", ""))
        print(f"  {done + len(seeds)}/{args.runs} runs, {alarms} alarms, {len(exact)} with exact findings, "
              f"{len(pipeline)} with pipeline findings, {len(failed)} audits failed", flush=True)
    print(f"mode={args.mode} runs={args.runs} (from run {args.first_run}) steps={args.steps} sigma={args.sigma} "
          f"({time.perf_counter() - start:.0f} s)")
    print(f"anytime alarm (default): {alarms}/{args.runs} = {alarms / args.runs:.1%} false alarms (allowed 5%); "
          f"ranks disagreeing: {disagree}; audits failed: {len(failed)}")
    print(f"exact data-path findings (per-sample gradients, clipped sum, accounting, canary clipping, divergence, Opacus errors): {len(exact)}/{args.runs} runs "
          f"{exact or ''}")
    _print_pipeline(pipeline, args.runs, status)


def _print_pipeline(found: list, runs: int, status) -> None:
    print(f"pipeline findings ({', '.join(PIPELINE_CODES)}): {len(found)}/{runs} runs "
          f"{[(seed, sorted({code for code, _, _ in f})) for seed, f in found] or ''}{_pipeline_lines(found)}")
    if status is not None:
        print(f"run checks of run {status[0]} (rank 0 where several): {status[1]}")
        print(f"exact checks of run {status[0]}: {status[2]}")


def main():
    parser = harness.parser(__doc__)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--first-run", type=int, default=0,
                        help="the first run's index (its seed); a long measurement can be taken in parts")
    parser.add_argument("--mode", choices=["hooks", "ghost", "adaptive-ghost", *OWN_LOOPS, *SETUPS, *DIGITS_MODES],
                        default="hooks")
    args = parser.parse_args()
    start = time.perf_counter()
    runs = range(args.first_run, args.first_run + args.runs)  # each run's seed
    if args.mode in SETUPS:
        return _ddp(args, runs, start)
    jobs = [(seed, args.steps, args.sigma, args.mode) for seed in runs]
    with Pool(args.workers) as pool:
        outcomes = []
        for i, outcome in enumerate(pool.imap_unordered(_run, jobs), 1):
            outcomes.append(outcome)
            if i % 10 == 0 or i == args.runs:
                print(f"  {i}/{args.runs} runs, {sum(o['violation'] for o in outcomes)} alarms, "
                      f"{sum(bool(o['exact']) for o in outcomes)} with exact findings, "
                      f"{sum(bool(o['pipeline']) for o in outcomes)} with pipeline findings", flush=True)
    outcomes.sort(key=lambda o: o["seed"])
    alarms = sum(o["violation"] for o in outcomes)
    exact = [(o["seed"], o["exact"]) for o in outcomes if o["exact"]]
    naive = [o["naive"] for o in outcomes if o["naive"] is not None]
    print(f"mode={args.mode} runs={args.runs} (from run {args.first_run}) steps={args.steps} sigma={args.sigma} "
          f"({time.perf_counter() - start:.0f} s)")
    print(f"anytime alarm (default): {alarms}/{args.runs} = {alarms / args.runs:.1%} false alarms (allowed 5%)")
    print(f"exact data-path findings (per-sample gradients, clipped sum, accounting, canary clipping, divergence, Opacus errors): {len(exact)}/{args.runs} runs "
          f"{exact or ''}")
    _print_pipeline([(o["seed"], o["pipeline"]) for o in outcomes if o["pipeline"]], args.runs,
                    (outcomes[0]["seed"], outcomes[0]["status"], outcomes[0]["data_path"]) if outcomes else None)
    if naive:
        print(f"naive repeated CP checks: {sum(naive)}/{len(naive)} = {sum(naive) / len(naive):.1%} false alarms")


if __name__ == "__main__":
    main()
