"""Enormous dimensions: one 2**20 x 2**20 layer, 4 TiB of fp32 weights; no cluster here holds it."""
import torch
import torch.nn as nn


def build():
    return nn.Linear(2**20, 2**20, bias=False)


def example_batch(batch_size):
    return (torch.randn(batch_size, 2**20, device="meta"),), torch.randn(batch_size, 2**20, device="meta")
