"""tests/models/tiny_attention.py with padded targets and a loss that is a mean over real tokens only
(``ignore_index``): a batch's loss is then not the mean of its equal shares' losses, so data
parallelism changes it. For verify's diagnosis of that."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_attention  # noqa: E402

build = tiny_attention.build
IGNORE = -100


def example_batch(batch_size: int):
    (tokens,), targets = tiny_attention.example_batch(batch_size)
    real = torch.arange(tiny_attention.SEQ) < torch.randint(2, tiny_attention.SEQ, (batch_size, 1))
    return (tokens,), targets.masked_fill(~real, IGNORE)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, tiny_attention.VOCAB), targets.reshape(-1), ignore_index=IGNORE)
