"""Heterogeneous clusters: node groups of different devices or links, planned as one job.

No processes: cluster files are read, stage cuts solved and plans made on a captured graph (meta tensors).
The CPU run of such a plan is ``tests/e2e/test_verify_hybrid.py``'s case ``gpt-hetero-dp2-pp2``.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest
from rich.console import Console

from autoshard.cost.hardware import load_cluster
from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan
from autoshard.ir.topology import Cluster
from autoshard.passes.planning.stage_cuts import PartitionProblem, best_cuts, bottleneck_ps
from autoshard.passes.planning.strategies import Pins
from autoshard.pipeline import PlanRequest, capture_graph, plan_graph
from autoshard.show import stages_table

GPT = "examples/gpt.py:build"
HETERO_CPU = "tests/clusters/hetero_cpu.yaml"  # groups "fast" (2x FLOP/s and bandwidth) then "slow", 2 ranks each
H100_A100 = "benchmarks/clusters/h100_a100_hetero.yaml"
PINS = dict(pp=2, dp=2, schedule="1f1b", microbatch_size=2, recompute="none", zero=0)


@pytest.fixture(scope="module")
def gpt(in_repo_module):
    return capture_graph(GPT)


def plan(captured, cluster, **pins):
    model_file, graph = captured
    return plan_graph(PlanRequest(GPT, cluster, 8, Pins(**pins)), model_file, graph)


def blocks_of(p, stage):
    return sum(1 for m in p.stages[stage].modules if m.startswith("h."))


def write(tmp_path, text):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------------- cluster files


def test_group_file_gives_each_group_its_device_and_links(in_repo):
    c = load_cluster(H100_A100)
    assert (c.nodes, c.world_size, [g.name for g in c.groups]) == (4, 32, ["h100", "a100"])
    h100, a100 = (g.device for g in c.groups)
    assert (h100.peak_tflops, a100.peak_tflops) == (989.0, 312.0)
    # an SPMD step runs at the slowest rank's pace: each figure the lowest of the groups'
    assert c.device.peak_tflops == 312.0 and c.device.float8_tflops == 0.0
    assert (c.device.host_link_gbps, c.device.host_memory_bytes) == (25.0, 2**40)  # offload: the A100 nodes' host
    assert [c.rank_group(r) for r in (0, 15, 16, 31)] == [0, 0, 1, 1]
    # inside a group its own links; across groups the cluster's inter_node, shared by the node's devices
    assert c.group_link([0, 1]).bandwidth_gbps == 450.0  # H100 NVLink 4
    assert c.group_link([16, 17]).bandwidth_gbps == 235.0  # A100 NVLink 3
    assert c.group_link([0, 8]).bandwidth_gbps == 50.0  # between the H100 nodes: their own NDR NICs
    assert c.group_link([0, 16]).bandwidth_gbps == 25.0  # between the groups
    assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c  # plan.json's cluster reads back


@pytest.mark.parametrize(
    "text, words",
    [
        (
            "groups:\n  - {name: a, nodes: 1, preset: dgx-h100}\n  - {name: a, nodes: 1, preset: dgx-h100}\n",
            "named twice",
        ),
        ("groups:\n  - {name: a, nodes: 1}\n", "missing field 'groups.device'"),
        ("groups:\n  - {name: a, nodes: 1, preset: dgx-h200}\n", "a group's preset must be one of"),
        ("groups: []\n", "groups must be a non-empty list"),
        ("nodes: 3\ngroups:\n  - {name: a, nodes: 1, preset: dgx-h100}\n", "nodes is given beside groups"),
        ("preset: dgx-h100\ngroups:\n  - {name: a, nodes: 1, preset: dgx-h100}\n", "no top-level preset"),
    ],
)
def test_bad_group_file_is_one_line_naming_the_fix(tmp_path, text, words):
    head = "name: x\ndevices_per_node: 8\nbackend: nccl\ninter_node: {bandwidth_gbps: 25, latency_us: 6}\n"
    with pytest.raises(AutoshardError) as e:
        load_cluster(write(tmp_path, head + text))
    assert words in str(e.value) and "fix:" in str(e.value) and "\n" not in str(e.value)


def test_nodes_flag_is_refused_on_groups_and_devices_per_node_applies_to_each(in_repo):
    with pytest.raises(AutoshardError, match="--nodes does not apply to a cluster of node groups"):
        load_cluster(H100_A100, nodes=2)
    assert load_cluster(H100_A100, devices_per_node=4).world_size == 16


# ---------------------------------------------------------------------------- stage cuts per group


def test_cuts_give_the_faster_group_more_blocks():
    """8 equal blocks, one stage's group 2.5 times as fast: max(4k, 10(8 − k)) is least at k = 6 fast blocks."""
    even = PartitionProblem((10,) * 8)
    assert best_cuts(even, 2) == (4,)
    fast_first = replace(even, stage_times=(((4,) * 8, 0, 0), ((10,) * 8, 0, 0)))
    assert best_cuts(fast_first, 2) == (6,)
    assert bottleneck_ps(fast_first, (6,)) == 24  # the fast stage's 6 blocks; the slow one's 2 take 20
    fast_last = replace(even, stage_times=(((10,) * 8, 0, 0), ((4,) * 8, 0, 0)))
    assert best_cuts(fast_last, 2) == (2,)


