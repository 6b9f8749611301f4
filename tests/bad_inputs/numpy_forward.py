"""Unsupported op: forward leaves torch for NumPy, which torch.export cannot trace."""
import torch
import torch.nn as nn


class ToNumpy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        return torch.from_numpy(y.detach().numpy() * 2.0)


def build():
    return ToNumpy()


def example_batch(batch_size):
    return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)
