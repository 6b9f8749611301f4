"""transformers models built twice, with attention written out (``attn_implementation="eager"``: ``q @ kᵀ``,
the mask added, softmax, dropout, ``@ v``, GQA's ``repeat_kv``) and with SDPA, at their default settings
otherwise; tensor parallelism must shard heads the same way in both (``tests/test_tp_attention_forms.py``).

    llama_eager / llama_sdpa        LlamaForCausalLM      GQA, rotary
    qwen3_eager / qwen3_sdpa        Qwen3ForCausalLM      GQA, per-head q_norm / k_norm over head_dim
    mistral_eager / mistral_sdpa    MistralForCausalLM    GQA, sliding window (window 16 of 32 tokens)
    gemma3_eager / gemma3_sdpa      Gemma3ForCausalLM     sliding-window and global layers, q/k norms,
                                                          attention softcapping off (its default)
    mpt_eager                       MptForCausalLM        ALiBi, fused Wqkv ``chunk``ed into q, k, v (no SDPA
                                                          form in transformers: ``mpt_sdpa`` cannot be built)
    modernbert_eager / _sdpa        ModernBertForMaskedLM an encoder: fused Wqkv, global and local layers

Sizes as ``hf_causal_zoo``'s (2 layers, width 64, 4 heads, 2 key/value heads, vocabulary 256); no download.
"""

from __future__ import annotations

import transformers as tf

from hf_causal_zoo import SIZES, example_batch, loss_fn  # noqa: F401  (the model-file contract)


def _llama(attn: str):
    return tf.LlamaForCausalLM(tf.LlamaConfig(**SIZES, num_key_value_heads=2, attn_implementation=attn))


def _qwen3(attn: str):
    return tf.Qwen3ForCausalLM(tf.Qwen3Config(**SIZES, num_key_value_heads=2, head_dim=16, attn_implementation=attn))


def _mistral(attn: str):
    return tf.MistralForCausalLM(
        tf.MistralConfig(**SIZES, num_key_value_heads=2, sliding_window=16, attn_implementation=attn)
    )


def _gemma3(attn: str):
    config = tf.Gemma3TextConfig(
        **SIZES, num_key_value_heads=2, head_dim=16, sliding_window=16, attn_implementation=attn
    )
    return tf.Gemma3ForCausalLM(config)


def _mpt(attn: str):
    """MPT: ALiBi biases (a per-head slope times the key position) added to the scores; no position table."""
    config = tf.MptConfig(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64, vocab_size=256,
                          use_cache=False, attn_implementation=attn)
    return tf.MptForCausalLM(config)


def _modernbert(attn: str):
    """ModernBERT: an encoder, fused Wqkv, global and sliding-window (local) layers, rotary."""
    config = tf.ModernBertConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=64, local_attention=16,
                                 pad_token_id=0, attn_implementation=attn)
    return tf.ModernBertForMaskedLM(config)


FAMILIES = {"llama": _llama, "qwen3": _qwen3, "mistral": _mistral, "gemma3": _gemma3, "mpt": _mpt, "modernbert": _modernbert}


def _factories():
    for name, make in FAMILIES.items():
        for attn in ("eager", "sdpa"):
            yield f"{name}_{attn}", (lambda make=make, attn=attn: make(attn))


for _name, _factory in _factories():
    _factory.__name__ = _name
    globals()[_name] = _factory
