"""Final-model audit (one run, input-space canaries): canary kinds, bugs, validity.

The final-model audit (Steinke, Nasr and Jagielski 2023) sees only the trained model:
m canaries, each trained on with probability 1/2, are scored by the final model and the
guesses bound epsilon at 95% confidence ("steinke": (eps, delta)-DP; "fdp": the Gaussian
f-DP one-run bound of Mahloujifar et al.). delta = 1e-5, RDP accountant, Opacus SGD with
Poisson sampling and clipping bound 1. Noise multipliers come from
opacus.accountants.utils.get_noise_multiplier for the target epsilon over the run's steps
(sample rate 1 / batches per epoch, counting the included canaries).

Parts (--part):

  kinds     digits CNN, first 1,500 digits trained on, last 297 held out (test accuracy;
            the source of "mislabeled" and "crafted" canaries); batch 64, 20 epochs, lr 0.5,
            accountant epsilon 8. One row per canary kind and count, plus no canaries and a
            noise-free reference (clipped, sigma 0). The white-box PrivacyAuditor (dirac
            gradient canaries) runs in the same training run.
  bugs      the "no-noise" and "mean-sensitivity" bugs at a claimed epsilon of 1 (the noise
            multiplier of a correct run at epsilon 1), 1,000 ood canaries, batch 32, 40
            epochs, lr 2; the correct run at the same settings beside them; the digits CNN
            and a one-hidden-layer MLP (width 512).
  validity  correct runs only, a setting where the audit has power: a linear softmax model
            on synthetic data whose m = 1,000 canaries each own one input coordinate
            (input scale * e_{d+i}, random label), so the final weights carry each
            canary's summed clipped gradient plus noise; full-batch steps (Poisson rate 1)
            or Poisson batches. Counts how often each bound exceeds the accountant's
            epsilon over --runs seeds (data, model, noise and inclusion seed all differ).

    .venv/bin/python bench/validity/final_model.py --part kinds [--seeds 0 1 2] [--out PATH]
    .venv/bin/python bench/validity/final_model.py --part bugs [--seeds 0 1 2] [--models cnn mlp512]
    .venv/bin/python bench/validity/final_model.py --part validity [--runs 50]

Tables go to stdout (markdown); the rows go to --out (default: final_model_<part>.json
next to this file); --from-json PATH prints the tables of saved rows again.
"""

import json
import math
import time
import warnings
from pathlib import Path

from _path import harness

import numpy as np
import torch
from opacus import PrivacyEngine
from opacus.accountants.utils import get_noise_multiplier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dpaudit.engine.auditor import PrivacyAuditor
from lightning_dpaudit.engine.final_model import FinalModelCanaries
from lightning_dpaudit.integrations.bugs import inject_bug
from lightning_dpaudit.integrations.synthetic import coordinate_canary_task
from lightning_dpaudit.integrations.digits import DigitsCNN, digits_dataset

DELTA = 1e-5
N_TRAIN = 1500  # the first 1,500 digits are trained on; the last 297 are held out
BOUNDS = ("steinke_union", "fdp_union", "steinke_split", "fdp_split")
BOUND_NAMES = [b.replace("_", " ") for b in BOUNDS]

KINDS = {  # kind -> canary counts; mislabeled and crafted are distinct held-out digits (297 at most)
    None: [0], "ood": [1000, 5000], "blank": [1500], "mislabeled": [297], "crafted": [297],
}
KINDS_SETTINGS = dict(batch=64, epochs=20, lr=0.5, target_epsilon=8.0)
BUGS_SETTINGS = dict(kind="ood", count=1000, batch=32, epochs=40, lr=2.0, target_epsilon=1.0)
VALIDITY_SETTINGS = [  # (label, options of run_linear)
    ("full batch, T=50, eps 2", dict(target_epsilon=2.0)),
    ("full batch, T=50, eps 4", dict(target_epsilon=4.0)),
    ("full batch, T=50, eps 8", dict(target_epsilon=8.0)),
    ("Poisson batch 128, 60 steps, eps 4", dict(target_epsilon=4.0, batch=128, steps=60)),
]


class DigitsMLP(nn.Module):
    """Flatten - linear(64 -> width) - ReLU - linear(width -> 10)."""

    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))

    def forward(self, x):
        return self.net(x)


def make_model(name: str) -> nn.Module:
    if name == "cnn":
        return DigitsCNN()
    if name.startswith("mlp"):
        return DigitsMLP(int(name[3:] or 512))
    raise ValueError(f"unknown model {name!r}")


