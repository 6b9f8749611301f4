"""Bad input: forward fails on the example batch (8 features into a Linear of 4)."""
import torch
import torch.nn as nn


def build():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 4)
