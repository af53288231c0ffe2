"""Bundled demo data and model: scikit-learn's 8x8 digits (1,797 images, nothing downloaded)."""

from __future__ import annotations

import math
from typing import Sequence, Tuple, Union

import torch
from opacus import PrivacyEngine
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["DigitsCNN", "digits_dataset", "digits_holdout", "make_private_digits", "train_steps"]


def digits_dataset(*, dtype: torch.dtype = torch.float32) -> TensorDataset:
    """Return scikit-learn's digits as a TensorDataset of (image, label).

    Images have shape (1, 8, 8) with pixels scaled to [0, 1] (raw value / 16);
    labels are int64 in 0..9.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.as_tensor(digits.images, dtype=dtype).div_(16.0).unsqueeze(1)
    labels = torch.as_tensor(digits.target, dtype=torch.int64)
    return TensorDataset(images, labels)


def digits_holdout(holdout: int, *, dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """The last `holdout` digits (images, labels): the examples make_private_digits(holdout=...) leaves out."""
    images, labels = digits_dataset(dtype=dtype).tensors
    return images[len(images) - holdout :], labels[len(labels) - holdout :]


class DigitsCNN(nn.Module):
    """Small Opacus-compatible CNN for 1x8x8 digits (no BatchNorm; 9,802 parameters).

    conv(1->8) - ReLU - conv(8->16) - ReLU - maxpool(2) - flatten - linear(256->32) - ReLU - linear(32->10).
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * 4 * 4, 32),
            nn.ReLU(),
            nn.Linear(32, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images of shape (N, 1, 8, 8) to logits of shape (N, num_classes)."""
        return self.classifier(self.features(x))


def make_private_digits(
    *,
    noise_multiplier: float = 1.0,
    max_grad_norm: Union[float, Sequence[float]] = 1.0,
    batch_size: int = 64,
    lr: float = 0.1,
    poisson_sampling: bool = True,
    clipping: str = "flat",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    loss_reduction: str = "mean",
    accountant: str = "rdp",
    holdout: int = 0,
    **private_options,
) -> Tuple[nn.Module, DPOptimizer, DataLoader, PrivacyEngine]:
    """Build the digits data, a DigitsCNN and SGD, and make them private with Opacus.

    Returns ``(model, optimizer, data_loader, privacy_engine)`` as given by
    ``PrivacyEngine(accountant=accountant).make_private``. ``seed`` fixes the
    model initialisation, the batch sampling and the noise. With
    ``clipping="per_layer"`` a float ``max_grad_norm`` is split evenly over the
    parameter tensors (each gets ``max_grad_norm / sqrt(k)``), so the joint
    bound, and hence the noise, equals the flat case; a sequence is used as given.
    ``holdout`` examples at the end are left out of training (``digits_holdout``).
    Other keyword arguments go to ``make_private`` as they are (``grad_sample_mode="functorch"``,
    ``clipping="adaptive"`` with its options, ...).
    """
    torch.manual_seed(seed)
    dataset = digits_dataset(dtype=dtype)
    if holdout:
        dataset = TensorDataset(*(t[: len(t) - holdout] for t in dataset.tensors))
    model = DigitsCNN().to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data_loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    if clipping == "per_layer" and not isinstance(max_grad_norm, Sequence):
        k = sum(1 for p in model.parameters() if p.requires_grad)
        max_grad_norm = [float(max_grad_norm) / math.sqrt(k)] * k
    privacy_engine = PrivacyEngine(accountant=accountant)
    model, optimizer, data_loader = privacy_engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=data_loader,
        noise_multiplier=noise_multiplier,
        max_grad_norm=list(max_grad_norm) if isinstance(max_grad_norm, Sequence) else max_grad_norm,
        poisson_sampling=poisson_sampling,
        clipping=clipping,
        loss_reduction=loss_reduction,
        # A separate stream from the sampler's, so batch choice and noise are not correlated.
        noise_generator=torch.Generator().manual_seed(seed + 1),
        **private_options,
    )
    return model, optimizer, data_loader, privacy_engine


def train_steps(model, optimizer, data_loader, steps: int, *, loss_fn=None, stop=None) -> int:
    """Run `steps` optimizer steps over the loader (cycling epochs); returns steps done.

    stop() is checked after every step and ends training early when it returns True.
    """
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    done = 0
    while done < steps:
        for images, labels in data_loader:
            optimizer.zero_grad()
            loss_fn(model(images), labels).backward()
            optimizer.step()
            done += 1
            if done >= steps or (stop is not None and stop()):
                return done
    return done
