"""Tensor parallelism shards attention heads however attention is written: ``q @ kᵀ``, masks, softmax,
dropout and ``@ v`` written out (transformers' "eager", Megatron-LM's 2021 ``CoreAttention``) get the layout
``F.scaled_dot_product_attention`` gets; where heads stay whole the plan names the op that kept them whole.
(The numerics of an eager model at tp 2: ``tests/e2e/test_tensor_parallel.py``, case ``llama-eager-tp2``.)"""

from functools import cache
from types import SimpleNamespace

import pytest
from rich.console import Console

from autoshard.ir.topology import DeviceSpec, LinkSpec
from autoshard.passes.layouts.styles import choose_tp_styles
from autoshard.pipeline import capture_graph
from autoshard.show import tensor_parallel_table

# A compute-bound regime (slow device, fast link): sharding pays, as for large models on NVLink.
SLOW_DEVICE = DeviceSpec("slow-test-device", 0.05, 2**34, 20.0, 1.0, "test")
FAST_LINK = LinkSpec(100.0, 0.0, "test")
FORMS = "tests/models/hf_attention_forms.py"


@cache
def graph(spec: str):
    """The captured graph (Megatron's GPT at 128 tokens, not its 2048: the same layout, a smaller capture)."""
    return capture_graph(spec, seq_len=128 if spec.startswith("benchmarks/megatron_gpt.py") else None)[1]


@cache
def choice(spec: str, tp: int = 2, sp: bool = True):
    return choose_tp_styles(graph(spec), tp, FAST_LINK, SLOW_DEVICE, sequence_parallel=sp)


def attention_styles(styles: dict) -> dict:
    return {m: s for m, s in styles.items() if ".attn." in m or "self_attn" in m}


@pytest.mark.parametrize("sp", [False, True])
def test_megatron_attention_written_out_is_sharded_by_heads_as_sdpa_is(in_repo, sp):
    """Megatron-LM's GPT with ``q @ kᵀ``, ``masked_fill``, softmax, dropout, ``@ v``: qkv colwise and the
    output projection rowwise at tp 2, exactly the styles of the same model with SDPA."""
    written = choice("benchmarks/megatron_gpt.py:build_written", sp=sp)
    sdpa = choice("benchmarks/megatron_gpt.py:build", sp=sp)
    assert written.styles == sdpa.styles
    assert written.sequence_parallel == sdpa.sequence_parallel == sp
    for i in range(2):
        assert written.styles[f"h.{i}.attn.qkv"] == "colwise"
        assert written.styles[f"h.{i}.attn.c_proj"].startswith("rowwise")
    assert not any("gathered whole" in r for r in written.reasons.values())


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_eager_attention_gets_the_sdpa_layout(in_repo, family):
    """transformers' eager attention (GQA's ``repeat_kv``, the additive causal or sliding-window mask, q/k
    norms) gives every module the style SDPA gives it, sequence parallelism included."""
    eager, sdpa = choice(f"{FORMS}:{family}_eager"), choice(f"{FORMS}:{family}_sdpa")
    assert eager.styles == sdpa.styles and eager.sequence_parallel and sdpa.sequence_parallel
    for i in range(2):
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert eager.styles[f"model.layers.{i}.self_attn.{proj}"] == "colwise"
        assert eager.styles[f"model.layers.{i}.self_attn.o_proj"].startswith("rowwise")


def test_sliding_window_layers_with_qk_norms_shard_heads(in_repo):
    """Gemma-3: sliding-window and global layers, per-head q/k norms, attention written out."""
    styles = choice(f"{FORMS}:gemma3_eager", sp=False).styles
    for i in range(2):
        assert {p: styles[f"model.layers.{i}.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj", "o_proj")} == {
            "q_proj": "colwise",
            "k_proj": "colwise",
            "v_proj": "colwise",
            "o_proj": "rowwise",
        }
        assert styles[f"model.layers.{i}.self_attn.q_norm"] == "sharded-input-dim1"  # (b, heads, s, hd)


def test_heads_kept_whole_name_the_op_that_kept_them(in_repo):
    """MPT computes q, k and v in one linear and ``chunk``s its output into [q | k | v]: a column shard
    would hold a block of those columns, not each one's heads, so the heads stay whole and both attention
    projections gather; the reason names ``chunk`` and its module (the first block's: the layout is solved
    once per repeated block), and ``inspect`` shows it."""
    mpt = choice(f"{FORMS}:mpt_eager", sp=False)
    for i in range(2):
        for proj in ("Wqkv", "out_proj"):
            module = f"transformer.blocks.{i}.attn.{proj}"
            assert mpt.styles[module] == "colwise-gather"
            assert mpt.reasons[module].startswith("its output is gathered whole: `chunk` in transformer.blocks.0.attn")
        assert mpt.styles[f"transformer.blocks.{i}.ffn.down_proj"] == "rowwise"
        assert f"transformer.blocks.{i}.ffn.up_proj" not in mpt.reasons

    shown = tensor_parallel_table(
        SimpleNamespace(mesh=SimpleNamespace(tp=2), tensor_parallel=mpt.sharded, tensor_parallel_reasons=mpt.reasons),
        every_module=True,
    )
    console = Console(width=400, record=True)
    console.print(shown)
    rows = [line for line in console.export_text().splitlines() if "attn.Wqkv" in line]
    assert len(rows) == 2 and all("colwise-gather" in r and "`chunk` in" in r for r in rows)


def test_a_per_head_bias_computed_whole_is_named_as_what_keeps_heads_whole(in_repo):
    """T5 adds a relative-position bias, made once for all heads outside the projections, to every attention's
    scores (its cross-attention's too): heads stay whole, and the reason says the bias spans them."""
    t5 = choice("tests/models/hf_t5.py:build_with_dropout", sp=False)
    for attention in ("encoder.block.0.layer.0.SelfAttention", "decoder.block.0.layer.1.EncDecAttention"):
        assert t5.styles[f"{attention}.q"] == "colwise-gather"
        assert "its mask or bias ((2, 4, 16, 16)) spans the heads" in t5.reasons[f"{attention}.q"]
