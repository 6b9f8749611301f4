"""Enormous dimension: one weight of 2**62 elements (more bytes than a 64-bit size can count)."""
import torch
import torch.nn as nn


def build():
    return nn.Linear(2**31, 2**31)


def example_batch(batch_size):
    return (torch.randn(batch_size, 2**31, device="meta"),), torch.randn(batch_size, 2**31, device="meta")
