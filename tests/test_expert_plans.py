"""Mixture-of-experts models: expert groups found on the graph, the ep axis planned, priced and lowered.

No processes: plans are made on captured graphs (meta tensors) with ``plan_graph``; the programs run in
tests/e2e/test_expert_parallel.py.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from autoshard.cost.hardware import load_cluster
from autoshard.cost.step import price_parts
from autoshard.cost.tables import CostTables
from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan
from autoshard.passes.capturing.annotate import annotate
from autoshard.passes.capturing.blocks import find_blocks
from autoshard.passes.capturing.capture import capture_module
from autoshard.passes.capturing.experts import find_experts
from autoshard.passes.lowering.lower import lower
from autoshard.passes.planning.strategies import Pins
from autoshard.pipeline import PlanRequest, capture_graph, plan_graph

MOE = {
    "mixtral": "tests/models/hf_mixtral.py:build",
    "olmoe": "tests/models/hf_olmoe.py:build",
    "qwen2-moe": "tests/models/hf_causal_zoo.py:build_qwen2_moe",
}


@pytest.fixture(scope="module")
def graphs(in_repo_module):
    return {name: capture_graph(spec) for name, spec in MOE.items()}


def plan(captured, spec, cluster, global_batch, **pins):
    model_file, graph = captured
    return plan_graph(PlanRequest(spec, cluster, global_batch, Pins(**pins)), model_file, graph)


def test_every_moe_layer_is_found_with_its_experts_and_top_k(graphs):
    for name, (_, graph) in graphs.items():
        assert [g.path for g in graph.experts] == [f"model.layers.{i}.mlp.experts" for i in range(2)], name
        for g in graph.experts:
            assert (g.experts, g.top_k, g.hidden) == (4, 2, 64)
            assert g.pairs == graph.batch_size * graph.tokens_per_sample * g.top_k
            assert g.param_count == sum(graph.param(p).numel for p in g.params)
            assert g.flops_fwd > 0 and g.block == g.path.rsplit(".", 2)[0]
    shared = graphs["qwen2-moe"][1]
    assert not any("shared_expert" in g.path for g in shared.experts)  # a dense MLP: data parallel


class Summed(nn.Module):
    """A stacked [E, d, d] weight whose slices are summed: not separable by expert."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x):
        return x @ self.w.sum(0)


def test_a_stacked_weight_used_whole_is_no_expert_group():
    graph = annotate(capture_module(Summed(), (torch.randn(2, 8),)))
    assert find_experts(find_blocks(graph)).experts == []


def test_a_dense_model_has_no_expert_groups_and_plans_as_before(in_repo_module):
    model_file, graph = capture_graph("examples/gpt.py:build")
    assert graph.experts == []
    p = plan((model_file, graph), "examples/gpt.py:build", load_cluster("local-cpu"), 8)
    doc = json.loads(p.to_json())
    assert "ep" not in doc["decisions"] and "experts" not in doc["layout"]
    assert all(s.op != "apply_ep" for s in lower(p))


@pytest.mark.parametrize("zero", [0, 3])
def test_pinned_ep_plans_lowers_and_round_trips(graphs, zero):
    p = plan(graphs["mixtral"], MOE["mixtral"], load_cluster("local-cpu"), 8, ep=2, zero=zero)
    assert (p.ep, p.mesh.dp, p.zero_stage) == (2, 2, zero)
    assert p.experts == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    ops = [s.op for s in lower(p)]
    assert ops.index("apply_ep") < ops.index("apply_fsdp" if zero else "apply_replicate")
    wrapper = next(s for s in lower(p) if s.op in ("apply_fsdp", "apply_replicate"))
    assert wrapper.kwargs["ep"] == 2  # expert shards synced over their own ranks only
    again = Plan.from_json(p.to_json())
    assert (again.ep, again.experts) == (p.ep, p.experts) and again.to_json() == p.to_json()
    assert p.predicted.comm_exposed_s > 0


def test_pinned_ep_in_a_pipeline_shards_before_the_split(graphs):
    for dp in (2, 4):  # ep = dp, and ep < dp (expert shards averaged over their replicas after the schedule)
        p = plan(
            graphs["olmoe"], MOE["olmoe"], load_cluster("local-cpu", devices_per_node=2 * dp), 8, ep=2, pp=2, dp=dp
        )
        ops = [s.op for s in lower(p)]
        assert ops.index("apply_ep") < ops.index("split_pipeline")
        assert next(s for s in lower(p) if s.op == "apply_ep").kwargs["before_split"] is True


@pytest.mark.parametrize(
    "pins, message",
    [
        ({"ep": 3, "dp": 2}, "must divide it"),
        ({"ep": 2, "tp": 2}, "without tensor parallelism"),
        ({"ep": 8}, "must divide every expert group's experts"),
    ],
)
def test_impossible_ep_pins_are_refused_with_the_fix(graphs, pins, message):
    cluster = load_cluster("local-cpu", devices_per_node=8)
    with pytest.raises(AutoshardError, match=message):
        plan(graphs["mixtral"], MOE["mixtral"], cluster, 8, **pins)


def test_an_ep_larger_than_any_dp_is_refused_with_the_fix(graphs):
    with pytest.raises(AutoshardError, match="--ep 4 borrows 4 of the dp ranks, but this cluster's meshes give dp in"):
        plan(graphs["mixtral"], MOE["mixtral"], load_cluster("local-cpu"), 8, ep=4)


