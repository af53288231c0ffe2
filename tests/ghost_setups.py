"""Small models trained with Opacus ghost clipping, shared by the ghost-clipping tests and scenarios."""

from __future__ import annotations

import warnings

import torch
from opacus import PrivacyEngine
from torch import nn

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")

VOCAB, TOKENS, CLASSES = 50, 4, 3


def token_model(seed: int = 0) -> nn.Module:
    """Embedding (ghost norms), linear layers (ghost norms) and a LayerNorm (per-sample gradients)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Embedding(VOCAB, 16), nn.Flatten(), nn.Linear(16 * TOKENS, 32), nn.LayerNorm(32), nn.ReLU(),
        nn.Linear(32, CLASSES),
    )


def token_data(n: int = 512, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, TOKENS), generator=g)
    y = (x[:, 0] % CLASSES + (torch.rand(n, generator=g) < 0.2).long()) % CLASSES
    return torch.utils.data.TensorDataset(x, y)


ADAPTIVE = dict(target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0, min_clipbound=0.01)


def make_ghost(*, seed: int = 0, noise_multiplier: float = 1.0, max_grad_norm: float = 1.0, batch_size: int = 64,
               module: nn.Module = None, dataset=None, sampler=None, grad_sample_mode: str = "ghost",
               adaptive: bool = False, poisson_sampling: bool = True):
    """make_private(..., grad_sample_mode="ghost") with a seeded noise generator: (module, optimizer, criterion, loader).
    adaptive: Opacus's PrivacyEngineAdaptiveClipping (the clipping bound moves after each step, ADAPTIVE).
    poisson_sampling: Opacus's Poisson sampling (a DPDataLoader drawing from its own seeded generator; under DDP
    or FSDP its distributed sampler) rather than the loader's fixed batches."""
    model = module if module is not None else token_model(seed)
    data = dataset if dataset is not None else token_data()
    sampling = dict(generator=torch.Generator().manual_seed(seed + 2)) if poisson_sampling else {}
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, sampler=sampler, **sampling)
    if adaptive:
        from opacus.utils.adaptive_clipping import PrivacyEngineAdaptiveClipping

        engine, extra = PrivacyEngineAdaptiveClipping(), ADAPTIVE
    else:
        engine, extra = PrivacyEngine(), {}
    return engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        criterion=nn.CrossEntropyLoss(), noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
        grad_sample_mode=grad_sample_mode, noise_generator=torch.Generator().manual_seed(seed + 1),
        poisson_sampling=poisson_sampling,
        **extra,
    )


def train_ghost(module, optimizer, criterion, loader, steps: int) -> None:
    """The ghost-clipping loop: the criterion's loss runs both backward passes, the optimizer adds the noise."""
    done = 0
    while done < steps:
        for x, y in loader:
            criterion(module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done >= steps:
                return


def flat_params(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])
