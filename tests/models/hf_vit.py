"""A tiny Hugging Face ``ViTForImageClassification``: 16×16 images, 4×4 patches, 2 layers, hidden 64.

Model-file contract (docs/design.md): ``build()`` (dropout 0, so parallel runs match one process),
``build_with_dropout()`` (dropout 0.1, for runs that must only not crash),
``example_batch(batch_size)`` and ``loss_fn``. The task: 4 classes, each a fixed random
image, seen through noise; the data depend only on torch's global seed.

Config flags: ``attn_implementation="sdpa"``; no download: the config is written here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import ViTConfig, ViTForImageClassification

IMAGE_SIZE = 16
CLASSES = 4


def config(dropout: float = 0.0, layers: int = 2) -> ViTConfig:
    return ViTConfig(
        image_size=IMAGE_SIZE, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=layers,
        num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout, num_labels=CLASSES, attn_implementation="sdpa",
    )


def build() -> ViTForImageClassification:
    return ViTForImageClassification(config())


def build_with_dropout() -> ViTForImageClassification:
    return ViTForImageClassification(config(dropout=0.1))


def example_batch(batch_size: int):
    """``((pixel values (batch, 3, 16, 16),), class ids (batch,))``."""
    prototypes = torch.randn(CLASSES, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, CLASSES, (batch_size,))
    pixels = prototypes[labels] + 0.5 * torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE)
    return (pixels,), labels


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.logits, targets)
