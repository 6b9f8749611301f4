"""A model that draws randomness torch cannot see: Python's ``random`` scales its hidden layer each forward."""

import random

import torch
import torch.nn as nn


class Jittered(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * random.uniform(0.9, 1.1))


def build():
    return Jittered()


def example_batch(batch_size: int):
    x = torch.randn(batch_size, 8)
    return (x,), x.flip(-1)
