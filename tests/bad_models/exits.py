"""A factory that ends its process (``os._exit``) while the model is built: a fresh ``autoshard plan``
captures in a child (``passes.capturing.front``) and must say so in one line instead of vanishing."""

import os

import torch


def build():
    os._exit(3)


def example_batch(batch_size: int):
    return (torch.zeros(batch_size, 4),), torch.zeros(batch_size, 4)
