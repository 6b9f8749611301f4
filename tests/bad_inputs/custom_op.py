"""Unsupported op: a custom operator with no fake (meta) kernel, so it cannot run on meta tensors."""
import torch
import torch.nn as nn


@torch.library.custom_op("autoshard_bad_inputs::scale", mutates_args=())
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0  # no register_fake: shapes on meta tensors are unknown


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return scale(self.a(x))


def build():
    return Custom()


def example_batch(batch_size):
    return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)
