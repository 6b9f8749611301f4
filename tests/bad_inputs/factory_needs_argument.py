"""The factory needs an argument: autoshard calls it with none."""

import torch
import torch.nn as nn


def build(width):
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


def example_batch(batch_size):
    return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)
