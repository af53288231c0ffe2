"""How the audit's per-step cost grows with the number of tensors the optimizer trains.

MLPs of L linear layers (2 L tensors, width 32, inputs of 64 features, 10 classes) under
Opacus's hooks, batch 64 (Poisson), one thread, the default auditor given the loader. For each
L a plain and an audited run train side by side in one process, taking turns step by step
(`--steps` steps each, after 20 of warm-up; the loader's batch included in a step's time), so
that machine noise lasting longer than a step hits both alike. The audit's cost is the mean of
audited minus plain over all steps: it includes the work done every few steps (the checks every
8 steps, the exact checks every 100, the canaries planned a block at a time). The median step
(the steps where nothing periodic runs) is shown beside it. The fixed part is the intercept of
a least-squares line of the audit's mean cost against the number of tensors.

    OMP_NUM_THREADS=1 .venv/bin/python bench/cost/tensor_count.py [--layers 2 8 32] [--steps 2000]
"""

from __future__ import annotations

import time
import warnings

import numpy as np

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


def stepper(layers: int, audited: bool):
    """One training step of a fresh run per call, its seconds returned (the loader's batch included)."""
    from lightning_dpaudit import PrivacyAuditor

    model, optimizer, loader = private_mlp(layers)
    if audited:
        PrivacyAuditor(optimizer, seed=1, data_loader=loader)
    batches = iter(())

    def step() -> float:
        nonlocal batches
        start = time.perf_counter()
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        return time.perf_counter() - start
    return step


def main():
    parser = harness.parser(__doc__)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print(harness.header("linear layers", "tensors", "plain ms/step", "audited ms/step", "audit ms/step (mean)",
                         "audit ms/step (median step)", "ratio"))
    tensors, costs = [], []
    for layers in args.layers:
        times = harness.step_by_step({a: stepper(layers, a) for a in (False, True)}, args.steps, warm_up=WARM_UP)
        plain, audited = (1e3 * np.array(times[a]) for a in (False, True))
        cost = float(np.mean(audited - plain))
        tensors.append(2 * layers)
        costs.append(cost)
        print(harness.row(layers, 2 * layers, f"{plain.mean():.2f}", f"{audited.mean():.2f}", f"{cost:.3f}",
                          f"{np.median(audited - plain):.3f}", f"{audited.mean() / plain.mean():.3f}x"), flush=True)
    if len(tensors) > 1:
        slope, fixed = np.polyfit(tensors, costs, 1)
        print(f"\nfixed part {fixed:.3f} ms/step, {1e3 * slope:.1f} us/step per tensor (least squares over "
              f"{len(tensors)} sizes)")


if __name__ == "__main__":
    main()
