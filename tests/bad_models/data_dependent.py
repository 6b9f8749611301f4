import torch
import torch.nn as nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.export cannot capture it
            return self.a(x)
        return x


def build():
    return Branchy()


def example_batch(batch_size):
    return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)
