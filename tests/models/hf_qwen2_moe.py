"""A tiny Hugging Face ``Qwen2MoeForCausalLM``: 2 layers, hidden 64, 4 experts top-2 plus a gated shared expert.

Model-file contract (docs/design.md): ``build()`` (works under ``torch.device("meta")``),
``example_batch(batch_size)`` with examples/gpt.py's synthetic tokens, ``loss_fn`` on
``outputs.logits``. The routed experts use transformers' default experts implementation
(``grouped_mm`` where torch has it); every token also goes through the shared expert.

Config flags: ``use_cache=False``, ``attn_implementation="sdpa"``; no download.
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import hf_mixtral  # noqa: E402  (the same tokens and loss)

SEQ_LEN = hf_mixtral.SEQ_LEN
VOCAB_SIZE = hf_mixtral.VOCAB_SIZE


def config(layers: int = 2) -> Qwen2MoeConfig:
    return Qwen2MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, bos_token_id=1,
        eos_token_id=2, use_cache=False, attn_implementation="sdpa",
    )


def build() -> Qwen2MoeForCausalLM:
    return Qwen2MoeForCausalLM(config())


example_batch = hf_mixtral.example_batch
loss_fn = hf_mixtral.loss_fn
