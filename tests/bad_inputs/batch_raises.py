"""Bad input: example_batch itself fails."""
import torch.nn as nn


def build():
    return nn.Linear(4, 4)


def example_batch(batch_size):
    raise FileNotFoundError("data/train.bin")
