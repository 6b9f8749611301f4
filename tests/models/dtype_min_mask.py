"""A layer that masks with its activations' dtype's minimum made without a dtype (XGLM's attention:
``torch.max(w, torch.full((), torch.finfo(w.dtype).min))``): the tensor takes torch's default dtype."""

from __future__ import annotations

import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.proj(x)
        return torch.max(scores, torch.full((), torch.finfo(scores.dtype).min, device=scores.device))


def build() -> Net:
    return Net()


def example_batch(batch_size: int):
    x = torch.randn(batch_size, 8)
    return (x,), x
