"""Bad input: the model file imports a package that is not installed."""
import torch.nn as nn

import autoshard_no_such_package  # noqa: F401


def build():
    return nn.Linear(4, 4)
