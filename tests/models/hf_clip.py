"""A small transformers ``CLIPModel``: a two-tower contrastive model at its default settings.

A text tower (2 layers, width 32) and a vision tower (16 x 16 images in 4 x 4 patches, 2 layers, width 32)
projected to 16 dimensions, with CLIP's learned temperature ``logit_scale``, a 0-d parameter. The loss is
CLIP's: cross-entropy over the B x B image-text similarities of the batch, both ways, so it couples the
samples of a batch. ``forward(input_ids, pixel_values)`` declares the text first; CLIPModel runs its
vision tower first. No download: the config is written here.

Model-file contract (docs/design.md): ``example_batch`` gives pairs of captions and images, each pair drawn
from one of 4 classes (a fixed token pattern and a fixed image, seen through noise); ``loss_fn`` the
symmetric contrastive loss on ``logits_per_image``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers as tf

IMAGE_SIZE, CLASSES, SEQ_LEN, VOCAB_SIZE = 16, 4, 8, 64


class TwoTower(torch.nn.Module):
    """``CLIPModel`` called with its two inputs, returning its B x B similarities."""

    def __init__(self, width: int = 32, feed_forward: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        sizes = dict(
            hidden_size=width,
            intermediate_size=feed_forward,
            num_hidden_layers=layers,
            num_attention_heads=heads,
        )
        text = dict(
            vocab_size=VOCAB_SIZE,
            max_position_embeddings=SEQ_LEN,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            **sizes,
        )
        vision = dict(image_size=IMAGE_SIZE, patch_size=4, **sizes)
        self.clip = tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.clip(input_ids=input_ids, pixel_values=pixel_values).logits_per_image


def build():
    return TwoTower()


def example_batch(batch_size: int):
    """``((token ids (batch, 8), pixel values (batch, 3, 16, 16)), class ids (batch,))``."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(CLASSES, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
    captions = torch.randint(1, VOCAB_SIZE, (CLASSES, SEQ_LEN), generator=gen)
    labels = torch.randint(0, CLASSES, (batch_size,))
    pixels = images[labels] + 0.5 * torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE)
    ids = torch.where(
        torch.rand(batch_size, SEQ_LEN) < 0.2, torch.randint(1, VOCAB_SIZE, (batch_size, SEQ_LEN)), captions[labels]
    )
    return (ids, pixels), labels


def loss_fn(logits_per_image: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    pairs = torch.arange(len(logits_per_image), device=logits_per_image.device)
    return (F.cross_entropy(logits_per_image, pairs) + F.cross_entropy(logits_per_image.T, pairs)) / 2


def build_deep():
    """CLIP one size up from what the batch-coupling check runs whole: towers of 12 layers at width 1,024
    (302 M parameters, 1.2 GB in fp32, over ``batch_coupling.MAX_CHECK_BYTES``), the same loss."""
    return TwoTower(width=1024, feed_forward=4096, layers=12, heads=16)
