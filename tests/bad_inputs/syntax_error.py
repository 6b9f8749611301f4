"""Bad input: the model file is not valid Python."""
import torch.nn as nn


def build(:
    return nn.Linear(4, 4)
