"""A tiny Hugging Face ``BertForMaskedLM`` fed padded batches: 2 layers, hidden 64, 4 heads, vocab 256.

Model-file contract (docs/design.md): ``build()`` (dropout 0, so parallel runs match one process),
``build_with_dropout()`` (BERT's default 0.1, for runs that must only not crash),
``example_batch(batch_size)`` and ``loss_fn``. The inputs are ``(input_ids, attention_mask)``
with rows padded after 32, 28, 24 or 20 tokens, so BERT expands the mask into a 4-D attention mask
in its embedding prefix, a non-contiguous tensor read by every layer. The targets are
examples/gpt.py's next tokens, -100 on padding (ignored by the loss).

Config flags: ``attn_implementation="sdpa"``; no download: the config is written here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import gpt  # noqa: E402  (examples/gpt.py: the synthetic data)

SEQ_LEN = 32
VOCAB_SIZE = 256
IGNORE = -100


def config(dropout: float = 0.0, layers: int = 2) -> BertConfig:
    return BertConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout, attn_implementation="sdpa",
    )


def build() -> BertForMaskedLM:
    return BertForMaskedLM(config())


def build_with_dropout() -> BertForMaskedLM:
    return BertForMaskedLM(config(dropout=0.1))


def padding_mask(batch_size: int, seq_len: int) -> torch.Tensor:
    """1 on row i's first seq_len − 4·(i mod 4) tokens, 0 after: every 4 rows hold the same padding,
    so losses of batches (and micro-batches) of 4k rows compare step to step."""
    lengths = seq_len - 4 * (torch.arange(batch_size) % 4)
    return (torch.arange(seq_len) < lengths[:, None]).long()


def example_batch(batch_size: int):
    """``((token ids (batch, 32), attention mask (batch, 32)), next tokens with -100 on padding)``."""
    (tokens,), targets = gpt.example_batch(batch_size, seq_len=SEQ_LEN, vocab_size=VOCAB_SIZE)
    mask = padding_mask(batch_size, SEQ_LEN)
    return (tokens, mask), targets.masked_fill(mask == 0, IGNORE)


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over real tokens, divided by all token slots (padding counts 0).

    So a batch's loss is the mean of its equal micro-batches' losses; the mean over real tokens
    only (``ignore_index`` with ``reduction="mean"``) would weigh each micro-batch by its padding.
    """
    logits = outputs.logits
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE,
                            reduction="sum")
    return total / targets.numel()
