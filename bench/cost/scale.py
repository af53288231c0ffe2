"""What the audit costs as the model grows: time and peak memory for MLPs and transformers of 0.1 M to 40 M parameters.

MLPs of 256 random features in, three hidden Linear+ReLU layers of equal width, 10
classes, random labels; batch 64 (batch 16 at 40 M: 16 per-sample gradients of 40 M
parameters are already 2.6 GB). Opacus `make_private` with hooks, noise multiplier 1.0,
max grad norm 1.0, SGD, fixed batches. Configurations: `plain` (no auditor), `dirac`
(`PrivacyAuditor(optimizer, seed=0)`, the package's gradient canaries and defaults) and
`mislabeled` (input canaries, 32 per step, from 256 held-out random examples).

`--model transformer`: the decoder-only transformer of examples/_transformer.py (about
1 M, 10 M and 40 M parameters; untied embeddings, attention from Linear layers) on its
seeded Markov tokens, sequences of 32 tokens, batch 32, 16 and 8, next-token
cross-entropy with one loss per sequence, trained with `grad_sample_mode="hooks"`
(per-sample gradients) and `"ghost"` (ghost clipping: per-sample norms only, Opacus's
criterion and its two backward passes) side by side; configurations `plain` and `dirac`.

Peak memory: a fresh process per (model, configuration), `ru_maxrss` after 3
warm-up steps and `--steps` steps; "extra" is the audited peak less the plain peak. Time: a
fresh process per (model, audited configuration) holding a plain and an audited model
built from the same seed, alternating `--steps` steps of each for `--rounds` rounds;
the ratio is of the medians, and plain's ms/step is the median over all its rounds. Each
timed run follows a full garbage collection, so that none pays for the others' garbage.
Each measuring process may use at most `--max-gb` of address space; a cell that needs
more fails on its own (shown as "-", with the error) instead of starving the machine.

    .venv/bin/python bench/cost/scale.py --steps 10 --rounds 3 --out scale.md --resume scale.jsonl
    .venv/bin/python bench/cost/scale.py --sizes 0.1M 1M --steps 20 --rounds 3 --configs plain dirac
    .venv/bin/python bench/cost/scale.py --model transformer --steps 4 --rounds 3 --out scale_transformer.md
"""

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
import warnings

from _path import harness

import numpy as np
import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dpaudit.engine.auditor import PrivacyAuditor

harness.on_path("examples")
from _transformer import SIZES as TRANSFORMER_SHAPES, build_model, markov_tokens  # noqa: E402

SIZES = {"0.1M": (100_000, 64), "1M": (1_000_000, 64), "10M": (10_000_000, 64), "40M": (40_000_000, 16)}
TRANSFORMER = {"1M": 32, "10M": 16, "40M": 8}  # batch; sequences of SEQ_LEN tokens
SEQ_LEN = 32
CONFIGS = ("plain", "dirac", "mislabeled")
MODES = ("hooks", "ghost")
FEATURES, CLASSES, HIDDEN, HOLDOUT, WARMUP = 256, 10, 3, 256, 3
MEMORY_GROWTH_MB, TIME_RATIO, TIME_FROM = 64.0, 1.05, 1_000_000  # the targets


def n_params(width):
    return (FEATURES + 1) * width + (HIDDEN - 1) * (width + 1) * width + (width + 1) * CLASSES


def build(size, config, canaries, model_kind="mlp", mode="hooks"):
    """A private model of about `size` parameters (seed 0), its DPOptimizer, fixed batches and their loss."""
    if model_kind == "transformer":
        return build_transformer(size, config, canaries, mode)
    target, batch = SIZES[size]
    width = min(range(8, 8192), key=lambda w: abs(n_params(w) - target))
    torch.manual_seed(0)
    dims = [FEATURES] + [width] * HIDDEN
    layers = [m for a, b in zip(dims, dims[1:]) for m in (nn.Linear(a, b), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(width, CLASSES))
    x, y = torch.randn(8 * batch, FEATURES), torch.randint(0, CLASSES, (8 * batch,))
    model, optimizer, _ = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch),
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
    )
    if config == "dirac":
        PrivacyAuditor(optimizer, seed=0, **({"canaries_per_step": canaries} if canaries else {}))
    elif config == "mislabeled":
        held_out = torch.Generator().manual_seed(1)
        PrivacyAuditor(
            optimizer, module=model, canary="mislabeled", canaries_per_step=32, seed=0,
            canary_inputs=torch.randn(HOLDOUT, FEATURES, generator=held_out),
            canary_labels=torch.randint(0, CLASSES, (HOLDOUT,), generator=held_out),
        )
    batches = list(zip(x.split(batch), y.split(batch)))
    return model, optimizer, batches, lambda b: nn.functional.cross_entropy(model(b[0]), b[1])


