"""A tiny Hugging Face Whisper encoder under a linear head: 2 layers, width 32, 2 heads, 16 positions.

Model-file contract (docs/design.md): ``build()``, ``example_batch(batch_size)`` (log-mel features (batch, 8, 32) and a
class per position) and ``loss_fn``. Whisper's encoder looks its positions up as
``self.embed_positions(torch.arange(self.embed_positions.num_embeddings))``, so the TP proof meets a read of
a sharded module's attribute. No download: the config is written here.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import WhisperConfig
from transformers.models.whisper.modeling_whisper import WhisperEncoder

MELS, POSITIONS, WIDTH, CLASSES = 8, 16, 32, 10


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = WhisperEncoder(WhisperConfig(
            d_model=WIDTH, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=MELS,
            max_source_positions=POSITIONS, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
            attn_implementation="sdpa"))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(features).last_hidden_state)


def build() -> Tagger:
    return Tagger()


def example_batch(batch_size: int):
    """``((features (batch, 8, 32),), a class per position (batch, 16))`` (the convolutions halve the frames)."""
    return (torch.randn(batch_size, MELS, 2 * POSITIONS),), torch.randint(0, CLASSES, (batch_size, POSITIONS))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, CLASSES), targets.reshape(-1))
