"""Small transformers causal LMs at their default settings, one factory each.

Every config keeps the library's defaults (dropout rates, tied embeddings, activations, norms,
rotary settings) except the sizes (2 layers, width 64, 4 heads and 2 key/value heads where the
architecture has GQA, feed-forward 128, vocabulary 256) and ``use_cache=False`` (no cache object in
the exported graph). No download: the configs are written here.

    build_mistral   MistralForCausalLM    GQA, sliding-window config, SiLU MLP
    build_qwen2     Qwen2ForCausalLM      GQA, biased q/k/v projections
    build_qwen3     Qwen3ForCausalLM      per-head q_norm / k_norm over head_dim
    build_phi3      Phi3ForCausalLM       fused qkv_proj and gate_up_proj (split after the linear)
    build_gemma     GemmaForCausalLM      tied embeddings, embedding scaled by √width, GeLU-tanh
    build_gpt_neox  GPTNeoXForCausalLM    fused query_key_value, parallel residual, partial rotary
    build_qwen2_moe Qwen2MoeForCausalLM   mixture of 4 experts (top-2) with a shared expert
    build_mamba     MambaForCausalLM      a state-space model: selective scan, causal conv, no attention
                                          (transformers' own scan: no CUDA kernels on the CPU)
    build_jamba     JambaForCausalLM      hybrid: Mamba layers and attention layers (every other one),
                                          mixture of 4 experts (top-2) every other layer; 4 layers

Model-file contract (docs/design.md): ``example_batch`` gives examples/gpt.py's synthetic tokens,
``loss_fn`` cross-entropy on ``outputs.logits``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers as tf

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import gpt  # noqa: E402  (examples/gpt.py: the synthetic data)

SEQ_LEN, VOCAB_SIZE = 32, 256
SIZES = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64, use_cache=False)


def build_mistral():
    return tf.MistralForCausalLM(tf.MistralConfig(**SIZES, num_key_value_heads=2))


def build_qwen2():
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(**SIZES, num_key_value_heads=2))


def build_qwen3():
    return tf.Qwen3ForCausalLM(tf.Qwen3Config(**SIZES, num_key_value_heads=2, head_dim=16))


def build_phi3():
    return tf.Phi3ForCausalLM(tf.Phi3Config(**SIZES, num_key_value_heads=2, pad_token_id=0))


def build_gemma():
    return tf.GemmaForCausalLM(tf.GemmaConfig(**SIZES, num_key_value_heads=2, head_dim=16))


def build_gpt_neox():
    return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**SIZES))


def build_qwen2_moe():
    return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**SIZES, num_key_value_heads=2, num_experts=4,
                                                    num_experts_per_tok=2, moe_intermediate_size=64,
                                                    shared_expert_intermediate_size=64))


def build_mamba():
    return tf.MambaForCausalLM(tf.MambaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2,
                                              state_size=8, use_cache=False))


def build_jamba():
    return tf.JambaForCausalLM(tf.JambaConfig(
        **{**SIZES, "num_hidden_layers": 4}, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8))


def example_batch(batch_size: int):
    """``((token ids (batch, 32),), next tokens)``."""
    return gpt.example_batch(batch_size, seq_len=SEQ_LEN, vocab_size=VOCAB_SIZE)


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    logits = outputs.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
