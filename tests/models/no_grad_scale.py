"""Residual blocks scaled by a factor the model's own forward computes from its weights under ``torch.no_grad()``,
outside the blocks: a region that reads values needing gradients where a stage boundary could fall inside it, so
the planner keeps the model in one stage. Model-file contract (docs/design.md); the default loss (mean squared
error) on float targets.
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


class ScaledStack(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = 4):
        super().__init__()
        self.scale = nn.Linear(width, 1)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            s = torch.sigmoid(self.scale(x))
        for block in self.blocks:
            x = block(x)
        return x * s


def build() -> ScaledStack:
    return ScaledStack()


def example_batch(batch_size: int):
    x = torch.randn(batch_size, WIDTH)
    return (x,), torch.tanh(x)
