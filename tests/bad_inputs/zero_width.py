"""Zero-size dimension: a layer of width 0 (no parameters to shard, nothing to compute)."""
import torch
import torch.nn as nn


def build():
    return nn.Sequential(nn.Linear(4, 0), nn.Linear(0, 4))


def example_batch(batch_size):
    return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)