def digits_split():
    x, y = digits_dataset().tensors
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), (x[N_TRAIN:], y[N_TRAIN:])


def accuracy(model, x, y) -> float:
    if len(x) == 0:
        return float("nan")
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return correct


def private(model, dataset, *, batch, lr, sigma, seed, bug=None):
    """Opacus SGD over `dataset` (Poisson sampling at rate 1 / ceil(n / batch)); optional bug."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    engine = PrivacyEngine(accountant="rdp")
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(seed))
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma, max_grad_norm=1.0,
        noise_generator=torch.Generator().manual_seed(seed + 10_000),
    )
    if bug:
        inject_bug(optimizer, bug)
    return model, optimizer, loader, engine


def train(model, optimizer, loader, epochs: int) -> None:
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(epochs):
        for x, y in loader:
            if len(x) == 0:  # an empty Poisson batch
                continue
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()


def noise_for(target_epsilon: float, batches: int, steps: int) -> float:
    return get_noise_multiplier(target_epsilon=target_epsilon, target_delta=DELTA, sample_rate=1 / batches,
                                steps=steps, accountant="rdp")


def audit_into(out: dict, canaries: FinalModelCanaries, model, claim: float) -> None:
    """Both estimators, union and split guess selection, into `out`."""
    for selection in ("union", "split"):
        result = canaries.audit(model, delta=DELTA, accountant_epsilon=claim, selection=selection)
        for name, b in result.bounds.items():
            out[f"{name}_{selection}"] = b.epsilon
            out[f"{name}_{selection}_rule"] = f"{b.score} {b.correct}/{b.guesses_in + b.guesses_out}"


def run_digits(*, model_name="cnn", kind=None, count=0, batch=64, epochs=20, lr=0.5, target_epsilon=None, sigma=None,
               seed=0, bug=None, whitebox=True) -> dict:
    """One digits run; the noise multiplier is `sigma` or the one for `target_epsilon`."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    train_set, held_out = digits_split()
    model = make_model(model_name)
    canaries, dataset = None, train_set
    if count:
        canaries = FinalModelCanaries(
            count, kind, num_classes=10, seed=seed, held_out=held_out if kind in ("mislabeled", "crafted") else None,
            model=model if kind == "crafted" else None,
        )
        dataset = canaries.wrap(train_set)
    batches = math.ceil(len(dataset) / batch)
    steps = epochs * batches
    if sigma is None:
        sigma = noise_for(target_epsilon, batches, steps)
    model, optimizer, loader, engine = private(model, dataset, batch=batch, lr=lr, sigma=sigma, seed=seed, bug=bug)
    whitebox = whitebox and sigma > 0  # the auditor refuses a run that claims nothing
    auditor = PrivacyAuditor(optimizer, accountant=engine.accountant, delta=DELTA, seed=seed) if whitebox else None
    if canaries is not None:
        canaries.record_start(model)
    train(model, optimizer, loader, epochs)
    claim = engine.get_epsilon(DELTA) if sigma > 0 else math.inf
    out = {"model": model_name, "kind": kind, "count": count, "bug": bug, "seed": seed, "batch": batch,
           "epochs": epochs, "lr": lr, "sigma": sigma, "steps": steps, "accountant_epsilon": claim,
           "test_accuracy": accuracy(model, *held_out)}
    if canaries is not None:
        out["included"] = canaries.num_included
        audit_into(out, canaries, model, claim)
        if kind == "mislabeled":  # held-out digits whose relabeled copy was not trained on
            inputs = canaries.examples[0].flatten(1)
            source = torch.cdist(inputs, held_out[0].flatten(1)).argmin(1)
            clean = torch.ones(len(held_out[0]), dtype=torch.bool)
            clean[source[torch.from_numpy(canaries.included)]] = False
            out["clean_accuracy"] = accuracy(model, held_out[0][clean], held_out[1][clean])
    if auditor is not None:
        out["whitebox"] = auditor.result().epsilon_lower_bound
        auditor.detach()
    out["seconds"] = time.perf_counter() - start
    return out


