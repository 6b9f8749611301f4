"""Layers of which every other one holds the same child module (Zamba's one transformer block, a child of each of its
hybrid layers): one parameter under two blocks' paths."""

from __future__ import annotations

import torch
import torch.nn as nn

WIDTH = 16
LAYERS = 4


class Layer(nn.Module):
    def __init__(self, shared: nn.Module | None):
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH)
        if shared is not None:
            self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.mix(x))
        return x + torch.tanh(self.shared(x)) if hasattr(self, "shared") else x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(Layer(shared if i % 2 else None) for i in range(LAYERS))
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def build() -> Net:
    return Net()


def example_batch(batch_size: int):
    """``((x (batch, 16),), x)``: float targets, the default loss (MSE)."""
    x = torch.randn(batch_size, WIDTH)
    return (x,), x
