"""Bad input: forward takes its second input keyword-only, but example_batch's inputs are passed positionally."""
import torch
import torch.nn as nn


class KeywordOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x, *, scale):
        return self.a(x) * scale


def build():
    return KeywordOnly()


def example_batch(batch_size):
    return (torch.randn(batch_size, 4), torch.randn(batch_size, 4)), torch.randn(batch_size, 4)
