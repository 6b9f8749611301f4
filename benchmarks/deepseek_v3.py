"""DeepSeek-V3 (671B total, 37B activated per token) as Hugging Face's ``DeepseekV3ForCausalLM``.

The shape is DeepSeek-V3's ``config.json`` (https://huggingface.co/deepseek-ai/DeepSeek-V3,
``config.json``; DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv 2412.19437, §2 and §4.2)::

    layers 61 (the first 3 dense: FFN 18432; the other 58 MoE), hidden 7168, vocab 129280
    MoE     256 routed experts, top-8, + 1 shared expert, expert FFN 2048; sigmoid router scores
            with a bias (aux-loss-free balancing), group-limited: 8 groups, tokens pick from 4
    MLA     128 heads; q: 7168 → 1536 (q_lora_rank) → 128·(128 nope + 64 rope);
            kv: 7168 → 512 (kv_lora_rank) + 64 rope → 128·(128 nope k + 128 v); o: 128·128 → 7168
    rope    θ = 10000 with YaRN ×40 from 4096 positions (163840); rms_norm eps 1e-6; untied head

Not built: the multi-token-prediction module (``num_nextn_predict_layers`` = 1, 14B more in the
published checkpoint, its 685B), which transformers' class does not have. Sequence 4096: the
pre-training length (report §4.2).

Parameters (``parameter_counts``, ``python benchmarks/deepseek_v3.py`` prints them; on meta)::

    total      Σ numel of every parameter                                   ≈ 671B
    activated  total − (E − k)/E · routed-expert parameters                  ≈ 37B
               (a token meets k = 8 of the E = 256 routed experts of each MoE layer; the
               shared expert, attention, dense layers, router, embedding and head always)

Factories (``path:factory`` model specs)::

    build        the full model (plan it on meta: ``with torch.device("meta")``)
    build_tiny   4 layers (layer 0 dense, 1-3 MoE), hidden 64, 8 experts top-2 in 4 groups
                 choosing 2, 1 shared expert, MLA with q_lora_rank 32, kv_lora_rank 16, heads 4
                 of 16 nope + 8 rope (v 16), vocab 256, sequence 32: trains on a CPU

``example_batch(batch_size, seq_len=None)`` gives examples/gpt.py's synthetic token ids in the
vocabulary and at the sequence length of the factory built last (the full model's before any:
benchmarks/llama3.py's convention), ``seq_len`` overriding the length; the loss is the model file's
default (cross-entropy on ``outputs.logits``), so loss parallelism may run on it. Config flags: ``use_cache=False``, ``attn_implementation=
"sdpa"``; transformers' default experts implementation (grouped matmuls). No download.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

_EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import gpt  # noqa: E402  (examples/gpt.py: the synthetic data)

SEQ_LEN = 4096  # pre-training sequence length (report §4.2)
VOCAB_SIZE = 129280
TINY_SEQ_LEN, TINY_VOCAB_SIZE = 32, 256

# DeepSeek-V3's config.json, the fields that set the shape (module doc)
DEEPSEEK_V3 = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    first_k_dense_replace=3,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rms_norm_eps=1e-6,
    max_position_embeddings=163840,
    tie_word_embeddings=False,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)
# The same architecture at DeepSeek-V2-Lite's size (deepseek-ai/DeepSeek-V2-Lite config.json: 27 layers, the
# first dense, hidden 2048, 64 routed experts of FFN 1408 top-6, 2 shared, 16 heads, kv_lora_rank 512, no
# q_lora): ~16B parameters, ~2.7B active. A model whose expert state fits at small ep (bench_moe.py).
DEEPSEEK_16B = dict(
    DEEPSEEK_V3,
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    first_k_dense_replace=1,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=False,
    q_lora_rank=None,
)
TINY = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
_shape = {"seq_len": SEQ_LEN, "vocab_size": VOCAB_SIZE}  # of the factory built last (module doc)


def config(**fields) -> DeepseekV3Config:
    return DeepseekV3Config(**fields, use_cache=False, attn_implementation="sdpa")


def _build(fields: dict, seq_len: int) -> DeepseekV3ForCausalLM:
    _shape.update(seq_len=seq_len, vocab_size=fields["vocab_size"])
    return DeepseekV3ForCausalLM(config(**fields))


def build() -> DeepseekV3ForCausalLM:
    """DeepSeek-V3 at its published shape: 671B parameters (build it on the meta device)."""
    return _build(DEEPSEEK_V3, SEQ_LEN)


def build_16b() -> DeepseekV3ForCausalLM:
    """DeepSeek-V3's architecture at DeepSeek-V2-Lite's size (``DEEPSEEK_16B``); on the meta device."""
    return _build(DEEPSEEK_16B, SEQ_LEN)


def build_tiny() -> DeepseekV3ForCausalLM:
    """The same architecture in 4 small layers (module doc), for CPU tests."""
    return _build(TINY, TINY_SEQ_LEN)


def build_tiny_deep() -> DeepseekV3ForCausalLM:
    """7 small layers, the first 2 dense: a stack that opens with distinct layers (``passes.capturing.fold``)."""
    return _build(dict(TINY, num_hidden_layers=7, first_k_dense_replace=2), TINY_SEQ_LEN)


def example_batch(batch_size: int, seq_len: int | None = None):
    """``((token ids (batch, seq),), next tokens)`` of the factory built last (module doc)."""
    return gpt.example_batch(batch_size, seq_len=seq_len or _shape["seq_len"], vocab_size=_shape["vocab_size"])


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(total, activated per token): activated = total − (E − k)/E · routed-expert parameters."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    idle = routed * (cfg.n_routed_experts - cfg.num_experts_per_tok) // cfg.n_routed_experts
    return total, total - idle


def main() -> None:
    import time

    for name, factory in (("DeepSeek-V3", build), ("tiny", build_tiny)):
        start = time.perf_counter()
        with torch.device("meta"):
            model = factory()
        built_s = time.perf_counter() - start
        total, activated = parameter_counts(model)
        print(
            f"{name}: {_count(total)} parameters, {_count(activated)} activated per token "
            f"(built on meta in {built_s:.1f} s)"
        )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


if __name__ == "__main__":
    main()
