"""A two-tower contrastive model: its loss couples the samples of a batch.

An image tower (float "pixels" through an MLP) and a text tower (token embeddings, mean-pooled, an MLP)
map each pair to unit vectors; the loss is CLIP's: cross-entropy over the B x B similarities of the
batch, both ways, at a fixed temperature. Each sample's loss depends on every other sample of the
batch, so the loss of a batch is not the mean of its halves' losses: data parallelism or micro-batching
would train another model. ``build_summed``: one tower whose per-sample loss is summed over the batch
instead of averaged (dp ranks would each add theirs).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

PIXELS, VOCAB, SEQ, DIM, N_BLOCKS = 24, 40, 6, 32, 2
TEMPERATURE = 0.07


class Tower(nn.Module):
    def __init__(self, dim_in: int):
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(dim_in if i == 0 else DIM, DIM), nn.GELU())
                                      for i in range(N_BLOCKS)))
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.proj(self.blocks(x)), dim=-1)


class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.image = Tower(PIXELS)
        self.text = Tower(DIM)

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor):
        return self.image(pixels), self.text(self.embed(ids).mean(1))


class Summed(nn.Module):
    """One tower regressing its targets; ``summed_loss`` adds the samples' losses."""

    def __init__(self):
        super().__init__()
        self.image = Tower(PIXELS)

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor):
        return self.image(pixels)


def build() -> nn.Module:
    return TwoTower()


def build_summed() -> nn.Module:
    return Summed()


def example_batch(batch_size: int):
    pixels = torch.randn(batch_size, PIXELS)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ))
    return (pixels, ids), torch.randn(batch_size, DIM)


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    if torch.is_tensor(outputs):  # the summed model: squared error added over the batch
        return (outputs - targets).square().sum()
    image, text = outputs
    logits = image @ text.T / TEMPERATURE
    labels = torch.arange(len(logits), device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
