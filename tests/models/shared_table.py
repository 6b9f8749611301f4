"""A stack of blocks that all read one table made outside them from a parameter (a learned bias, as a
learned relative-position table is): the table crosses every pipeline boundary beside the residual stream,
and its gradient crosses back.

Model-file contract (docs/design.md) without ``loss_fn``: float targets, so the default loss is mean squared
error.
"""

from __future__ import annotations

import torch
import torch.nn as nn

WIDTH = 32
LAYERS = 4


class Block(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x) + table)


class SharedTable(nn.Module):
    def __init__(self, width: int = WIDTH, layers: int = LAYERS):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.table = nn.Parameter(torch.zeros(16, width))
        self.h = nn.ModuleList(Block(width) for _ in range(layers))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.table * 2.0  # made outside the blocks from a parameter: every block reads it
        x = self.inp(x)
        for block in self.h:
            x = block(x, table)
        return self.out(x)


def build() -> SharedTable:
    torch.manual_seed(0)
    return SharedTable()


def example_batch(batch_size: int):
    """``((x (batch, 16, 32),), tanh(x))``."""
    x = torch.randn(batch_size, 16, WIDTH, generator=torch.Generator().manual_seed(1))
    return (x,), torch.tanh(x)
