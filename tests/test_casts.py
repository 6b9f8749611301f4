"""A model's own dtype casts, captured in fp32, priced as they run with 16-bit activations (``cost.casts``).

transformers' LlamaRMSNorm upcasts its input to fp32 and casts the normed product back to the input's dtype; in an
fp32 capture both are casts to fp32 of fp32 values. Trained in bf16 the first is an fp32 copy that ``pow`` and
``mul`` keep (4 B per element), the second a 16-bit copy the weight's ``mul`` keeps (2 B): 6 B per element of the
norm's input where the views priced 2 (a 70B rank at tp 4 with SP, 8k tokens: 32 MiB a norm short).
"""

from __future__ import annotations

import json

import pytest

from autoshard.cost.casts import sixteen_bit_casts
from autoshard.cost.saved import saved_set, storage_of
from autoshard.ir.names import op_name
from autoshard.pipeline import capture_graph

HIDDEN, SEQ, BATCH = 64, 16, 2
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return capture_graph(f"hf:{folder}", seq_len=SEQ, proofs=False)[1]


def _first_norm(graph):
    """The first block's input norm: its upcast, its cast back, and the ops between."""
    block = [graph.node(n) for n in graph.blocks[0].node_names]
    up, back = [n for n in block if op_name(n.target) == "to"][:2]
    return block, up, back


def test_the_norm_keeps_an_fp32_copy_and_a_16_bit_one_where_activations_are_16_bit(llama):
    block, up, back = _first_norm(llama)
    casts = sixteen_bit_casts(llama)
    assert up.name in casts.copies and up.name in casts.upcast  # x.to(fp32) of the 16-bit stream
    assert back.name in casts.copies and back.name not in casts.upcast  # .to(input_dtype): the cast back
    elements = BATCH * SEQ * HIDDEN
    kept = saved_set(llama, block, 0.5)
    assert kept[up.name] == 4 * elements and kept[back.name] == 2 * elements
    assert storage_of(llama, up.name, 0.5) == up.name and storage_of(llama, up.name) == up.inputs[0]


def test_in_fp32_the_casts_are_views_as_captured(llama):
    block, up, back = _first_norm(llama)
    kept = saved_set(llama, block, 1.0)
    assert up.name not in kept and back.name not in kept
    assert kept[up.inputs[0]] == 4 * BATCH * SEQ * HIDDEN  # the block's input itself, as captured


def test_what_a_16_bit_reader_makes_stays_16_bit(llama):
    """The residual add reads the upcast's node (a no-op cast returns its input, so the capture names later uses
    of x by the cast), and the matmuls and attention read the cast back: none of them is upcast."""
    block, up, _ = _first_norm(llama)
    upcast = sixteen_bit_casts(llama).upcast
    residual = [n for n in block if op_name(n.target) == "add" and up.name in n.inputs and n.output_numel > BATCH * SEQ]
    assert residual and all(n.name not in upcast for n in residual)
    for node in block:
        if op_name(node.target) in ("linear", "scaled_dot_product_attention"):
            assert node.name not in upcast
    sdpa = next(n for n in block if op_name(n.target) == "scaled_dot_product_attention")
    query = sdpa.inputs[0]
    assert saved_set(llama, [sdpa], 0.5)[storage_of(llama, query, 0.5)] == llama.node(query).output_numel * 2
