"""A decoder whose layers hold a module their forward never calls (Blenderbot's ``encoder_attn`` without an
encoder) and a head never called: one process holds them, and so must every pipeline stage's price."""

from __future__ import annotations

import torch
import torch.nn as nn

WIDTH = 16
LAYERS = 4


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.cross = nn.Linear(WIDTH, 3 * WIDTH)  # never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mix(x))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.out = nn.Linear(WIDTH, WIDTH)
        self.unused_head = nn.Linear(WIDTH, 5)  # never called, outside any layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def build() -> Decoder:
    return Decoder()


def example_batch(batch_size: int):
    """``((x (batch, 16),), x)``: float targets, the default loss (MSE)."""
    x = torch.randn(batch_size, WIDTH)
    return (x,), x