def test_ep_on_a_dense_model_is_refused(in_repo_module):
    with pytest.raises(AutoshardError, match="no expert group"):
        plan(capture_graph("examples/gpt.py:build"), "examples/gpt.py:build", load_cluster("local-cpu"), 8, ep=2)


def test_ep_splits_expert_state_and_adds_all_to_all(graphs):
    """ZeRO-0: the expert Adam state on a rank falls to 1/ep; the all-to-alls appear. (The state is read where
    every moment of the step holds it whole: the weights at the peak also hold what the dp wrapper keeps
    gathered, which differs between DDP at ep 1 and FSDP2's replicate beside expert shards.)"""
    _, graph = graphs["mixtral"]
    tables = CostTables(graph, load_cluster("local-cpu", devices_per_node=4))
    p = plan(
        graphs["mixtral"],
        MOE["mixtral"],
        load_cluster("local-cpu", devices_per_node=4),
        8,
        ep=1,
        zero=0,
        dp=4,
        microbatch_size=2,
        recompute="none",
    )
    base = p.decisions
    one, four = price_parts(tables, base), price_parts(tables, replace(base, ep=4))
    experts = sum(g.param_count for g in graph.experts)
    saved = (one.memory.optimizer_bytes - four.memory.optimizer_bytes) / tables.precision.optimizer_bytes
    assert saved == pytest.approx(experts * (1 - 1 / 4), rel=1e-6)
    assert one.ep_comm_s == 0 and four.ep_comm_s > 0
    assert four.recompute_s > one.recompute_s  # the dispatch recomputes its experts in backward


def test_the_expert_all_to_all_stays_inside_a_node_where_the_topology_favours_it(in_repo_module):
    """DeepSeek-V3's architecture at 16B on 2 nodes x 8: the expert state fits only at ep >= 8. With NVLink
    inside a node and one NIC per GPU across, the planner keeps ep = 8 (one node: the all-to-all on NVLink), where
    ep = 16's all-to-all, crossing the nodes, costs several times as much; where the link between nodes is as fast
    (a flat topology) ep = 16 costs about what ep = 8 does."""
    spec = "benchmarks/deepseek_v3.py:build_16b"
    captured = capture_graph(spec)
    pins = dict(dp=16, tp=1, pp=1, zero=1)
    clusters = {name: load_cluster(f"tests/clusters/{name}.yaml", nodes=2) for name in ("h100_40g", "h100_40g_flat")}
    nvlink = plan(captured, spec, clusters["h100_40g"], 64, **pins)
    assert nvlink.ep == 8
    all_to_all_s = {
        name: [
            price_parts(CostTables(captured[1], cluster), replace(nvlink.decisions, ep=ep)).ep_comm_s for ep in (8, 16)
        ]
        for name, cluster in clusters.items()
    }
    assert all_to_all_s["h100_40g"][1] > 5 * all_to_all_s["h100_40g"][0]
    assert all_to_all_s["h100_40g_flat"][1] < 1.5 * all_to_all_s["h100_40g_flat"][0]
    with pytest.raises(AutoshardError, match="no plan fits|does not fit"):  # below 8 nothing fits
        plan(captured, spec, clusters["h100_40g"], 64, ep=4, **pins)


def test_the_dispatch_keeps_none_of_the_experts_activations_and_recomputes_them_in_its_backward(graphs):
    """Under ep > 1 the experts module is one op that keeps only its inputs and its output's product with the
    routing weights: what the captured module keeps (its grouped GEMMs' outputs, the activation) leaves the
    block's recompute workspace, and its backward holds them again, recomputed on the received pairs, beside the
    exchanged tokens and gradients (``cost.experts.dispatch_memory``; benchmarks/reports/dryrun-2026-11-26: Mixtral
    ep 8 was -7.2 % with the module's activations counted in the workspace and its largest backward op missing)."""
    from autoshard.cost.experts import dispatch_memory
    from autoshard.cost.memory import module_bytes
    from autoshard.cost.rank_memory import spmd_moments

    _, graph = graphs["mixtral"]
    cluster = load_cluster("local-cpu", devices_per_node=4)
    tables = CostTables(graph, cluster)
    base = plan(
        graphs["mixtral"], MOE["mixtral"], cluster, 8, ep=1, zero=3, dp=4, microbatch_size=2, recompute="full"
    ).decisions
    moments = {
        ep: spmd_moments(
            tables,
            replace(base, ep=ep),
            graph.param_count,
            (0, 0, 0),
            expert_params=graph.param_count // 4 if ep > 1 else 0,
        )["backward"]
        for ep in (1, 4)
    }
    dispatch = dispatch_memory(tables, replace(base, ep=4))
    group = graph.experts[0]
    ratio, scale = tables.precision.activation_bytes / 4, base.microbatch_size / graph.batch_size
    saved, grads = (b * scale for b in module_bytes(graph, group.path, ratio))
    pairs = group.pairs * scale * group.hidden * tables.precision.activation_bytes
    assert dispatch[0].kept == pytest.approx(saved - pairs, abs=1)
    assert moments[1]["activations_bytes"] - moments[4]["activations_bytes"] == pytest.approx(dispatch[0].kept, abs=1)
    assert dispatch[0].backward >= 4 * pairs + saved + grads
    assert moments[4]["transient_bytes"] >= dispatch[0].backward > moments[1]["transient_bytes"]
    # the module's backward holds activation gradients only: its weights' (read through a transpose) are grads
    weights = sum(graph.param(p).numel for p in group.params) * tables.precision.activation_bytes * scale
    assert grads < weights
