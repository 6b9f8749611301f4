import torch
import torch.nn as nn


def build():
    return nn.Linear(4, 4)


def example_batch(batch_size):
    return (torch.randn(batch_size + 1, 4),), torch.randn(batch_size + 1, 4)
