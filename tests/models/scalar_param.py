"""A residual MLP with 0-d (scalar) parameters, as CLIP's ``logit_scale``.

Model-file contract (docs/design.md) without ``loss_fn``: float targets, so the default loss is mean
squared error. Each of the 4 repeated blocks scales its branch by a scalar gate, and the head's
output is multiplied by ``logit_scale.exp()``: FSDP2 cannot shard 0-d parameters, so the runtime
keeps them whole on every rank and averages their gradients over dp.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM = 32
HIDDEN = 64
N_BLOCKS = 4


class GatedBlock(nn.Module):
    """x + gate · W₂ · gelu(W₁ · layer_norm(x)), ``gate`` a 0-d parameter."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.gate = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.fc2(F.gelu(self.fc1(self.norm(x))))


class ScalarParamNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(GatedBlock() for _ in range(N_BLOCKS))
        self.head = nn.Linear(DIM, DIM)
        self.logit_scale = nn.Parameter(torch.tensor(0.1))  # CLIP's is log(1 / 0.07) = 2.6592

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) * self.logit_scale.exp()


def build() -> ScalarParamNet:
    return ScalarParamNet()


def _task_matrix() -> torch.Tensor:
    gen = torch.Generator().manual_seed(4321)
    return torch.randn(DIM, DIM, generator=gen) / DIM**0.5


def example_batch(batch_size: int):
    """``((x (batch, 32),), tanh(x @ M))``: float targets, so the default loss is MSE."""
    x = torch.randn(batch_size, DIM)
    return (x,), torch.tanh(x @ _task_matrix())
