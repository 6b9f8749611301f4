"""Mixtral 8x7B's shape, for ``benchmarks/bench_moe.py``: planned on the meta device, never trained here.

transformers' ``MixtralForCausalLM`` at the published configuration (mistralai/Mixtral-8x7B-v0.1
``config.json``): 32 layers, hidden 4096, 32 heads, 8 KV heads, 8 experts of FFN 14336, top-2,
vocab 32000; 46.7B parameters, 12.9B active per token. Sequence 4096 (its training context). The loss is
the model file's default (cross-entropy on ``outputs.logits``, in fp32 under autocast), so loss parallelism may
run on it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import MixtralConfig, MixtralForCausalLM

_EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import gpt  # noqa: E402  (examples/gpt.py: the synthetic tokens)

SEQ_LEN, VOCAB_SIZE = 4096, 32000


def build(layers: int = 32) -> MixtralForCausalLM:
    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=layers,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=32768,
            rope_theta=1e6,
            use_cache=False,
            attn_implementation="sdpa",
        )
    )


def build_2l() -> MixtralForCausalLM:
    """The same shape at 2 layers (benchmarks/bench_dryrun.py: per-layer figures at a depth a CPU dry run
    finishes quickly)."""
    return build(layers=2)


def example_batch(batch_size: int, seq_len: int = SEQ_LEN):
    return gpt.example_batch(batch_size, seq_len=seq_len, vocab_size=VOCAB_SIZE)
