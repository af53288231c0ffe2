"""Peak memory of input canaries: resident set with and without the audit.

An MLP of about 10.5 M parameters (1024-2048-2048-2048-10), made private with Opacus
(SGD, flat clipping, no Poisson sampling), trained `--steps` steps on random data. Each
configuration runs in a fresh process and reports its peak resident set (ru_maxrss):

    plain, batch B          Opacus alone
    plain, batch B + k      Opacus alone with k more examples per batch: what k examples cost
    audited, batch B        PrivacyAuditor(canary="mislabeled", canaries_per_step=k)

    .venv/bin/python bench/cost/input_memory.py [--steps 5] [--batch 64] [--canaries 32] [--width 2048] [--mode one-run]

The package is imported from PYTHONPATH, so another checkout can be measured with the
same script. Measured on a 2-core CPU machine (10,512,394 parameters, batch 64, 32
canaries, one-run): Opacus 3,646 MB, 32 more examples +1,586 MB, the audit +1,121 MB
(paired: +1,061 MB); with the float64 copy of the directions the audit had +11,115 MB.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings

from _path import harness

MB = 2**20


def child(args):
    import torch
    from opacus import PrivacyEngine
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    w = args.width
    model = nn.Sequential(
        nn.Linear(1024, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10)
    )
    params = sum(p.numel() for p in model.parameters())
    batch = args.batch + (args.canaries if args.config == "plain+k" else 0)
    data = TensorDataset(torch.randn(batch * args.steps, 1024), torch.randint(10, (batch * args.steps,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=batch),
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
    )
    if args.config == "audited":
        from lightning_dpaudit import PrivacyAuditor

        PrivacyAuditor(
            optimizer, canary="mislabeled", canaries_per_step=args.canaries, module=model, seed=0, mode=args.mode,
            canary_inputs=torch.randn(64, 1024), canary_labels=torch.randint(10, (64,)),
        )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    loss_fn = nn.CrossEntropyLoss()
    start = time.perf_counter()
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    seconds = (time.perf_counter() - start) / args.steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"params": params, "batch": batch, "setup": before, "peak": peak, "step_seconds": seconds}))


def run(config, args):
    command = [sys.executable, os.path.abspath(__file__), "--child", config, "--steps", str(args.steps),
               "--batch", str(args.batch), "--canaries", str(args.canaries), "--width", str(args.width), "--mode", args.mode]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = harness.parser(__doc__, steps=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--canaries", type=int, default=32)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--mode", choices=["one-run", "paired"], default="one-run")
    parser.add_argument("--child", choices=["plain", "plain+k", "audited"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.config = args.child
        return child(args)
    rows = {config: run(config, args) for config in ("plain", "plain+k", "audited")}
    params = rows["plain"]["params"]
    k = args.canaries
    print(f"MLP with {params:,} parameters, batch {args.batch}, {k} canaries per step ({args.mode}), {args.steps} steps")
    print(harness.header("configuration", "batch", "peak RSS (MB)", "above plain (MB)", "seconds per step"))
    names = {"plain": "Opacus", "plain+k": f"Opacus, {k} more examples", "audited": f"Opacus + audit, {k} canaries"}
    for config, row in rows.items():
        extra = (row["peak"] - rows["plain"]["peak"]) / MB
        print(f"| {names[config]} | {row['batch']} | {row['peak'] / MB:.0f} | {extra:+.0f} | {row['step_seconds']:.2f} |")
    print(f"{k} per-sample gradient rows of the model ({k} x {params:,} float32): {k * params * 4 / MB:.0f} MB")


if __name__ == "__main__":
    main()
