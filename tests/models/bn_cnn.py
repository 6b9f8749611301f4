"""A small CNN with BatchNorm: three conv blocks (conv with a bias, BatchNorm2d, ReLU), then a
linear classifier. The conv biases feed BatchNorm, which subtracts their shift again: their
true gradient is zero. Data: 8x8 images with 4 channels, 10 classes from a fixed rule.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

CHANNELS, SIZE, CLASSES = 4, 8, 10


class ConvBlock(nn.Module):
    def __init__(self, channels: int = 16):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class BatchNormCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(CHANNELS, 16, 1)
        self.blocks = nn.Sequential(ConvBlock(), ConvBlock(), ConvBlock())
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def build() -> nn.Module:
    return BatchNormCNN()


def example_batch(batch_size: int):
    x = torch.randn(batch_size, CHANNELS, SIZE, SIZE)
    return (x,), (x.sum(dim=(1, 2, 3)) * 3).long().remainder(CLASSES)
