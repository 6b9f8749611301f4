"""A tiny Hugging Face ``OPTForCausalLM`` fed padded batches: 2 layers, hidden 64, 4 heads, vocab 256.

Model-file contract (docs/design.md): ``build()`` (dropout 0, so parallel runs match one process),
``build_with_dropout()`` (OPT's default 0.1, for runs that must only not crash),
``example_batch(batch_size)`` and ``loss_fn``. The inputs are ``(input_ids, attention_mask)``
with rows padded after 32, 28, 24 or 20 tokens: OPT builds a 4-D causal mask (expanded, not
contiguous) and positions from the mask's cumulative sum before the first layer. The targets
are examples/gpt.py's next tokens, -100 on padding.

Config flags: ``use_cache=False``, ``attn_implementation="sdpa"``, ids inside the vocabulary.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import OPTConfig, OPTForCausalLM

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import hf_bert  # noqa: E402  (the padded synthetic batches)

SEQ_LEN = hf_bert.SEQ_LEN
VOCAB_SIZE = hf_bert.VOCAB_SIZE


def config(dropout: float = 0.0, layers: int = 2) -> OPTConfig:
    return OPTConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=layers, ffn_dim=128, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=64, dropout=dropout, attention_dropout=dropout,
        pad_token_id=1, bos_token_id=2, eos_token_id=2, use_cache=False, attn_implementation="sdpa",
    )


def build() -> OPTForCausalLM:
    return OPTForCausalLM(config())


def build_with_dropout() -> OPTForCausalLM:
    return OPTForCausalLM(config(dropout=0.1))


def example_batch(batch_size: int):
    """``((token ids (batch, 32), attention mask (batch, 32)), next tokens with -100 on padding)``."""
    return hf_bert.example_batch(batch_size)


loss_fn = hf_bert.loss_fn
