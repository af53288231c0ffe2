"""How the audit's per-step cost grows with the number of tensors the optimizer trains.

MLPs of L linear layers (2 L tensors, width 32, inputs of 64 features, 10 classes) under
Opacus's hooks, batch 64, one thread, the default auditor given the loader. For each L the
runs alternate plain and audited (`--rounds` of each, the median taken), so machine noise hits
both alike; the audit's cost is audited minus plain, in ms per step.

    OMP_NUM_THREADS=1 .venv/bin/python bench/cost/tensor_count.py [--layers 2 8 32] [--steps 200] [--rounds 3]
"""

from __future__ import annotations

import time
import warnings

from _path import harness

import torch

WARM_UP = 20


def private_mlp(layers: int, seed: int = 0):
    from opacus import PrivacyEngine

    torch.manual_seed(seed)
    widths = [64] + [32] * (layers - 1) + [10]
    modules = []
    for n_in, n_out in zip(widths[:-1], widths[1:]):
        modules += [torch.nn.Linear(n_in, n_out), torch.nn.ReLU()]
    model = torch.nn.Sequential(*modules[:-1])
    data = torch.utils.data.TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
    loader = torch.utils.data.DataLoader(data, batch_size=64)
    return PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, noise_generator=torch.Generator().manual_seed(seed))


def ms_per_step(layers: int, audited: bool, steps: int) -> float:
    from lightning_dpaudit import PrivacyAuditor

    model, optimizer, loader = private_mlp(layers)
    if audited:
        PrivacyAuditor(optimizer, seed=1, data_loader=loader)
    done, start = 0, None
    while done < steps + WARM_UP:
        for x, y in loader:
            if done == WARM_UP:
                start = time.perf_counter()
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            done += 1
            if done == steps + WARM_UP:
                break
    return (time.perf_counter() - start) / steps * 1e3


def main():
    parser = harness.parser(__doc__)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print(harness.header("linear layers", "tensors", "plain ms/step", "audited ms/step", "audit ms/step", "ratio"))
    for layers in args.layers:
        times = harness.alternate({audited: (lambda _, a=audited: ms_per_step(layers, a, args.steps))
                                   for audited in (False, True)}, args.rounds)
        medians = harness.medians(times)
        plain, audited = medians[False], medians[True]
        print(f"| {layers} | {2 * layers} | {plain:.2f} | {audited:.2f} | {audited - plain:.2f} | {audited / plain:.3f}x |",
              flush=True)


if __name__ == "__main__":
    main()