def run_linear(*, seed=0, target_epsilon=4.0, count=1000, n=200, d=8, classes=4, scale=4.0, steps=50, batch=None,
               lr=0.5, bug=None) -> dict:
    """A linear softmax model on synthetic data; canary i is scale * e_{d+i} with a random label.

    The n training points are Gaussian clusters in the first d coordinates (zeros after);
    batch None: full-batch steps (Poisson rate 1), else Poisson batches of expected size
    `batch`; `steps` rounded down to whole epochs.
    """
    start = time.perf_counter()
    base, canary_x, canary_y = coordinate_canary_task(seed, count, n=n, d=d, classes=classes, scale=scale)
    canaries = FinalModelCanaries(inputs=canary_x, labels=canary_y, num_classes=classes, seed=seed)
    dataset = canaries.wrap(base)
    batch = batch or len(dataset)
    batches = math.ceil(len(dataset) / batch)
    epochs = max(1, steps // batches)
    sigma = noise_for(target_epsilon, batches, epochs * batches)
    torch.manual_seed(seed)
    model, optimizer, loader, engine = private(nn.Linear(d + count, classes), dataset, batch=batch, lr=lr,
                                               sigma=sigma, seed=seed, bug=bug)
    canaries.record_start(model)
    train(model, optimizer, loader, epochs)
    claim = engine.get_epsilon(DELTA)
    out = {"seed": seed, "sigma": sigma, "steps": epochs * batches, "accountant_epsilon": claim}
    audit_into(out, canaries, model, claim)
    out["seconds"] = time.perf_counter() - start
    return out


def fmt(x, digits=2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.{digits}f}"


def spread(values, digits=2) -> str:
    """mean (min-max) over seeds."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(set(fmt(v, digits) for v in values)) == 1:
        return fmt(values[0], digits)
    return f"{fmt(float(np.mean(values)), digits)} ({fmt(min(values), digits)}-{fmt(max(values), digits)})"


KINDS_PLAN = [(None, 0, dict(sigma=0.0))] + [(k, m, {}) for k, ms in KINDS.items() for m in ms]


def run_kinds(args) -> list:
    rows = []
    for kind, count, extra in KINDS_PLAN:
        for seed in args.seeds:
            options = {**KINDS_SETTINGS, **extra}
            if "sigma" in extra:
                options.pop("target_epsilon")
            r = run_digits(kind=kind, count=count, seed=seed, **options)
            rows.append(r)
            print(f"  kinds: {kind or 'none'} m={count} sigma={r['sigma']:.3f} seed={seed}: "
                  f"acc {r['test_accuracy']:.3f} "
                  + " ".join(f"{b} {fmt(r.get(b))}" for b in BOUNDS) + f" whitebox {fmt(r.get('whitebox'))} "
                  f"({r['seconds']:.0f} s)", flush=True)
    return rows


def table_kinds(rows) -> None:
    seeds = sorted({r["seed"] for r in rows})
    s = KINDS_SETTINGS
    print(f"\nDigits CNN, batch {s['batch']}, {s['epochs']} epochs, lr {s['lr']}, accountant epsilon "
          f"{s['target_epsilon']:g}; mean (min-max) over seeds {seeds}\n")
    print(harness.header("canaries", "m", "sigma", "test accuracy", *BOUND_NAMES, "white-box", "accountant eps"))
    for kind, count, extra in KINDS_PLAN:
        group = [r for r in rows
                 if r["kind"] == kind and r["count"] == count and (r["sigma"] == 0) == ("sigma" in extra)]
        name = kind or ("none, no noise (sigma 0)" if "sigma" in extra else "none")
        cells = [spread([r.get(b) for r in group]) if count else "-" for b in BOUNDS]
        whitebox = spread([r.get("whitebox") for r in group]) if "sigma" not in extra else "-"
        acc = spread([r["test_accuracy"] for r in group], 3)
        if kind == "mislabeled":
            acc += f"; {spread([r['clean_accuracy'] for r in group], 3)} on the digits not trained on"
        print(f"| {name} | {count} | {spread([r['sigma'] for r in group], 3)} | {acc} | {' | '.join(cells)} | "
              f"{whitebox} | {spread([r['accountant_epsilon'] for r in group])} |")


BUG_ROWS = (None, "no-noise", "mean-sensitivity")


def run_bugs(args) -> list:
    rows = []
    for model_name in args.models:
        for bug in BUG_ROWS:
            for seed in args.seeds:
                r = run_digits(model_name=model_name, bug=bug, seed=seed, **BUGS_SETTINGS)
                rows.append(r)
                print(f"  bugs: {model_name} {bug or 'correct'} seed={seed}: claim {r['accountant_epsilon']:.3f} acc "
                      f"{r['test_accuracy']:.3f} " + " ".join(f"{b} {fmt(r[b])}" for b in BOUNDS)
                      + f" whitebox {fmt(r['whitebox'])} ({r['seconds']:.0f} s)", flush=True)
    return rows


def table_bugs(rows) -> None:
    s, seeds = BUGS_SETTINGS, sorted({r["seed"] for r in rows})
    print(f"\n{s['count']} {s['kind']} canaries, batch {s['batch']}, {s['epochs']} epochs, lr {s['lr']}, claimed "
          f"(accountant) epsilon {s['target_epsilon']:g}; mean (min-max) over seeds {seeds}\n")
    print(harness.header("model", "optimizer", "claim", *BOUND_NAMES, "runs steinke union > claim", "white-box",
                         "test accuracy"))
    for model_name in dict.fromkeys(r["model"] for r in rows):
        for bug in BUG_ROWS:
            group = [r for r in rows if r["model"] == model_name and r["bug"] == bug]
            over = sum(r["steinke_union"] > r["accountant_epsilon"] for r in group)
            print(f"| {model_name} | {bug or 'correct'} | {spread([r['accountant_epsilon'] for r in group])} | "
                  + " | ".join(spread([r[b] for r in group]) for b in BOUNDS)
                  + f" | {over}/{len(group)} | {spread([r['whitebox'] for r in group])} | "
                  f"{spread([r['test_accuracy'] for r in group], 3)} |")


def run_validity(args) -> list:
    rows = []
    for label, options in VALIDITY_SETTINGS:
        begun = time.perf_counter()
        for i in range(args.runs):
            r = run_linear(seed=1000 + i, **options)
            r["setting"] = label
            rows.append(r)
            if (i + 1) % 10 == 0:
                print(f"  validity: {label}: {i + 1}/{args.runs} runs, {time.perf_counter() - begun:.0f} s", flush=True)
    return rows


def table_validity(rows) -> None:
    seconds = [r["seconds"] for r in rows]
    seeds = sorted({r["seed"] for r in rows})
    print(f"\nLinear model, {run_linear.__kwdefaults__['count']} canaries on their own coordinates; correct runs, "
          f"seeds {seeds[0]}-{seeds[-1]} in each setting\n")
    print(harness.header("setting", "claim", "bound", "runs > claim", "runs > 0", "bound / claim: mean", "median",
                         "95th pct", "max"))
    for label in dict.fromkeys(r["setting"] for r in rows):
        group = [r for r in rows if r["setting"] == label]
        claim = float(np.mean([r["accountant_epsilon"] for r in group]))
        for b in BOUNDS:
            ratio = np.array([r[b] / r["accountant_epsilon"] for r in group])
            over = sum(r[b] > r["accountant_epsilon"] for r in group)
            positive = sum(r[b] > 0 for r in group)
            print(f"| {label} | {claim:.2f} | {b.replace('_', ' ')} | {over}/{len(group)} | {positive}/{len(group)} | "
                  f"{ratio.mean():.3f} | {np.median(ratio):.3f} | {np.quantile(ratio, 0.95):.3f} | {ratio.max():.3f} |")
    print(f"\n{len(rows)} runs, {sum(seconds):.0f} s of training and auditing (mean {np.mean(seconds):.2f} s, "
          f"max {max(seconds):.2f} s per run)")


PARTS = {"kinds": (run_kinds, table_kinds), "bugs": (run_bugs, table_bugs), "validity": (run_validity, table_validity)}


def main():
    parser = harness.parser(__doc__)
    parser.add_argument("--part", choices=list(PARTS), required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="kinds, bugs: seeds per row")
    parser.add_argument("--models", nargs="+", default=["cnn", "mlp512"], help="bugs: cnn, mlpWIDTH")
    parser.add_argument("--runs", type=int, default=50, help="validity: runs per setting")
    parser.add_argument("--out", type=Path, default=None, help="the JSON (default: final_model_<part>.json here)")
    parser.add_argument("--from-json", type=Path, default=None, help="print the tables of a saved JSON, run nothing")
    args = parser.parse_args()
    run, table = PARTS[args.part]
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        if saved.get("part") != args.part:
            raise SystemExit(f"{args.from_json} holds part {saved.get('part')!r}, not {args.part!r}")
        table(saved["rows"])
        return
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    rows = run(args)
    table(rows)
    print(f"\n{args.part}: {time.perf_counter() - start:.0f} s wall time")
    out = args.out or Path(__file__).with_name(f"final_model_{args.part}.json")
    out.write_text(json.dumps({"part": args.part, "delta": DELTA, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
