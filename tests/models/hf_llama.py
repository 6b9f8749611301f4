"""A tiny Hugging Face ``LlamaForCausalLM`` (GQA: 4 query heads, 2 key/value heads).

Model-file contract (docs/design.md): ``build()`` (works under ``torch.device("meta")``; its
weights depend only on torch's seed), ``example_batch(batch_size)`` with examples/gpt.py's
synthetic arithmetic-progression tokens, and ``loss_fn`` on ``outputs.logits``.

Config flags: ``use_cache=False`` (no KV cache object in the exported graph) and
``attn_implementation="sdpa"`` (one ``aten.scaled_dot_product_attention`` per layer);
``tie_word_embeddings=False`` keeps the head a separate weight. No download: the config is
written here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import gpt  # noqa: E402  (examples/gpt.py: the synthetic data)

SEQ_LEN = 32
VOCAB_SIZE = 256


def config(layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa",
    )


def build() -> LlamaForCausalLM:
    return LlamaForCausalLM(config())


def build_4_layers() -> LlamaForCausalLM:
    """Enough blocks for interleaved pipelines: 2 ranks x 2 stages each."""
    return LlamaForCausalLM(config(layers=4))


def build_8_layers() -> LlamaForCausalLM:
    """Enough blocks for 4 ranks x 2 stages each (a V over pp = 4)."""
    return LlamaForCausalLM(config(layers=8))


def example_batch(batch_size: int):
    """``((token ids (batch, 32),), next tokens)``."""
    return gpt.example_batch(batch_size, seq_len=SEQ_LEN, vocab_size=VOCAB_SIZE)


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    logits = outputs.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
