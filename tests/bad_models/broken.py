import torch.nn as nn


def raises():
    raise RuntimeError("boom in the factory")


def not_a_module():
    return 42


def no_batch_model():
    return nn.Linear(4, 4)