def build_transformer(size, config, canaries, mode):
    """The example's transformer made private with `mode` clipping; its loss, one per sequence."""
    batch, vocab = TRANSFORMER[size], TRANSFORMER_SHAPES[size][0]
    model = build_model(size, SEQ_LEN, seed=0)
    tokens = markov_tokens(vocab, 8 * batch, SEQ_LEN, seed=0)
    private = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        data_loader=DataLoader(TensorDataset(tokens), batch_size=batch), criterion=nn.CrossEntropyLoss(),
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode=mode,
    )
    optimizer = private[1]
    criterion = private[2] if mode == "ghost" else nn.functional.cross_entropy

    def loss(b):
        logits = model(b[:, :-1])
        targets = b[:, 1:].reshape(-1)
        if mode == "ghost":
            return criterion(logits.reshape(-1, vocab), targets, shape=(len(b), SEQ_LEN))
        return criterion(logits.reshape(-1, vocab), targets)

    if config == "dirac":
        PrivacyAuditor(optimizer, seed=0, **({"canaries_per_step": canaries} if canaries else {}))
    return model, optimizer, list(tokens.split(batch)), loss


def train(run, steps):
    """Seconds for `steps` optimizer steps, cycling over the fixed batches."""
    model, optimizer, batches, loss = run
    gc.collect()  # every timed run from the same collector state (bench/cost/overhead.py says why)
    start = time.perf_counter()
    for i in range(steps):
        optimizer.zero_grad()
        loss(batches[i % len(batches)]).backward()
        optimizer.step()
    seconds = time.perf_counter() - start
    optimizer.zero_grad()  # frees the per-sample gradients before the other model runs
    return seconds


def memory_cell(size, config, args):
    run = build(size, config, args.canaries, args.model, args.mode)
    train(run, WARMUP)
    seconds = train(run, args.steps)
    params = sum(p.numel() for p in run[0].parameters())
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux
    return {"params": params, "rss_mb": rss_mb, "ms": 1000 * seconds / args.steps}


def timing_cell(size, config, args):
    plain = build(size, "plain", None, args.model, args.mode)
    audited = build(size, config, args.canaries, args.model, args.mode)
    for run in (plain, audited):
        train(run, WARMUP)
    runs = {"plain": lambda _: train(plain, args.steps), "audited": lambda _: train(audited, args.steps)}
    return harness.alternate(runs, args.rounds)


