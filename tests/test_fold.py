"""passes/capturing/fold: two of L repeated layers captured and copied give the graph, and the plan, of all L."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from autoshard.cost.hardware import load_cluster
from autoshard.ir.pins import Pins
from autoshard.passes.capturing.fold import fold_model, repeated_stack
from autoshard.pipeline import PlanRequest, capture_graph, plan_model

ROOT = Path(__file__).resolve().parent.parent
FAST = str(ROOT / "tests/clusters/fast_link_cpu.yaml")
# the last: DeepSeek-V3's shape in small, 2 dense layers before 5 mixture-of-experts ones (kept whole, then 3)
MODELS = [
    "examples/gpt.py:build",
    "tests/models/hf_llama.py:build_4_layers",
    "benchmarks/deepseek_v3.py:build_tiny_deep",
]


def node_facts(graph):
    """What the cost model reads of every node, without the node's own (generated) name."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}

    def ref(name):
        if name in index:
            return ("node", index[name])
        return ("param", graph.placeholder_params[name]) if name in graph.placeholder_params else ("in", name)

    return [
        (
            n.target,
            n.module_path,
            n.shape,
            n.flops,
            n.bytes_read,
            n.bytes_written,
            n.param_inputs,
            tuple(ref(i) for i in n.inputs),
        )
        for n in graph.nodes
    ]


@pytest.fixture(scope="module", params=MODELS)
def both(request):
    spec = str(ROOT / request.param)
    # through the capture cache, which the plans below then read: each model is exported once per fold
    return capture_graph(spec, fold=False, use_cache=True, proofs=False)[1], capture_graph(
        spec, fold=True, use_cache=True, proofs=False
    )[1]


def test_folded_capture_is_the_whole_graph_node_for_node(both):
    whole, folded = both
    assert node_facts(folded) == node_facts(whole)  # same ops, wiring, parameters, FLOPs and bytes
    assert [(p.name, p.shape) for p in folded.params] == [(p.name, p.shape) for p in whole.params]
    assert [(b.path, b.signature, b.param_count, b.input_bytes, b.activation_bytes) for b in folded.blocks] == [
        (b.path, b.signature, b.param_count, b.input_bytes, b.activation_bytes) for b in whole.blocks
    ]
    assert folded.model_fingerprint == whole.model_fingerprint


@pytest.mark.parametrize("model", MODELS)
def test_plans_are_byte_identical_with_and_without_folding(in_repo, model):
    cluster = load_cluster(FAST, devices_per_node=4)
    plans = [plan_model(PlanRequest(model, cluster, 16, fold=fold)).to_json() for fold in (True, False)]
    assert plans[0] == plans[1]


# 8 layers: copies 3-7 of layer 2, of which 3-6 are twins (``OpGraph.layer_twins``): every per-block figure of a
# twin is layer 2's, read, not walked. Pinned to tp 2 (with sequence parallelism; in pipeline stages), the figures
# are priced on a TP rank's shares; the unfolded capture has no twins and walks every block.
@pytest.mark.parametrize("pins", [dict(tp=2, sequence_parallel=True), dict(tp=2, pp=2)])
def test_twin_layers_price_as_their_walk(in_repo, pins):
    cluster = load_cluster(FAST, devices_per_node=4)
    model = "tests/models/hf_llama.py:build_8_layers"
    folded = capture_graph(model, fold=True, use_cache=True, proofs=False)[1]
    assert sorted(folded.layer_twins) == [f"model.layers.{k}" for k in range(3, 7)]
    plans = [plan_model(PlanRequest(model, cluster, 16, Pins(**pins), fold=fold)).to_json() for fold in (True, False)]
    assert plans[0] == plans[1]


def test_only_one_stack_of_identical_layers_is_folded():
    import torch.nn as nn

    same = nn.Module()
    same.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
    assert repeated_stack(same) == "layers"
    fold = fold_model(same)
    assert (fold.path, fold.layers, len(same.layers)) == ("layers", 4, 3)
    mixed = nn.Module()
    mixed.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(8, 4)])
    assert repeated_stack(mixed) is None and fold_model(mixed) is None
    prefixed = nn.Module()
    prefixed.layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 4)] + [nn.Linear(4, 4) for _ in range(5)])
    fold = fold_model(prefixed)
    assert (fold.first, fold.layers, len(prefixed.layers)) == (2, 7, 5)  # the distinct two, then three
    two = nn.Module()
    two.a, two.b = (nn.ModuleList(nn.Linear(4, 4) for _ in range(4)) for _ in range(2))
    assert repeated_stack(two) is None  # which one the forward loops over is not knowable: no folding


def test_layers_that_differ_by_index_are_captured_whole(tmp_path, in_repo):
    """A forward that branches on the layer's index: the two captured layers differ, so capture
    exports the whole model, and the graph is the unfolded one."""
    path = tmp_path / "by_index.py"
    path.write_text(
        textwrap.dedent("""
        import torch, torch.nn as nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))

            def forward(self, x):
                for i, layer in enumerate(self.layers):
                    x = layer(x)
                    if i % 2:  # every other layer also squares: not a copy of layer 1
                        x = x * x
                return x

        def build():
            return M()

        def example_batch(n):
            return (torch.randn(n, 8),), torch.randn(n, 8)
    """)
    )
    whole = capture_graph(f"{path}:build", fold=False, proofs=False)[1]
    folded = capture_graph(f"{path}:build", fold=True, proofs=False)[1]
    assert node_facts(folded) == node_facts(whole)
    assert sum(n.target == "aten.mul.Tensor" for n in folded.nodes) == 3


def test_the_profile_signature_does_not_depend_on_folding(both):
    from autoshard.cost.profile import graph_signature

    whole, folded = both
    assert graph_signature(whole) == graph_signature(folded)
