"""passes/capturing/blocks: repeated layers found from module paths, with signatures and sizes."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from autoshard.ir.names import block_of
from autoshard.modelfile import load_model_file
from autoshard.passes.capturing.annotate import annotate
from autoshard.passes.capturing.blocks import find_blocks
from autoshard.passes.capturing.capture import capture

ROOT = Path(__file__).resolve().parent.parent
B, S, D = 2, 64, 64


def pipeline(spec: str, batch_size: int = B):
    return find_blocks(annotate(capture(load_model_file(spec), batch_size)))


@pytest.fixture(scope="module")
def gpt_graph():
    return pipeline(f"{ROOT / 'examples/gpt.py'}:build")


def test_gpt_layers_are_identical_blocks(gpt_graph):
    assert gpt_graph.block_paths == ["h.0", "h.1", "h.2", "h.3"]
    assert len({b.signature for b in gpt_graph.blocks}) == 1
    assert all(b.representative == "h.0" for b in gpt_graph.blocks)


def test_gpt_block_numbers(gpt_graph):
    torch.manual_seed(0)
    model = load_model_file(f"{ROOT / 'examples/gpt.py'}:build").build("cpu")
    for i, block in enumerate(gpt_graph.blocks):
        assert block.param_count == sum(p.numel() for p in model.h[i].parameters())
        nodes = [gpt_graph.node(n) for n in block.node_names]
        assert all(n.module_path.startswith(block.path) for n in nodes)
        assert block.flops_fwd == sum(n.flops for n in nodes)
        # kept outputs: ln_1, q, k, v, sdpa, c_proj, add, ln_2, add, c_proj (B·S·D each), c_fc, gelu (4·B·S·D)
        assert block.activation_bytes == 4 * B * S * D * (10 + 2 * 4)
        assert block.input_bytes == 4 * B * S * D


def test_nodes_outside_blocks_stay_out(gpt_graph):
    inside = {n for b in gpt_graph.blocks for n in b.node_names}
    outside = {gpt_graph.node(n.name).module_path for n in gpt_graph.nodes if n.name not in inside}
    assert outside == {"", "wte", "wpe", "ln_f", "lm_head"}


def test_a_different_layer_gets_its_own_signature(tmp_path):
    path = tmp_path / "odd_gpt.py"
    path.write_text(
        textwrap.dedent(f"""
        import sys
        import torch.nn as nn
        sys.path.insert(0, {str(ROOT / "examples")!r})
        from gpt import build as gpt_build, example_batch

        def build():
            model = gpt_build()
            model.h[2].mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
            model.h[3].ln_1.eps = 1e-3  # same shapes, different attrs
            return model
    """)
    )
    graph = pipeline(f"{path}:build")
    assert graph.block_paths == ["h.0", "h.1", "h.2", "h.3"]  # "h.2.mlp.0" is inside "h.2"
    sig = {b.path: b.signature for b in graph.blocks}
    assert sig["h.0"] == sig["h.1"]
    assert len({sig["h.0"], sig["h.2"], sig["h.3"]}) == 3
    assert [b.representative for b in graph.blocks] == ["h.0", "h.0", "h.2", "h.3"]


def test_llama_decoder_layers():
    graph = pipeline(f"{ROOT / 'tests/models/hf_llama.py'}:build")
    assert graph.block_paths == ["model.layers.0", "model.layers.1"]
    first, second = graph.blocks
    assert first.signature == second.signature and second.representative == "model.layers.0"
    # q 64·64, k and v 64·32, o 64·64, MLP 3·64·128, two RMSNorm weights of 64
    assert first.param_count == 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    # the mask and rotary tables are read by both layers: only the hidden state is the block's own
    assert first.input_bytes == 4 * B * 32 * 64


def test_gpt2_blocks():
    graph = pipeline(f"{ROOT / 'tests/models/hf_gpt2.py'}:build")
    assert graph.block_paths == ["transformer.h.0", "transformer.h.1"]
    assert len({b.signature for b in graph.blocks}) == 1
    assert graph.blocks[0].param_count == 12 * 64 * 64 + 13 * 64  # weights + biases + 2 LayerNorms


def test_top_level_sequential_blocks():
    graph = pipeline(f"{ROOT / 'tests/models/mlp.py'}:build", batch_size=3)
    assert graph.block_paths == ["0", "1", "2", "3"]
    assert len({b.signature for b in graph.blocks}) == 1
    assert all(b.input_bytes == 4 * 3 * 32 for b in graph.blocks)
    assert sum(b.param_count for b in graph.blocks) == graph.param_count


@pytest.mark.parametrize(
    "path, block",
    [
        ("h.3.attn.q_proj", "h.3"),
        ("model.layers.11", "model.layers.11"),
        ("h.3.mlp.0", "h.3"),
        ("2.fc1", "2"),
        ("lm_head", None),
        ("", None),
    ],
)
def test_block_of(path, block):
    assert block_of(path) == block