def in_fresh_process(kind, size, mode, config, args):
    """Run one cell of this script in a new interpreter; {"error": last line of stderr} if it fails."""
    cmd = [sys.executable, __file__, f"--{kind}", size, config, "--steps", str(args.steps),
           "--rounds", str(args.rounds), "--threads", str(args.threads), "--max-gb", str(args.max_gb),
           "--model", args.model, "--mode", mode]
    cmd += ["--canaries", str(args.canaries)] if args.canaries else []
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"{kind} {size} {config} failed ({done.returncode}):\n{done.stderr[-2000:]}", file=sys.stderr)
        return {"error": (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1][:160]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def fmt(value, spec, unit=""):
    return "-" if value is None or np.isnan(value) else format(value, spec) + unit


def main():
    parser = harness.parser(__doc__)
    parser.add_argument("--model", default="mlp", choices=["mlp", "transformer"])
    parser.add_argument("--modes", nargs="+", default=None, choices=MODES,
                        help="Opacus grad_sample_mode(s) of the transformer (both by default; the MLP runs hooks)")
    parser.add_argument("--sizes", nargs="+", default=None, choices=list(SIZES))
    parser.add_argument("--configs", nargs="+", default=None, choices=CONFIGS, help="all (plain, dirac for the transformer)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating plain/audited rounds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--canaries", type=int, default=None, help="canaries_per_step of dirac (package default)")
    parser.add_argument("--max-gb", type=float, default=16, help="address-space limit of each measuring process")
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--resume", metavar="FILE.jsonl", help="keep finished cells in FILE; a rerun skips them")
    parser.add_argument("--cell", nargs=2, metavar=("SIZE", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--timing", nargs=2, metavar=("SIZE", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="hooks", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = TRANSFORMER if args.model == "transformer" else SIZES
    args.sizes = args.sizes or list(sizes)
    args.modes = args.modes or (list(MODES) if args.model == "transformer" else ["hooks"])
    args.configs = args.configs or (["plain", "dirac"] if args.model == "transformer" else list(CONFIGS))
    if args.model == "transformer" and (set(args.sizes) - set(TRANSFORMER) or "mislabeled" in args.configs):
        parser.error(f"--model transformer runs sizes {', '.join(TRANSFORMER)} and configurations plain, dirac")
    if args.model == "mlp" and args.modes != ["hooks"]:
        parser.error("the MLP runs with hooks only; --modes is for --model transformer")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    if args.cell or args.timing:
        limit = int(args.max_gb * 2**30)  # an allocation beyond it fails in this process, not in others'
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        print(json.dumps(memory_cell(*args.cell, args) if args.cell else timing_cell(*args.timing, args)))
        return

    args.sizes = sorted(set(args.sizes), key=list(SIZES).index)
    audited = [c for c in CONFIGS[1:] if c in args.configs]
    rows = [(s, m) for s in args.sizes for m in args.modes]
    cells = [(s, m, "cell", c) for s, m in rows for c in ["plain"] + audited]
    cells += [(s, m, "timing", c) for s, m in rows for c in audited]
    cells.sort(key=lambda cell: list(SIZES).index(cell[0]))
    results, kept, reused, start = {}, {}, 0, time.perf_counter()
    if args.resume and os.path.exists(args.resume):
        with open(args.resume) as f:
            kept = {tuple(r["key"]): r["result"] for r in map(json.loads, f)}
    for i, (size, mode, kind, config) in enumerate(cells, 1):
        key = (size, kind, config, args.steps, args.rounds, args.threads, args.canaries)
        key += (args.model, mode) if args.model == "transformer" else ()  # the MLP's keys as before
        reused += key in kept
        results[size, mode, kind, config] = kept.get(key) or in_fresh_process(kind, size, mode, config, args)
        if args.resume and key not in kept and "error" not in results[size, mode, kind, config]:
            with open(args.resume, "a") as f:
                f.write(json.dumps({"key": key, "result": results[size, mode, kind, config]}) + "\n")
        print(f"[{i}/{len(cells)}] {size} {mode} {config} {'memory' if kind == 'cell' else 'timing'}: "
              f"{results[size, mode, kind, config]}  ({time.perf_counter() - start:.0f} s)", file=sys.stderr)

    nan = float("nan")
    transformer = args.model == "transformer"
    label = (lambda mode, c: f"{mode} {c}") if transformer else (lambda mode, c: c)
    lines = [f"`bench/cost/scale.py {' '.join(sys.argv[1:])}`: model={args.model} steps={args.steps} rounds={args.rounds} "
             f"threads={args.threads} warm-up={WARMUP} dirac canaries/step={args.canaries or 'default'}",
             harness.header("parameters", "batch", "configuration", "ms/step (median)", "audited/plain time",
                            "peak RSS (MB)", "extra peak vs plain (MB)")]
    extra, ratios = {}, {}
    for size, mode in rows:
        mem = {c: results[size, mode, "cell", c] for c in ["plain"] + audited}
        timing = {c: {"plain": [nan], "audited": [nan], **results[size, mode, "timing", c]} for c in audited}
        plain_runs = [t for c in audited for t in timing[c]["plain"] if not np.isnan(t)]
        plain_ms = 1000 * np.median(plain_runs) / args.steps if plain_runs else mem["plain"].get("ms", nan)
        plain_rss = mem["plain"].get("rss_mb", nan)
        params = next((m["params"] for m in mem.values() if "params" in m), None)
        batch = f"{TRANSFORMER[size]}x{SEQ_LEN}" if transformer else SIZES[size][1]
        for c in ["plain"] + audited:
            ms, ratio = plain_ms, 1.0
            if c != "plain":
                ms = 1000 * np.median(timing[c]["audited"]) / args.steps
                ratio = ratios[size, mode, c] = np.median(timing[c]["audited"]) / np.median(timing[c]["plain"])
            rss = mem[c].get("rss_mb", nan)
            extra[size, mode, c] = rss - plain_rss
            lines.append(f"| {fmt(params, ',')} | {batch} | {label(mode, c)} | {fmt(ms, '.1f')} | {fmt(ratio, '.2f', 'x')} "
                         f"| {fmt(rss, ',.0f')} | {fmt(extra[size, mode, c], ',.0f')} |")

    lines.append("")
    small, large = args.sizes[0], args.sizes[-1]
    for mode in args.modes:
        for c in audited:
            growth = extra[large, mode, c] - extra[small, mode, c] if small != large else float("nan")
            verdict = "not measured" if np.isnan(growth) else "met" if growth <= MEMORY_GROWTH_MB else "MISSED"
            lines.append(f"- {label(mode, c)}: extra peak memory grows by {fmt(growth, ',.0f')} MB from {small} to {large} "
                         f"(target <= {MEMORY_GROWTH_MB:.0f} MB): {verdict}")
            big = [s for s in args.sizes if SIZES[s][0] >= TIME_FROM]
            misses = [f"{s} {ratios[s, mode, c]:.2f}x" for s in big if ratios[s, mode, c] > TIME_RATIO]
            unmeasured = [s for s in big if np.isnan(ratios[s, mode, c])]
            verdict = f"MISSED at {', '.join(misses)}" if misses else "met" if len(unmeasured) < len(big) else "not measured"
            verdict += f"; not measured at {', '.join(unmeasured)}" if unmeasured and verdict != "not measured" else ""
            lines.append(f"- {label(mode, c)}: audited/plain time <= {TIME_RATIO}x from 1M parameters up: {verdict}")
    failed = [f"- {kind} {size} {label(mode, c)} failed: {r['error']}"
              for (size, mode, kind, c), r in results.items() if "error" in r]
    lines += failed and ["", f"Failed cells (each process limited to {args.max_gb:g} GB of address space):"] + failed
    lines.append(f"\n{time.perf_counter() - start:.0f} s in this run ({reused} cells kept from --resume)")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
