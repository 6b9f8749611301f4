"""Residual blocks whose middle two run under ``torch.no_grad()`` in the model's own forward (frozen layers): one
region that reads weights and runs blocks 1 and 2, entered outside them. A stage may not begin inside it (at block
1 or 2); it may at block 3. Model-file contract (docs/design.md); the default loss (mean squared error) on float
targets.
"""

from __future__ import annotations

import torch
import torch.nn as nn

WIDTH = 16


class Block(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class FrozenMiddle(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        with torch.no_grad():
            for block in self.blocks[1:-1]:
                x = block(x)
        return self.blocks[-1](x)


def build() -> FrozenMiddle:
    return FrozenMiddle()


def example_batch(batch_size: int):
    x = torch.randn(batch_size, WIDTH)
    return (x,), torch.tanh(x)
