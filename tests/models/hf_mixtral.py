"""A tiny Hugging Face ``MixtralForCausalLM``: 2 layers, hidden 64, 4 experts, top-2 routing.

Model-file contract (docs/design.md): ``build()`` (works under ``torch.device("meta")``; its
weights depend only on torch's seed), ``example_batch(batch_size)`` with examples/gpt.py's
synthetic tokens, and ``loss_fn`` on ``outputs.logits``. The experts run with transformers'
default experts implementation (``grouped_mm`` where torch has it), routing each token to
2 of 4 experts: data-dependent shapes inside every layer.

Config flags: ``use_cache=False``, ``attn_implementation="sdpa"``, ids inside the vocabulary;
no download: the config is written here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import gpt  # noqa: E402  (examples/gpt.py: the synthetic data)

SEQ_LEN = 32
VOCAB_SIZE = 256


def config(layers: int = 2) -> MixtralConfig:
    return MixtralConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4,
        num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, use_cache=False, attn_implementation="sdpa",
    )


def build() -> MixtralForCausalLM:
    return MixtralForCausalLM(config())


def example_batch(batch_size: int):
    """``((token ids (batch, 32),), next tokens)``."""
    return gpt.example_batch(batch_size, seq_len=SEQ_LEN, vocab_size=VOCAB_SIZE)


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    logits = outputs.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
