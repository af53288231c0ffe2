"""What the exact data-path checks cost: the audit with them (default every 100 steps) against the audit
without them (per_sample_check_every=0), alternating A and B in one run, the ratio of median times.

    .venv/bin/python bench/cost/data_path_overhead.py [--configs digits64 digits512 transformer10M] [--steps 100] [--rounds 10]

Besides the A/B ratio (which on a loaded machine carries the load's own noise), it reports the
time spent inside the exact checks as a share of the B runs' time: the checks' own cost.

digits64 / digits512: the digits CNN under Opacus's hooks, batch 64 / 512. transformer10M:
the decoder-only transformer of examples/_transformer.py (10 M parameters) under ghost
clipping, batch 16 of 64 tokens. dropout64 / dropout512: the digits CNN with dropout (p = 0.2) after
its hidden layer, whose examples' outputs cannot be reproduced alone, so each check replays the whole
batch from its random state. Each timing covers `--steps` steps (a multiple of the
check interval, so it holds its share of checked steps).
"""

from __future__ import annotations

import time
import warnings

from _path import harness

import torch
from torch import nn

from overhead import SPENT, timed_checks  # this folder's overhead.py

harness.on_path("examples")  # _transformer.py
warnings.filterwarnings("ignore")


REPLAYS = []  # the dropout runs' replay counts (examples alone, whole batch), printed at the end
ACCOUNTS = []  # one line per configuration, printed at the end
CHECKS = []  # each run's PerSampleCheck, for the budget's own account (the last one built is B's)


def checked(auditor):
    """The auditor, its checks timed (SPENT) and kept (CHECKS)."""
    timed_checks(auditor)
    CHECKS.append(auditor.per_sample_check)
    return auditor
def digits(batch_size: int, every: int):
    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.integrations.digits import make_private_digits

    model, optimizer, loader, _ = make_private_digits(batch_size=batch_size, seed=0)
    checked(PrivacyAuditor(optimizer, seed=0, per_sample_check_every=every))
    batches = [b for b in loader if len(b[0])]
    return optimizer, batches, lambda b: nn.functional.cross_entropy(model(b[0]), b[1])


def dropout(batch_size: int, every: int):
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader

    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.integrations.digits import DigitsCNN, digits_dataset

    torch.manual_seed(0)
    model = DigitsCNN()
    model.classifier.insert(3, nn.Dropout(0.2))
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(digits_dataset(), batch_size=batch_size, shuffle=True), noise_multiplier=1.0,
        max_grad_norm=1.0, noise_generator=torch.Generator().manual_seed(1),
    )
    auditor = PrivacyAuditor(optimizer, seed=0, per_sample_check_every=every)
    checked(auditor)
    REPLAYS.append(auditor.per_sample_check.replays)
    batches = [b for b in loader if len(b[0])]
    return optimizer, batches, lambda b: nn.functional.cross_entropy(model(b[0]), b[1])


def transformer(every: int, size: str = "10M", batch: int = 16, seq_len: int = 64):
    from _transformer import SIZES, build_model, markov_tokens
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dpaudit import PrivacyAuditor

    vocab = SIZES[size][0]
    model = build_model(size, seq_len, seed=0)
    tokens = markov_tokens(vocab, 8 * batch, seq_len, seed=0)
    model, optimizer, criterion, _ = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        data_loader=DataLoader(TensorDataset(tokens), batch_size=batch), criterion=nn.CrossEntropyLoss(),
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode="ghost",
    )
    checked(PrivacyAuditor(optimizer, seed=0, per_sample_check_every=every))

    def loss(b):
        logits = model(b[:, :-1])
        return criterion(logits.reshape(-1, vocab), b[:, 1:].reshape(-1), shape=(len(b), seq_len))

    return optimizer, list(tokens.split(batch)), loss


def build(config: str, every: int):
    if config == "transformer10M":
        return transformer(every)
    if config.startswith("dropout"):
        return dropout(int(config.removeprefix("dropout")), every)
    return digits(int(config.removeprefix("digits")), every)


def timed(run, steps: int, start_step: int) -> float:
    optimizer, batches, loss = run
    begin = time.perf_counter()
    for i in range(start_step, start_step + steps):
        optimizer.zero_grad()
        loss(batches[i % len(batches)]).backward()
        optimizer.step()
    return time.perf_counter() - begin


def main() -> None:
    from lightning_dpaudit.engine.checks.exact.per_sample import DEFAULT_EVERY

    parser = harness.parser(__doc__, full_doc=True)
    parser.add_argument("--configs", nargs="+", default=["digits64", "digits512", "transformer10M"])
    parser.add_argument("--steps", type=int, default=DEFAULT_EVERY)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--every", type=int, default=DEFAULT_EVERY)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(harness.header("config", f"audit without the checks (s / {args.steps} steps)",
                         f"with them, every {args.every}", "ratio (medians)", "ratio (sums)",
                         "time inside the checks / B's time"))
    for config in args.configs:
        runs = {"A": build(config, 0), "B": build(config, args.every)}
        for run in runs.values():
            timed(run, 3, 0)  # warm-up, before the timed steps
        SPENT["seconds"] = 0.0
        # round r times steps 3 + r * steps onwards of each run (A first in even rounds, B first in odd ones)
        times = harness.alternate({name: (lambda r, run=run: timed(run, args.steps, 3 + r * args.steps))
                                   for name, run in runs.items()}, args.rounds, swap=True)
        medians = harness.medians(times)
        a, b = medians["A"], medians["B"]
        inside = SPENT["seconds"] / sum(times["B"])
        print(f"| {config} | {a:.2f} | {b:.2f} | {b / a:.3f} | {sum(times['B']) / sum(times['A']):.3f} | "
              f"{inside:.2%} |", flush=True)
        check = CHECKS[-1]  # B's: its own account, against the wall time since its first step (A's steps included)
        budget, elapsed = check.budget, check.budget.elapsed()
        ACCOUNTS.append(f"{config}: {check.checked} step(s) checked, {budget.skipped} due step(s) skipped for the "
                        f"budget; the checks' own clock: {budget.spent:.2f} s of {elapsed:.1f} s since the first step "
                        f"({budget.spent / elapsed:.2%}; budget {budget.share:.1%} after step 1's {budget.first_cost or 0:.2f} s)")
    for account in ACCOUNTS:
        print(account)
    for replays in REPLAYS:
        if replays["examples"] or replays["batch"]:
            print(f"dropout run's checks replayed the examples alone {replays['examples']} time(s), the whole batch "
                  f"{replays['batch']} time(s)")


if __name__ == "__main__":
    main()
