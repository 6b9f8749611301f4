"""Models that draw random numbers other than dropout: stochastic depth and a ``torch.rand`` token mask.

``build_drop_path``: a stack of pre-norm residual blocks, each branch dropped per sample with
stochastic depth as timm writes it (``x.new_empty(shape).bernoulli_(keep)``, divided by keep), its
rate rising linearly to ``DROP_PATH_RATE`` = 0.1 over the depth (Swin's and ConvNeXt's default
schedule). ``build_rand_mask``: token embeddings, a random 15 % of the tokens replaced by a learned mask
vector (``torch.rand(...) < 0.15``, as masked-token pre-training does) and Gaussian noise added
(``torch.randn_like``), then the same blocks. No dropout module anywhere: every random op is one that
a rate attribute named "dropout" would not reveal.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, HIDDEN, N_BLOCKS, VOCAB, SEQ = 32, 64, 4, 48, 8
DROP_PATH_RATE = 0.1
MASK_RATE, NOISE_STD = 0.15, 0.1


def drop_path(x: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
    """timm's stochastic depth: each sample's branch kept with probability 1 - rate, scaled by 1 / (1 - rate)."""
    if rate == 0.0 or not training:
        return x
    keep = 1.0 - rate
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
    return x * mask.div_(keep)


class Block(nn.Module):
    def __init__(self, rate: float):
        super().__init__()
        self.rate = rate
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + drop_path(self.fc2(F.gelu(self.fc1(self.norm(x)))), self.rate, self.training)


class DropPathNet(nn.Module):
    """Token ids -> embeddings -> blocks with stochastic depth -> vocabulary logits."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(*(Block(DROP_PATH_RATE * i / (N_BLOCKS - 1)) for i in range(N_BLOCKS)))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


class RandMaskNet(nn.Module):
    """Token ids -> embeddings, 15 % of them replaced by a mask vector, noise added -> blocks -> vocabulary logits."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mask_vector = nn.Parameter(torch.zeros(DIM))
        self.blocks = nn.Sequential(*(Block(0.0) for _ in range(N_BLOCKS)))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.training:
            masked = torch.rand(ids.shape, device=ids.device) < MASK_RATE
            h = torch.where(masked.unsqueeze(-1), self.mask_vector.expand_as(h), h)
            h = h + NOISE_STD * torch.randn_like(h)
        return self.head(self.blocks(h))


def build_drop_path() -> nn.Module:
    return DropPathNet()


def build_rand_mask() -> nn.Module:
    return RandMaskNet()


def example_batch(batch_size: int):
    """Token ids, and as targets each sequence rotated by one."""
    ids = torch.randint(0, VOCAB, (batch_size, SEQ))
    return (ids,), torch.roll(ids, 1, dims=1)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.flatten(0, 1), targets.flatten())
