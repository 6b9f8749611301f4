"""A tiny Hugging Face ``T5ForConditionalGeneration``: 2 encoder and 2 decoder layers, d_model 64.

Model-file contract (docs/design.md): ``build()`` (dropout 0, so parallel runs match one process),
``build_with_dropout()`` (T5's default 0.1, for runs that must only not crash),
``example_batch(batch_size)`` and ``loss_fn``. Values read by several blocks: the relative
position bias made by each stack's first block, the extended attention masks, and the
encoder's output (read by every decoder block's cross-attention). The task: the decoder
continues examples/gpt.py's progressions given their first half to the encoder.

Config flags: ``use_cache=False``, ``tie_word_embeddings=False``; no download. The encoder's and
decoder's embeddings and the head are still one weight (``shared``): a tie across stages.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import T5Config, T5ForConditionalGeneration

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import gpt  # noqa: E402  (examples/gpt.py: the synthetic data)

SEQ_LEN = 16  # encoder and decoder each
VOCAB_SIZE = 256


def config(dropout: float = 0.0, layers: int = 2) -> T5Config:
    return T5Config(
        vocab_size=VOCAB_SIZE, d_model=64, d_kv=16, d_ff=128, num_layers=layers, num_decoder_layers=layers,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
        dropout_rate=dropout, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        use_cache=False, tie_word_embeddings=False,
    )


def build() -> T5ForConditionalGeneration:
    return T5ForConditionalGeneration(config())


def build_with_dropout() -> T5ForConditionalGeneration:
    return T5ForConditionalGeneration(config(dropout=0.1))


def example_batch(batch_size: int):
    """``((encoder ids, encoder mask, decoder ids), next decoder tokens)``, each (batch, 16).

    The encoder's input is padded after a random length (mask 0 there); the decoder sees all.
    """
    (tokens,), targets = gpt.example_batch(batch_size, seq_len=2 * SEQ_LEN, vocab_size=VOCAB_SIZE)
    lengths = torch.randint(SEQ_LEN // 2, SEQ_LEN + 1, (batch_size, 1))
    mask = (torch.arange(SEQ_LEN) < lengths).long()
    return (tokens[:, :SEQ_LEN], mask, tokens[:, SEQ_LEN:]), targets[:, SEQ_LEN:]


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    logits = outputs.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
