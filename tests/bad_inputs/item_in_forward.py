"""Untraceable: forward reads a tensor value with .item() and branches on it."""
import torch
import torch.nn as nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        steps = int(x.abs().max().item())  # a Python number from tensor data
        for _ in range(steps):
            x = self.a(x)
        return x


def build():
    return Gate()


def example_batch(batch_size):
    return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)
