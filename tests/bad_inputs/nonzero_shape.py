"""Untraceable: the output shape depends on tensor values (boolean-mask indexing)."""
import torch
import torch.nn as nn


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        return y[y > 0].sum() * torch.ones_like(y)


def build():
    return Masked()


def example_batch(batch_size):
    return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)
