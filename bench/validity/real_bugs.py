"""Opacus's own historical privacy bugs (integrations/opacus_history.py) under a default audit.

Each bug is put back into the installed Opacus 1.6.0 by its patch(), a small model trains
`--steps` steps with a default PrivacyAuditor (plain loop), at clipping bounds 0.1, 1 and 10,
and the same run without the patch shows what correct Opacus gives. One row per run: the
first alarm's step, the findings (certainties and statistical), and the empirical epsilon
bound beside the accountant's.

    .venv/bin/python bench/validity/real_bugs.py [--steps 150] [--bugs opacus-751,...] [--markdown]
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings

from _path import harness

import torch
from torch import nn

warnings.filterwarnings("ignore")

BOUNDS = (0.1, 1.0, 10.0)


class Tokens(nn.Module):
    """Embedding, Linear on sequences (bias too), a LoRA-style adapter, LayerNorm, Linear on 2-D inputs;
    `attention=True` adds nn.MultiheadAttention(batch_first=True)."""

    def __init__(self, attention: bool = False):
        super().__init__()
        self.embed = nn.Embedding(30, 16)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True) if attention else None
        self.hidden = nn.Linear(16, 16)
        self.lora_adapter = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        h = self.embed(tokens)
        if self.attention is not None:
            h = h + self.attention(h, h, h, need_weights=False)[0]
        h = torch.relu(self.hidden(h))
        h = self.norm(h + self.lora_adapter(h))
        return self.head(h.sum(dim=1))


def run(bug: str, C: float, steps: int, patched: bool, ghost_mode: bool):
    from opacus import PrivacyEngine
    from opacus.utils.batch_memory_manager import BatchMemoryManager
    from opacus.validators import ModuleValidator

    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.integrations.opacus_history import historical_bug

    entry, ghost = historical_bug(bug), ghost_mode
    with entry.patch() if patched else contextlib.nullcontext():
        torch.manual_seed(0)
        model = Tokens(attention=bug == "opacus-598")
        if bug == "opacus-598":
            model = ModuleValidator.fix(model)
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 30, (512, 8), generator=g)
        y = (x[:, 0] % 3 + (torch.rand(512, generator=g) < 0.2).long()) % 3
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
        kwargs = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), data_loader=loader,
                      noise_multiplier=1.0, max_grad_norm=C, poisson_sampling=True,
                      noise_generator=torch.Generator().manual_seed(1))
        engine = PrivacyEngine(accountant="gdp" if bug == "opacus-541" else "prv")
        adaptive = dict(target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0,
                        min_clipbound=0.01)
        if bug == "opacus-807" and ghost:  # adaptive ghost clipping (PrivacyEngineAdaptiveClipping)
            from opacus.utils.adaptive_clipping import PrivacyEngineAdaptiveClipping

            module, optimizer, criterion, loader = PrivacyEngineAdaptiveClipping(accountant="prv").make_private(
                grad_sample_mode="ghost", criterion=nn.CrossEntropyLoss(), **adaptive, **kwargs)
        elif bug == "opacus-807":  # AdaClipDPOptimizer
            module, optimizer, loader = engine.make_private(clipping="adaptive", unclipped_num_std=1.0, **adaptive,
                                                            **kwargs)
            criterion = nn.CrossEntropyLoss()
        elif ghost:
            module, optimizer, criterion, loader = engine.make_private(
                grad_sample_mode="ghost", criterion=nn.CrossEntropyLoss(), **kwargs)
        else:
            module, optimizer, loader = engine.make_private(**kwargs)
            criterion = nn.CrossEntropyLoss()
        auditor = PrivacyAuditor(optimizer, seed=2, on_violation=lambda result: None)
        physical = bug == "opacus-accumulation-1.5.3"
        done = 0
        while done < steps:
            manager = (BatchMemoryManager(data_loader=loader, max_physical_batch_size=16, optimizer=optimizer)
                       if physical else contextlib.nullcontext(loader))
            with manager as batches:
                for xb, yb in batches:
                    optimizer.zero_grad()
                    criterion(module(xb), yb).backward()
                    optimizer.step()
                    if bug == "opacus-541":
                        engine.accountant.get_epsilon(1e-5)  # a user's running epsilon in the loop
                    done = auditor.steps
                    if done >= steps:
                        break
        result = auditor.result()
    codes = sorted({f.code for f in result.findings})
    notes = [code for code, _ in auditor.checks.notes()]
    return result, codes, notes


def main() -> None:
    from lightning_dpaudit.integrations.opacus_history import HISTORICAL_BUGS

    parser = harness.parser(__doc__, full_doc=True, steps=150)
    parser.add_argument("--bugs", default=",".join(HISTORICAL_BUGS))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(harness.header("bug", "shipped in", "fixed in", "mode", "C", "Opacus", "first alarm", "findings", "notes",
                         "eps bound / accountant"))
    for name in args.bugs.split(","):
        entry = HISTORICAL_BUGS[name]
        modes = [m for m in ("ghost", "hooks") if m in entry.modes] or ["hooks"]
        if name == "opacus-598":
            modes = ["hooks"]  # DPMultiheadAttention under Opacus's hooks
        for mode, C, patched in ((m, C, p) for m in modes for C in BOUNDS for p in (True, False)):
                start = time.perf_counter()
                try:
                    result, codes, notes = run(name, C, args.steps, patched, mode == "ghost")
                    alarm = "-" if not result.violation else f"step {result.first_violation_step}"
                    eps = f"{result.epsilon_lower_bound:.2f} / {result.epsilon_accountant:.2f}"
                    if math.isnan(result.epsilon_lower_bound):
                        eps = f"- / {result.epsilon_accountant:.2f}"
                except Exception as error:  # a refusal at attach is a row too
                    alarm, codes, notes, eps = f"refused: {type(error).__name__}: {str(error)[:80]}", [], [], "-"
                version = "1.6.0 with the bug put back" if patched else "1.6.0"
                print(f"| {name} | {entry.shipped_in} | {entry.fixed_in or 'open'} | {mode} | {C:g} | {version} | {alarm} | "
                      f"{', '.join(codes) or '-'} | {', '.join(notes) or '-'} | {eps} |  <!-- {time.perf_counter() - start:.0f} s -->",
                      flush=True)


if __name__ == "__main__":
    main()
