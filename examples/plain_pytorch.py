"""Audit a plain PyTorch + Opacus training loop with PrivacyAuditor.

    .venv/bin/python examples/plain_pytorch.py [--steps 500] [--threads 1]

--threads N sets torch's intra-op threads before any work (default 1: the model is small,
so more threads add overhead, and on cores shared with other work they wait for each other).
"""

import argparse

import torch
from opacus import PrivacyEngine

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.datasets import DigitsCNN, digits_dataset


def main(steps: int) -> None:
    model = DigitsCNN()
    loader = torch.utils.data.DataLoader(digits_dataset(), batch_size=64, shuffle=True)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    auditor = PrivacyAuditor(optimizer, delta=1e-5, module=model, data_loader=loader)  # the only added line
    loss_fn = torch.nn.CrossEntropyLoss()
    done = 0
    while done < steps:
        for images, labels in loader:
            optimizer.zero_grad()
            loss_fn(model(images), labels).backward()
            optimizer.step()
            done += 1
            if done >= steps:
                break
    result = auditor.result()
    print(result)  # the summary table `dpaudit report` prints; auditor.summary() returns it
    print()
    print(f"steps {result.steps}: empirical epsilon >= {result.epsilon_lower_bound:.2f}, "
          f"accountant epsilon {result.epsilon_accountant:.2f} (delta 1e-5); violation: {result.violation}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: the model is small, more threads only add overhead)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # before any work
    print(f"torch threads: {torch.get_num_threads()} (--threads)")
    main(args.steps)
