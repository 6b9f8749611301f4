"""Bad input: example_batch returns one tensor instead of (inputs, targets)."""
import torch
import torch.nn as nn


def build():
    return nn.Linear(4, 4)


def example_batch(batch_size):
    return torch.randn(batch_size, 4)
