"""A residual MLP: ``nn.Sequential`` of 4 identical blocks on float vectors.

Model-file contract (docs/design.md) without ``loss_fn``: the targets are floats, so the default
loss is mean squared error. The task is a fixed random smooth map, ``tanh(x @ M)`` with M
drawn from its own seeded generator, so the data depend only on torch's global seed.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM = 32
HIDDEN = 128
N_BLOCKS = 4


class ResidualBlock(nn.Module):
    """x + W₂ · gelu(W₁ · layer_norm(x))."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def build() -> nn.Sequential:
    return nn.Sequential(*(ResidualBlock() for _ in range(N_BLOCKS)))


def _task_matrix() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(DIM, DIM, generator=gen) / DIM**0.5


def example_batch(batch_size: int):
    """``((x (batch, 32),), tanh(x @ M))``: float targets, so the default loss is MSE."""
    x = torch.randn(batch_size, DIM)
    return (x,), torch.tanh(x @ _task_matrix())
