"""The TP style choice comes out of the layout optimisation on the op graph (no processes)."""

import pytest

from autoshard.errors import AutoshardError
from autoshard.ir.graph import OpGraph, OpNode, ParamInfo
from autoshard.ir.topology import DeviceSpec, LinkSpec
from autoshard.passes.capturing.annotate import annotate
from autoshard.passes.layouts.allowed import check_divisibility
from autoshard.passes.layouts.styles import choose_tp_styles
from autoshard.pipeline import capture_graph

# A compute-bound regime (slow device, fast link): sharding pays, as for large models on NVLink.
SLOW_DEVICE = DeviceSpec("slow-test-device", 0.05, 2**34, 20.0, 1.0, "test")
FAST_LINK = LinkSpec(100.0, 0.0, "test")
FAST_DEVICE = DeviceSpec("fast-test-device", 1000.0, 2**34, 3000.0, 1.0, "test")
SLOW_LINK = LinkSpec(0.001, 1000.0, "test")


@pytest.fixture(scope="module")
def gpt_graph():
    import os

    from tests.conftest import ROOT

    os.chdir(ROOT)
    return capture_graph("examples/gpt.py:build")[1]


@pytest.fixture(scope="module")
def llama_graph(gpt_graph):
    return capture_graph("tests/models/hf_llama.py:build")[1]


def test_gpt_megatron_pattern(gpt_graph):
    choice = choose_tp_styles(gpt_graph, 2, FAST_LINK, SLOW_DEVICE)
    for i in range(4):
        for m in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.c_fc"):
            assert choice.styles[f"h.{i}.{m}"] == "colwise"
        for m in ("attn.c_proj", "mlp.c_proj"):
            assert choice.styles[f"h.{i}.{m}"] == "rowwise"
        for m in ("ln_1", "ln_2"):
            assert choice.styles[f"h.{i}.{m}"] == "replicate" and "needs whole tensors" in choice.reasons[f"h.{i}.{m}"]
    assert choice.styles["ln_f"] == "replicate"
    assert len(choice.segments) == 2 and choice.segments[0].repeats == 4  # one solve for the 4 blocks
    block = choice.segments[0]
    # forward: 2 all-reduces of the (2, 64, 64) fp32 residual; backward: q, k, v, c_fc input grads
    assert block.comm_bytes == 6 * 2 * 64 * 64 * 4
    assert choice.comm_bytes > 0 and choice.comm_s > 0


def test_llama_megatron_pattern_with_gqa(llama_graph):
    choice = choose_tp_styles(llama_graph, 2, FAST_LINK, SLOW_DEVICE)
    for i in range(2):
        p = f"model.layers.{i}"
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert choice.styles[f"{p}.{m}"] == "colwise", m
        for m in ("self_attn.o_proj", "mlp.down_proj"):
            assert choice.styles[f"{p}.{m}"] == "rowwise", m
        assert choice.styles[f"{p}.input_layernorm"] == "replicate"
        assert choice.styles[f"{p}.post_attention_layernorm"] == "replicate"


def test_tp_not_dividing_kv_heads_is_refused(llama_graph):
    assert check_divisibility(llama_graph, 4) == [
        "model.layers.0.self_attn: 2 KV heads are not divisible by tp=4",
        "model.layers.1.self_attn: 2 KV heads are not divisible by tp=4",
    ]
    with pytest.raises(AutoshardError, match=r"2 KV heads are not divisible by tp=4.*tp in \[1, 2\]"):
        choose_tp_styles(llama_graph, 4, FAST_LINK, SLOW_DEVICE)


def test_fast_device_slow_link_replicates(gpt_graph):
    choice = choose_tp_styles(
        gpt_graph, 2, LinkSpec(450.0, 3.0, "NVLink-like"), DeviceSpec("H100-like", 989.0, 2**36, 3350.0, 0.8, "test")
    )
    assert choice.sharded == {}  # a tiny model on a fast GPU: all-reduces cost more than they save
    assert "cheapest layout" in choice.reasons["h.0.mlp.c_fc"]


@pytest.fixture(scope="module")
def gpt2_choice(gpt_graph):
    return choose_tp_styles(capture_graph("tests/models/hf_gpt2.py:build")[1], 2, FAST_LINK, SLOW_DEVICE)


def test_gpt2_conv1d_mlp_is_column_then_row_parallel(gpt2_choice):
    for i in range(2):
        assert gpt2_choice.styles[f"transformer.h.{i}.mlp.c_fc"] == "conv1d-colwise"
        assert gpt2_choice.styles[f"transformer.h.{i}.mlp.c_proj"] == "conv1d-rowwise"
    assert gpt2_choice.sharded == {
        f"transformer.h.{i}.mlp.{m}": f"conv1d-{s}"
        for i in range(2)
        for m, s in (("c_fc", "colwise"), ("c_proj", "rowwise"))
    }
    # per block: the all-reduce of c_proj's (2, 32, 64) fp32 output, and of c_fc's input gradient
    assert gpt2_choice.segments[0].comm_bytes == 2 * 2 * 32 * 64 * 4


def test_gpt2_fused_qkv_and_tied_head_stay_replicated_with_reasons(gpt2_choice):
    for i in range(2):
        assert gpt2_choice.styles[f"transformer.h.{i}.attn.c_attn"] == "replicate"
        assert "fused q, k, v" in gpt2_choice.reasons[f"transformer.h.{i}.attn.c_attn"]
    for module in ("lm_head", "transformer.wte"):
        assert gpt2_choice.styles[module] == "replicate"
        assert "tied to transformer.wte.weight, lm_head.weight" in gpt2_choice.reasons[module]


def synthetic_mlp(hidden: int) -> OpGraph:
    """x -> fc1 -> gelu -> fc2 -> + x, built by hand (no capture)."""
    shape = (2, 8, hidden)
    lin = "torch.nn.modules.linear.Linear"
    nodes = [
        OpNode("fc1", "aten.linear.default", "fc1", lin, ("x", "p_fc1_w"), shape, "float32", ("fc1.weight",)),
        OpNode("gelu", "aten.gelu.default", "", "", ("fc1",), shape, "float32"),
        OpNode("fc2", "aten.linear.default", "fc2", lin, ("gelu", "p_fc2_w"), shape, "float32", ("fc2.weight",)),
        OpNode("add", "aten.add.Tensor", "", "", ("x", "fc2"), shape, "float32"),
    ]
    params = [ParamInfo(f"{m}.weight", (hidden, hidden), "float32", m) for m in ("fc1", "fc2")]
    return annotate(
        OpGraph(
            nodes=nodes,
            params=params,
            input_shapes=[shape],
            batch_size=2,
            tokens_per_sample=1,
            input_names=["x"],
            placeholder_params={"p_fc1_w": "fc1.weight", "p_fc2_w": "fc2.weight"},
            placeholders={
                "x": (shape, "float32"),
                "p_fc1_w": ((hidden, hidden), "float32"),
                "p_fc2_w": ((hidden, hidden), "float32"),
            },
        )
    )


def test_synthetic_replicate_when_link_is_slow():
    graph = synthetic_mlp(8)
    assert choose_tp_styles(graph, 2, SLOW_LINK, FAST_DEVICE).styles == {"fc1": "replicate", "fc2": "replicate"}
    # the same graph in the compute-bound regime: column- then row-parallel
    assert choose_tp_styles(graph, 2, FAST_LINK, SLOW_DEVICE).styles == {"fc1": "colwise", "fc2": "rowwise"}
