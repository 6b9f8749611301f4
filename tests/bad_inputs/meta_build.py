"""Untraceable on meta: the factory reads tensor values while building (fails without real memory)."""
import torch
import torch.nn as nn


def build():
    width = int(torch.tensor([4.0]).sum().item())  # reading a value: impossible on the meta device
    return nn.Linear(width, width)


def example_batch(batch_size):
    return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)
