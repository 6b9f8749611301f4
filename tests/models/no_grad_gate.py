"""Residual blocks gated by a ``torch.no_grad()`` region that reads the block's own weights and input.

``h + lin(h) * sigmoid(gate(h))`` with the gate computed without gradients (a stop-gradient gate).
torch's ``pipeline()`` cannot split a model around such a region, so the planner keeps it in one
stage. Model-file contract (docs/design.md); the default loss (mean squared error) on float targets.
"""

from __future__ import annotations

import torch
import torch.nn as nn

WIDTH = 16


class GatedBlock(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            g = torch.sigmoid(self.gate(h))
        return h + self.lin(h) * g


def build() -> nn.Sequential:
    return nn.Sequential(*(GatedBlock() for _ in range(4)))


def example_batch(batch_size: int):
    x = torch.randn(batch_size, WIDTH)
    return (x,), torch.tanh(x)
