"""Small transformers vision models at their default settings, one factory each.

Every config keeps the library's defaults (drop-path rates, norms, activations) except the sizes (16 x 16
images, 2 stages, width 32). No download: the configs are written here.

    build_swin      SwinForImageClassification    shifted windows (torch.roll, an attention mask per
                                                  window), stochastic depth at its default
                                                  drop_path_rate 0.1 (timm's drop_path: torch.rand)
    build_resnet    ResNetForImageClassification  a CNN: convolutions, BatchNorm, residual stages

Model-file contract (docs/design.md): ``example_batch`` gives hf_vit.py's images (4 classes, each a fixed random
image seen through noise), ``loss_fn`` cross-entropy on ``outputs.logits``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers as tf

IMAGE_SIZE, CLASSES = 16, 4


def build_swin():
    return tf.SwinForImageClassification(tf.SwinConfig(
        image_size=IMAGE_SIZE, patch_size=2, embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4,
        num_labels=CLASSES))


def build_resnet():
    return tf.ResNetForImageClassification(tf.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[2, 2], layer_type="basic", num_labels=CLASSES))


def example_batch(batch_size: int):
    """``((pixel values (batch, 3, 16, 16),), class ids (batch,))``."""
    prototypes = torch.randn(CLASSES, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, CLASSES, (batch_size,))
    pixels = prototypes[labels] + 0.5 * torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE)
    return (pixels,), labels


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.logits, targets)
