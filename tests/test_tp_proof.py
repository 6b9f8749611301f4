"""TP layouts are proven on the model's own code (passes/capturing/tp_proof): what the code computes on a shard."""

import pytest

from autoshard.ir.graph import OpNode
from autoshard.ir.topology import DeviceSpec, LinkSpec
from autoshard.passes.layouts.rules import repeat_dim
from autoshard.passes.layouts.styles import choose_tp_styles
from autoshard.pipeline import capture_graph

SPEC = "tests/models/tp_cases.py"
SLOW_DEVICE = DeviceSpec("slow-test-device", 0.05, 2**34, 20.0, 1.0, "test")  # compute-bound: TP pays
FAST_LINK = LinkSpec(100.0, 0.0, "test")
ATTN = ("q_proj", "k_proj", "v_proj")


def styles(factory: str, tp: int = 2):
    graph = capture_graph(f"{SPEC}:{factory}")[1]
    return graph, choose_tp_styles(graph, tp, FAST_LINK, SLOW_DEVICE)


@pytest.mark.parametrize("tp", [2, 4])
def test_heads_read_from_the_tensor_shard(in_repo, tp):
    graph, choice = styles("build", tp)
    assert graph.tp_proofs is not None and str(tp) in graph.tp_proofs
    for i in range(2):
        assert all(choice.styles[f"h.{i}.attn.{m}"] == "colwise" for m in ATTN)
        assert choice.styles[f"h.{i}.attn.o_proj"] == "rowwise"


def test_gqa_heads_repeated_in_place_stay_sharded(in_repo):
    """``repeat_interleave(2, dim=1)`` of 2 KV heads on a tp 2 shard repeats the rank's one KV head into its own 2
    query heads: the projections are column-parallel and attention runs on the heads' shards (no gather)."""
    graph, choice = styles("build_gqa_repeat")
    assert not graph.tp_proofs["2"]
    for i in range(2):
        assert all(choice.styles[f"h.{i}.attn.{m}"] == "colwise" for m in ATTN), choice.reasons
        assert choice.styles[f"h.{i}.attn.o_proj"] == "rowwise"


@pytest.mark.parametrize(
    ("attrs", "dim"),
    [
        ({"repeats": 4, "dim": 1}, 1),  # the sharded heads repeated in place: the same dim, rank i's rows
        ({"repeats": 4, "dim": 2}, 1),  # another dim repeated: each shard its own slice
        ({"repeats": 4, "dim": None}, None),  # flattened first: the shard's rows land elsewhere
        ({"dim": 1}, None),  # a tensor of repeats (a count per row): rows move between ranks
    ],
)
def test_repeat_interleave_keeps_the_shard_only_in_place(attrs, dim):
    node = OpNode("r", "aten.repeat_interleave.self_int", "attn", "", ("k",), (2, 8, 16, 8), "float32", attrs=attrs)
    assert repeat_dim(node, 1) == dim


def test_a_constant_head_count_is_refused_with_its_reason(in_repo):
    """view(b, -1, HEADS, hd) on a column shard would keep all heads and halve the sequence: the attention
    core stays whole (its projections may only be gathered; the MLP still shards), and the refusal names the
    view in the representative block and the two shapes."""
    graph, choice = styles("build_constant_heads")
    refused = graph.tp_proofs["2"]
    assert (
        "view in h.0.attn gives shape [2, 8, 4, 8] on a shard where the layout needs [2, 16, 2, 8]" in refused["view"]
    )
    for i in range(2):
        assert all(choice.styles[f"h.{i}.attn.{m}"] in ("colwise-gather", "replicate") for m in ATTN)
        assert choice.styles[f"h.{i}.attn.o_proj"] != "rowwise"  # its input, the attention output, is whole
        assert choice.styles[f"h.{i}.up"] == "colwise" and choice.styles[f"h.{i}.down"] == "rowwise"


def test_per_head_norm_gets_its_gradient_summed_over_tp(in_repo):
    """A norm over head_dim on sharded heads runs as SequenceParallel on the heads dim (its weight a
    Replicate DTensor whose partial gradients DTensor sums), not as a plain replicated module."""
    _, choice = styles("build_head_norm")
    for i in range(2):
        assert all(choice.styles[f"h.{i}.attn.{m}"] == "colwise" for m in ATTN)
        assert choice.styles[f"h.{i}.attn.q_norm"] == "sharded-input-dim2"
        assert choice.styles[f"h.{i}.attn.k_norm"] == "sharded-input-dim2"
        assert choice.styles[f"h.{i}.ln_1"] == "replicate" and "needs whole tensors" in choice.reasons[f"h.{i}.ln_1"]


def test_a_linear_outside_nn_linear_gets_no_style(in_repo):
    _, choice = styles("build_router")
    for i in range(2):
        assert choice.styles[f"h.{i}.router"] == "replicate"
        assert "not an nn.Linear" in choice.reasons[f"h.{i}.router"]


def test_a_linear_whose_output_the_model_writes_into_stays_replicated(in_repo, tmp_path):
    """``y = down(...); y.add_(h)``: a DTensor style hands the model the output's local tensor, a view autograd forbids
    writing into while it records gradients, so the program would fail at its first step (transformers' Llama 4 MoE
    at tp 2, found by the causal-LM sweep). The down projection stays replicated and says why."""
    _, choice = styles("build_in_place_sum")
    for i in range(2):
        assert choice.styles[f"h.{i}.down"] == "replicate"
        assert "writes into its output in place (aten.add_.Tensor)" in choice.reasons[f"h.{i}.down"]
        assert all(choice.styles[f"h.{i}.attn.{m}"] == "colwise" for m in ATTN)  # the rest is untouched
    _, plain = styles("build")
    assert plain.styles["h.0.down"] == "rowwise"


def test_degrees_not_checked_shard_nothing(in_repo):
    graph, _ = styles("build")
    assert "3" not in graph.tp_proofs  # 3 does not divide the 4 heads; 16 is not a checked degree
    graph.tp_proofs.pop("4")
    choice = choose_tp_styles(graph, 4, FAST_LINK, SLOW_DEVICE)
    assert not choice.sharded and "was not checked" in choice.reasons["h.0.attn.q_proj"]