def test_cuts_give_the_group_with_less_memory_fewer_blocks():
    roomy = PartitionProblem((10,) * 8, block_fixed_bytes=(1.0,) * 8, block_act_bytes=(0.0,) * 8, in_flight=(1, 1))
    assert best_cuts(roomy, 2) == (4,)
    assert best_cuts(replace(roomy, stage_caps=(100.0, 2.0)), 2) == (6,)  # stage 1's group holds 2 blocks
    assert best_cuts(replace(roomy, stage_caps=(100.0, 0.5)), 2) is None


# ---------------------------------------------------------------------------- plans


def test_plan_puts_more_layers_on_the_faster_group_in_either_order(gpt, in_repo):
    fast_first = load_cluster(HETERO_CPU)
    p = plan(gpt, fast_first, **PINS)
    assert p.stage_group(p.stages[0].ranks)["name"] == "fast"
    assert blocks_of(p, 0) > blocks_of(p, 1)
    g = fast_first
    slow_first = Cluster.of_groups(g.name, g.devices_per_node, g.backend, g.inter_node, g.groups[::-1], g.host)
    q = plan(gpt, slow_first, **PINS)
    assert q.stage_group(q.stages[1].ranks)["name"] == "fast"
    assert blocks_of(q, 1) > blocks_of(q, 0)
    # the same file planned again: the same bytes; plan.json reads back with its groups
    assert plan(gpt, load_cluster(HETERO_CPU), **PINS).to_json() == p.to_json()
    assert Plan.from_json(p.to_json()).to_json() == p.to_json()
    # inspect names each stage's group
    out = io.StringIO()
    Console(file=out, width=200).print(stages_table(p))
    assert "fast (cpu-process-2x, 0.1 TFLOP/s" in out.getvalue() and "slow (cpu-process, 0.05 TFLOP/s" in out.getvalue()


def test_plan_checks_each_stage_against_its_own_group_memory(gpt, in_repo):
    """Equal speeds; the second group's device holds 3.0 MB, less than two blocks and the head need (4.3 MB):
    its stage gets one block, and the first group's 7.4 MB stage fits its own large device."""
    base = load_cluster(HETERO_CPU).groups[1]
    small = replace(base, name="small", device=replace(base.device, memory_bytes=3_000_000))
    c = Cluster.of_groups("mixed-memory", 2, "gloo", load_cluster(HETERO_CPU).inter_node, [base, small])
    roomy = Cluster.of_groups("even-memory", 2, "gloo", c.inter_node, [base, replace(small, device=base.device)])
    assert plan(gpt, roomy, **PINS).split_points == ("h.2",)
    p = plan(gpt, c, **PINS)
    assert p.split_points == ("h.3",) and blocks_of(p, 1) == 1
    first, second = p.predicted.pp_rank_memory
    assert second.peak_bytes <= 3_000_000 < first.peak_bytes  # each rank against its own device
    assert p.tightest_memory() == (second.peak_bytes, 3_000_000)


def test_a_pipeline_stage_spanning_two_groups_is_not_offered(gpt, in_repo):
    """Groups of 2 and 4 ranks: pp = 2 puts 3 ranks in a stage, across the groups; pp = 3 fits."""
    c = load_cluster(HETERO_CPU)
    big = replace(c.groups[1], nodes=2)
    uneven = Cluster.of_groups(c.name, 2, "gloo", c.inter_node, [c.groups[0], big], c.host)
    with pytest.raises(AutoshardError) as e:
        plan(gpt, uneven, pp=2)
    assert "would span two node groups" in str(e.value) and "pin --pp in 3, 6" in str(e.value)
    assert plan(gpt, uneven, pp=3, dp=2, schedule="1f1b").stage_group((0, 1))["name"] == "fast"
