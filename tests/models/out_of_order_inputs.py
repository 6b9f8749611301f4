"""A two-tower model whose ``forward`` reads its inputs in another order than it declares them.

``forward(input_ids, pixel_values)`` runs the vision tower first (``pixel_values`` projected by a
Linear), then embeds ``input_ids``, adds the two and runs 4 residual blocks and a token
classifier (a CLIP-style model that starts with its image encoder). The traced graph meets
``pixel_values`` before ``input_ids``: a pipeline's first stage must still take them in the declared
order, which is the order the inputs are fed. The two inputs differ in dtype (int token ids, float
pixels), so a swap fails loudly. Model-file contract (docs/design.md): integer targets, so the default
loss is cross-entropy over the classes.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 32
PATCH = 12  # features per "pixel" patch
WIDTH = 16
CLASSES = 8
SEQ = 6
N_BLOCKS = 4


class Block(nn.Module):
    """h + W₂ · gelu(W₁ · layer_norm(h))."""

    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision = nn.Linear(PATCH, WIDTH)
        self.text = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        image = torch.tanh(self.vision(pixel_values))  # the second input, read first
        h = image + self.text(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build() -> TwoTower:
    return TwoTower()


def example_batch(batch_size: int):
    """``((input_ids (b, 6) int, pixel_values (b, 6, 12) float), labels (b, 6) int)``."""
    input_ids = torch.randint(0, VOCAB, (batch_size, SEQ))
    pixel_values = torch.randn(batch_size, SEQ, PATCH)
    labels = (input_ids + (pixel_values[..., 0] > 0).long()) % CLASSES
    return (input_ids, pixel_values), labels
