"""A tiny Hugging Face ``OlmoeForCausalLM``: 2 layers, hidden 64, 4 experts top-2, QK-norm.

Model-file contract (docs/design.md): ``build()`` (works under ``torch.device("meta")``),
``example_batch(batch_size)`` with examples/gpt.py's synthetic tokens, ``loss_fn`` on
``outputs.logits``. The experts use transformers' default experts implementation
(``grouped_mm`` where torch has it).

Config flags: ``use_cache=False``, ``attn_implementation="sdpa"``; no download.
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import OlmoeConfig, OlmoeForCausalLM

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import hf_mixtral  # noqa: E402  (the same tokens and loss)

SEQ_LEN = hf_mixtral.SEQ_LEN
VOCAB_SIZE = hf_mixtral.VOCAB_SIZE


def config(layers: int = 2) -> OlmoeConfig:
    return OlmoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, num_experts=4,
        num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False,
        attn_implementation="sdpa",
    )


def build() -> OlmoeForCausalLM:
    return OlmoeForCausalLM(config())


example_batch = hf_mixtral.example_batch
loss_fn = hf_mixtral.loss_fn
