"""The planner plans TP and PP: meshes the runtime supports, exact stage cuts, pins, determinism.

No processes: plans are made on captured graphs (meta tensors) with ``plan_graph``.
"""

import itertools
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.cli import main
from autoshard.cost.compute import microbatch_compute
from autoshard.cost.dp_comm import ranks_of_stage
from autoshard.cost.hardware import load_cluster
from autoshard.cost.memory import activation_bytes, precision_for_backend
from autoshard.cost.rank_memory import in_flight
from autoshard.cost.units import stage_ranges, stage_units, unit_costs
from autoshard.errors import AutoshardError
from autoshard.passes.lowering.lower import lower
from autoshard.passes.planning.stage_cuts import PartitionProblem, best_cuts, bottleneck_ps
from autoshard.passes.planning.strategies import Pins
from autoshard.pipeline import PlanRequest, capture_graph, plan_graph

GPT = "examples/gpt.py:build"
WIDE = "tests/models/wide_gpt.py:build"
DEEP = "tests/models/wide_gpt.py:build_deep"  # twice the blocks: data parallelism alone cannot hold it
FAST_LINK = "tests/clusters/fast_link_cpu.yaml"  # TP pays off here


@pytest.fixture(scope="module")
def gpt(in_repo_module):
    return capture_graph(GPT)


@pytest.fixture(scope="module")
def wide(in_repo_module):
    return capture_graph(WIDE)


def plan(captured, spec, cluster, global_batch, **pins):
    model_file, graph = captured
    return plan_graph(PlanRequest(spec, cluster, global_batch, Pins(**pins)), model_file, graph)


def local(devices):
    return load_cluster("local-cpu", devices_per_node=devices)


# ---------------------------------------------------------------------------- stage cuts


def brute_force(problem: PartitionProblem, stages: int):
    """min over all cut sets of the slowest stage, every stage within the memory cap; None if none fits."""
    best = None
    for cuts in itertools.combinations(range(1, problem.blocks), stages - 1):
        ranges = stage_ranges(cuts, problem.blocks)
        if any(problem.stage_bytes(s, i, j) > problem.cap_bytes for s, (i, j) in enumerate(ranges)):
            continue
        value = bottleneck_ps(problem, cuts)
        best = value if best is None else min(best, value)
    return best


@st.composite
def problems(draw):
    n = draw(st.integers(1, 7))
    stages = draw(st.integers(1, n))
    times = st.integers(0, 50)
    sizes = st.floats(0, 20, allow_nan=False)
    problem = PartitionProblem(
        block_time_ps=tuple(draw(st.lists(times, min_size=n, max_size=n))),
        prefix_time_ps=draw(times),
        suffix_time_ps=draw(times),
        block_fixed_bytes=tuple(draw(st.lists(sizes, min_size=n, max_size=n))),
        prefix_fixed_bytes=draw(sizes),
        suffix_fixed_bytes=draw(sizes),
        block_act_bytes=tuple(draw(st.lists(sizes, min_size=n, max_size=n))),
        prefix_act_bytes=draw(sizes),
        suffix_act_bytes=draw(sizes),
        in_flight=tuple(draw(st.lists(st.integers(1, 4), min_size=stages, max_size=stages))),
        cap_bytes=draw(st.floats(5, 120, allow_nan=False)),
    )
    return problem, stages


@settings(max_examples=300, deadline=None)
@given(problems())
def test_stage_cuts_are_exact_against_brute_force(case):
    problem, stages = case
    cuts = best_cuts(problem, stages)
    expected = brute_force(problem, stages)
    if expected is None:
        assert cuts is None
        return
    assert cuts is not None and len(cuts) == stages - 1 and list(cuts) == sorted(set(cuts))
    assert all(0 < c < problem.blocks for c in cuts)
    assert bottleneck_ps(problem, cuts) == expected
    assert all(
        problem.stage_bytes(s, i, j) <= problem.cap_bytes for s, (i, j) in enumerate(stage_ranges(cuts, problem.blocks))
    )


def test_equal_blocks_split_evenly_and_a_heavy_head_gets_its_own_room():
    assert best_cuts(PartitionProblem((10,) * 8), 4) == (2, 4, 6)
    cuts = best_cuts(PartitionProblem((10,) * 8, prefix_time_ps=0, suffix_time_ps=20), 4)
    assert bottleneck_ps(PartitionProblem((10,) * 8, 0, 20), cuts) == 30  # the last stage takes one block
    assert best_cuts(PartitionProblem((1,) * 3), 4) is None


def test_units_add_up_to_the_whole_model(gpt):
    graph = gpt[1]
    cluster = local(2)
    precision = precision_for_backend(cluster.backend)
    for recompute in ("none", "selective", "full"):
        units = unit_costs(graph, 4, recompute, cluster.device, precision.activation_bytes)
        whole = microbatch_compute(graph, 4, recompute, cluster.device, precision.activation_bytes)
        assert sum(units.forward_s) == pytest.approx(whole.forward_s)
        assert sum(units.recompute_s) == pytest.approx(whole.recompute_s)
        kept = sum(units.saved_bytes) + max(units.workspace_bytes)
        assert kept == pytest.approx(activation_bytes(graph, 4, recompute, precision), rel=1e-6)
        assert sum(units.params) == graph.param_count
        assert len(units.boundary_bytes) == len(graph.blocks) == 4


def test_in_flight_micro_batches_by_schedule():
    assert in_flight("gpipe", 8, 4, 1, 0) == 8
    assert [in_flight("1f1b", 8, 4, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 2, 4, 1, 0) == 2
    assert in_flight("interleaved-1f1b", 16, 4, 2, 0) == pytest.approx(4 * (1 + 3 / 8))  # Korthikanti et al.


# ---------------------------------------------------------------------------- pins on local-cpu


def check_pipeline(p, graph):
    blocks = [b.path for b in graph.blocks]
    stages = p.mesh.pp * p.virtual_stages
    assert len(p.split_points) == stages - 1 and len(p.stages) == stages
    positions = [blocks.index(s) for s in p.split_points]
    assert positions == sorted(set(positions)) and positions[0] > 0
    held = [m for s in p.stages for m in s.modules if m in blocks]
    assert held == blocks  # every block once, in order
    assert p.stages[0].modules[:2] == ("wte", "wpe") and p.stages[-1].modules[-2:] == ("ln_f", "lm_head")
    for s in p.stages:
        assert s.ranks == ranks_of_stage(
            p.mesh,
            s.index % p.mesh.pp
            if p.schedule not in ("zbv", "dualpipev")
            else (s.index if s.index < p.mesh.pp else 2 * p.mesh.pp - 1 - s.index),
        )
    assert p.num_microbatches >= p.mesh.pp and p.recompute == "none"
    assert p.zero_stage in ((0, 1, 3) if p.mesh.dp > 1 else (0,))  # ZeRO-2 runs as ZeRO-1 in a pipeline


def test_pin_tp_2(gpt):
    p = plan(gpt, GPT, local(4), 16, tp=2, sequence_parallel=False)  # Megatron's layout (with SP: its own tests)
    assert (p.mesh.tp, p.mesh.pp, p.mesh.dp) == (2, 1, 2) and p.schedule == "none" and p.split_points == ()
    assert p.tensor_parallel["h.0.attn.q_proj"] == "colwise" and p.tensor_parallel["h.3.mlp.c_proj"] == "rowwise"
    assert "ln_f" not in p.tensor_parallel and "needs whole tensors" in p.tensor_parallel_reasons["h.0.ln_1"]
    assert p.zero_stage in (0, 1, 2, 3)
    assert p.stages[0].ranks == (0, 1, 2, 3)


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)])
def test_pin_pp_2_with_a_schedule(gpt, schedule, virtual):
    p = plan(gpt, GPT, local(4), 16, pp=2, schedule=schedule)
    assert (p.mesh.pp, p.mesh.tp, p.mesh.dp, p.schedule, p.virtual_stages) == (2, 1, 2, schedule, virtual)
    check_pipeline(p, gpt[1])
    assert p.tensor_parallel == {} and p.predicted.bubble_s > 0
    assert p.predicted.step_time_s == pytest.approx(
        p.predicted.compute_s + p.predicted.comm_exposed_s + p.predicted.bubble_s
    )
    if schedule == "interleaved-1f1b":
        assert p.split_points == ("h.1", "h.2", "h.3")
        assert [s.ranks for s in p.stages] == [(0, 1), (2, 3), (0, 1), (2, 3)]


@pytest.mark.parametrize("schedule", ["interleaved-zb", "zbv", "dualpipev"])
def test_zero_bubble_schedules_are_planned_with_their_placement(gpt, schedule):
    p = plan(gpt, GPT, local(4), 16, dp=2, pp=2, schedule=schedule)
    assert (p.mesh.pp, p.virtual_stages, p.split_points) == (2, 2, ("h.1", "h.2", "h.3"))
    v = schedule != "interleaved-zb"
    assert [s.ranks for s in p.stages] == ([(0, 1), (2, 3), (2, 3), (0, 1)] if v else [(0, 1), (2, 3), (0, 1), (2, 3)])
    assert p.zero_stage != 3 and p.recompute != "selective"
    assert p.num_microbatches >= (4 if schedule == "dualpipev" else 2)
    split = next(s for s in lower(p) if s.op == "split_pipeline")
    assert (("placement", "v") in split.arguments) == v
    assert ("rank r keeps stages r and 3 - r (rank 0 the first and the last" in split.why) == v


def test_the_space_has_no_split_backward_that_does_not_train_like_one_process(gpt):
    from autoshard.passes.planning.space import candidate_configs

    configs = candidate_configs(gpt[1], local(4), 16, Pins())
    split = [c for c in configs if c.schedule in ("interleaved-zb", "zbv", "dualpipev")]
    assert {c.schedule for c in split} == {"interleaved-zb", "zbv", "dualpipev"}
    assert not [c for c in split if c.zero_stage == 3 or c.recompute == "selective"]
    assert [c for c in split if c.mesh.tp > 1 and c.recompute == "full"]  # verified: tests/e2e/test_pipeline_schedules
    assert all(c.num_microbatches >= 2 * c.mesh.pp for c in split if c.schedule == "dualpipev")
    assert {c.zero_stage for c in split if c.mesh.dp > 1} == {0, 1}


def test_zero_bubble_prices_a_smaller_bubble_and_more_activations(gpt):
    """On devices of their own (no shared cores) the split backward's W fills most of 1F1B's bubble,
    and every rank keeps p micro-batches of activations (1F1B: p − r)."""
    h100 = load_cluster("dgx-h100", devices_per_node=4)
    one_f_one_b = plan(gpt, GPT, h100, 64, dp=2, pp=2, schedule="1f1b", microbatch_size=4, zero=1)
    zbv = plan(gpt, GPT, h100, 64, dp=2, pp=2, schedule="zbv", microbatch_size=4, zero=1)
    izb = plan(gpt, GPT, h100, 64, dp=2, pp=2, schedule="interleaved-zb", microbatch_size=4, zero=1)
    assert 0 <= zbv.predicted.bubble_s < 0.5 * one_f_one_b.predicted.bubble_s
    assert 0 <= izb.predicted.bubble_s < one_f_one_b.predicted.bubble_s
    for p in (zbv, izb):
        assert p.predicted.step_time_s == pytest.approx(
            p.predicted.compute_s + p.predicted.comm_exposed_s + p.predicted.bubble_s
        )
    assert zbv.predicted.memory.activations_bytes > one_f_one_b.predicted.memory.activations_bytes


def test_interleaved_zero_bubble_is_shorter_than_interleaved_1f1b_run_with_the_same_stage_times(gpt):
    """GPT's end stages are heavier (embedding, head), so interleaved 1F1B's formula flatters it; run
    as orders with the same stage times (``schedule.makespan_s``) the zero-bubble one is shorter."""
    from autoshard.cost.pipeline_step import WEIGHT_GRAD_SHARE, pipeline_span_s, rank_loads, stage_action_times
    from autoshard.cost.schedule import makespan_s, rank_orders
    from autoshard.cost.tables import CostTables
    from autoshard.ir.decisions import Decisions, Mesh

    tables = CostTables(gpt[1], load_cluster("dgx-h100", devices_per_node=4))
    spans = {}
    for schedule in ("interleaved-1f1b", "interleaved-zb"):
        config = Decisions(
            mesh=Mesh(2, 1, 2), zero_stage=1, microbatch_size=4, num_microbatches=8, schedule=schedule, virtual_stages=2
        )
        loads = rank_loads(tables, config, (1, 2, 3))
        f, b, fw, bw = stage_action_times(tables, config, (1, 2, 3), loads)
        weight = [WEIGHT_GRAD_SHARE * x for x in b] if schedule == "interleaved-zb" else None
        spans[schedule] = makespan_s(
            rank_orders(schedule, 2, 8, 2), 4, [x + y for x, y in zip(f, fw)], [x + y for x, y in zip(b, bw)], weight
        )
        if weight:
            assert pipeline_span_s(tables, config, (1, 2, 3), loads) == pytest.approx(spans[schedule])
    assert spans["interleaved-zb"] < spans["interleaved-1f1b"]


def pp2_four_stages(schedule: str, recompute: str = "none"):
    """pp 2 with two stages per rank (4 micro-batches of 2): the zero-bubble tests' configuration."""
    from autoshard.ir.decisions import Decisions, Mesh

    return Decisions(
        mesh=Mesh(1, 1, 2),
        zero_stage=0,
        microbatch_size=2,
        num_microbatches=4,
        schedule=schedule,
        virtual_stages=2,
        recompute=recompute,
    )


def test_stage_cuts_are_the_configurations_own_under_a_split_backward(gpt, monkeypatch):
    """The time-optimal cuts are cached per search, and a zero-bubble schedule with full recompute prices its
    blocks' reruns twice: its partition problem is not that of the same stages without the split, so the
    cuts found for one are never handed to the other (whichever the search priced first; with two processes
    pricing, either may be)."""
    from autoshard.cost.tables import CostTables
    from autoshard.passes.planning import search as search_module

    graph = gpt[1]
    configs = {s: pp2_four_stages(s, "full") for s in ("interleaved-zb", "interleaved-1f1b")}
    solved, best = [], search_module.best_cuts
    monkeypatch.setattr(
        search_module, "best_cuts", lambda problem, stages: solved.append(problem) or best(problem, stages)
    )
    tables = CostTables(graph, local(2))
    for config in configs.values():
        search_module.time_cuts(tables, config)
    assert len(solved) == 2 and solved[0] != solved[1]  # each solved its own problem
    assert solved[1] == search_module.partition_problem(CostTables(graph, local(2)), configs["interleaved-1f1b"], False)


def test_split_backward_prices_full_recompute_once_per_pass(gpt):
    """Under a zero-bubble schedule's split backward a fully recomputed block reruns its forward once for the
    inputs' gradient and once for the weights' (torch's ``stage_backward_weight`` makes one call per op that
    reads a parameter, and the program runs them under one ``GraphExecGroup``,
    ``benchmarks/experiments/split_backward_recompute.py``): its recompute is priced twice, but on the first stage, and the
    step is slower than the same plan would be with one recompute."""
    from autoshard.cost.pipeline_step import rank_loads
    from autoshard.cost.tables import CostTables
    from autoshard.cost.tp_units import pipeline_units, weight_groups

    graph = gpt[1]
    tables = CostTables(graph, local(2))
    configs = {s: pp2_four_stages(s, "full") for s in ("interleaved-1f1b", "interleaved-zb")}
    once, split = (pipeline_units(tables, c)[0] for c in configs.values())
    groups = [weight_groups(graph, b.node_names) for b in graph.blocks]
    assert min(groups) == 8  # each GPT block: two LayerNorms and six linears (q, k, v, out, fc, proj)
    for k, g in enumerate(groups):
        assert once.recompute_s[k + 1] > 0
        assert split.recompute_s[k + 1] == pytest.approx(2 * once.recompute_s[k + 1])
    assert split.forward_s == once.forward_s and split.backward_s == once.backward_s
    none = replace(configs["interleaved-zb"], recompute="none")
    assert pipeline_units(tables, none)[0].recompute_s == tables.config_units(none).recompute_s  # nothing to rerun
    loads = {s: rank_loads(tables, c, (1, 2, 3)) for s, c in configs.items()}
    assert all(z.recompute_s > o.recompute_s for z, o in zip(loads["interleaved-zb"], loads["interleaved-1f1b"]))
    # torch runs the first stage's backward whole (its inputs need no gradient): its block reruns once. Stages
    # 0 and 2 (blocks h.0 and h.2) sit on rank 0, stages 1 and 3 (h.1, h.3) on rank 1.
    zb, plain = loads["interleaved-zb"], loads["interleaved-1f1b"]
    assert zb[0].recompute_s == pytest.approx(plain[0].recompute_s + once.recompute_s[3])
    assert zb[1].recompute_s == pytest.approx(plain[1].recompute_s + once.recompute_s[2] + once.recompute_s[4])


def test_dualpipev_reruns_only_where_its_order_splits_the_backward(gpt):
    """DualPipeV runs most backwards whole (its overlapped F + B pairs) and splits some into I and W
    (``schedule.split_backward_share``, counted from its order): a stage's blocks are priced to rerun
    1 + σ_s times, σ_s that stage's split share; interleaved-zb and zbv split every backward."""
    from autoshard.cost.pipeline_step import stage_pipeline_units
    from autoshard.cost.schedule import rank_orders, split_backward_share
    from autoshard.cost.tables import CostTables
    from autoshard.cost.tp_units import pipeline_units, weight_groups

    assert split_backward_share("zbv", 2, 4, 2) == (1.0, 1.0, 1.0, 1.0)
    share = split_backward_share("dualpipev", 2, 4, 2)
    orders = rank_orders("dualpipev", 2, 4, 2)
    for stage, sigma in enumerate(share):
        kinds = [a.kind for order in orders for a in order if a.stage == stage and a.kind in "IB"]
        assert sigma == kinds.count("I") / len(kinds)
    assert 0 < min(share) and max(share) < 1
    graph = gpt[1]
    tables = CostTables(graph, local(2))
    config = pp2_four_stages("dualpipev", "full")
    once = pipeline_units(tables, config, first_stage=True)[0]
    groups = [weight_groups(graph, b.node_names) for b in graph.blocks]
    for stage in (1, 2, 3):  # one block per stage with cuts (1, 2, 3); stage s holds unit s + 1
        units = stage_pipeline_units(tables, config, stage)
        u = stage + 1
        assert groups[stage] > 0
        assert units.recompute_s[u] == pytest.approx((1 + share[stage]) * once.recompute_s[u])
    assert stage_pipeline_units(tables, config, 0).recompute_s == once.recompute_s


def test_a_split_backward_holds_every_checkpointed_blocks_rerun_of_its_stage(in_repo_module):
    """The weight pass reruns each checkpointed block under one group, and what a rerun's pass does not read stays
    until the stage's graph is freed: a stage whose backward is split holds its blocks' recompute workspaces
    summed, where one run whole holds one block's at a time (the first stage; the non-split schedules)."""
    from autoshard.cost.experts import unit_expert_costs
    from autoshard.cost.pipeline_step import stage_load
    from autoshard.cost.schedule import stage_owners
    from autoshard.cost.tables import CostTables
    from autoshard.cost.tp_units import pipeline_units

    _, graph = capture_graph("tests/models/hf_llama.py:build_8_layers")
    tables = CostTables(graph, local(2))
    cuts = (2, 4, 6)  # two blocks per stage
    for schedule, recompute in itertools.product(("zbv", "interleaved-1f1b"), ("full", "none")):
        config = pp2_four_stages(schedule, recompute)
        units = pipeline_units(tables, config)[0]
        owner = stage_owners(schedule, 2, 2)
        for index, rng in enumerate(stage_ranges(cuts, units.blocks)):
            blocks = [units.workspace_bytes[u] for u in stage_units(rng, units.blocks) if 0 < u <= units.blocks]
            load = stage_load(tables, config, units, unit_expert_costs(tables, config), index, rng, owner)
            assert len(blocks) == 2
            split = schedule == "zbv" and recompute == "full" and index > 0
            assert load.workspace_bytes == (sum(blocks) if split else max(blocks))
            assert (load.workspace_bytes > 0) == (recompute == "full")


def test_the_split_backward_costs_an_autograd_call_per_parameter_group(gpt):
    """A zero-bubble stage's weight pass makes one autograd call per parameter group (``stage_backward_weight``):
    σ_s · G_s · weight_group_us of host time per micro-batch on each stage but the first (whose backward torch
    runs whole), nothing where the cluster has no such figure or the schedule does not split."""
    from autoshard.cost.pipeline_step import rank_loads
    from autoshard.cost.schedule import rank_stages
    from autoshard.cost.tables import CostTables
    from autoshard.cost.tp_units import unit_weight_groups

    graph = gpt[1]
    base = local(2)
    priced = replace(base, host=replace(base.host, weight_group_us=100.0))
    config = pp2_four_stages("zbv")
    cuts = (1, 2, 3)  # one block per stage: stage s holds unit s + 1, the first also the prefix, the last the suffix
    groups = unit_weight_groups(graph)
    assert groups[1:-1] == (8,) * len(graph.blocks)  # GPT's blocks: two LayerNorms and six linears
    stage_groups = [groups[0] + groups[1], groups[2], groups[3], groups[4] + groups[5]]
    plain = rank_loads(CostTables(graph, base), config, cuts)
    split = rank_loads(CostTables(graph, priced), config, cuts)
    for r in range(2):
        extra = sum(stage_groups[s] * 100e-6 for s in rank_stages("zbv", 2, 2, r) if s != 0)
        assert split[r].host_s - plain[r].host_s == pytest.approx(extra)
    one_f_one_b = replace(config, schedule="interleaved-1f1b")
    same = [r.host_s for r in rank_loads(CostTables(graph, priced), one_f_one_b, cuts)]
    assert same == [r.host_s for r in rank_loads(CostTables(graph, base), one_f_one_b, cuts)]


def test_v_placement_prices_the_first_and_last_stage_on_rank_0(gpt):
    from autoshard.cost.pipeline_step import rank_loads
    from autoshard.cost.tables import CostTables

    tables = CostTables(gpt[1], local(2))
    looped, vee = (pp2_four_stages(s) for s in ("interleaved-zb", "zbv"))
    units = tables.config_units(looped)
    ranges = stage_ranges((1, 2, 3), units.blocks)
    params = [sum(units.params[u] for u in stage_units(r, units.blocks)) for r in ranges]
    loop_loads, v_loads = rank_loads(tables, looped, (1, 2, 3)), rank_loads(tables, vee, (1, 2, 3))
    assert [r.params for r in loop_loads] == [params[0] + params[2], params[1] + params[3]]
    assert [r.params for r in v_loads] == [params[0] + params[3], params[1] + params[2]]
    # Equal boundaries (b·s·h): looped, rank 1 receives two (stages 1 and 3); in a V one each, the tip
    # (stages 1 and 2, both on rank 1) sending nothing between them.
    assert loop_loads[1].p2p_s == pytest.approx(2 * loop_loads[0].p2p_s)
    assert v_loads[0].p2p_s == pytest.approx(v_loads[1].p2p_s) == pytest.approx(loop_loads[0].p2p_s)


def test_pin_pp_4_puts_one_block_per_stage(gpt):
    p = plan(gpt, GPT, local(4), 16, pp=4)
    assert p.mesh.dp == 1 and p.zero_stage == 0 and p.split_points == ("h.1", "h.2", "h.3")
    check_pipeline(p, gpt[1])


def test_schedule_pin_is_case_insensitive(gpt):
    assert plan(gpt, GPT, local(4), 16, pp=2, schedule="1F1B").schedule == "1f1b"


def test_replans_are_byte_identical(gpt):
    for pins in ({}, {"tp": 2}, {"pp": 2, "schedule": "interleaved-1f1b"}):
        a = plan(gpt, GPT, local(4), 16, **pins).to_json()
        b = plan(gpt, GPT, local(4), 16, **pins).to_json()
        assert a == b


def test_alternatives_span_meshes(gpt):
    p = plan(gpt, GPT, local(4), 16)
    meshes = {(a.mesh.dp, a.mesh.tp, a.mesh.pp) for a in p.alternatives} | {(p.mesh.dp, p.mesh.tp, p.mesh.pp)}
    assert {(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)} <= meshes
    assert all(a.why_not for a in p.alternatives)


def test_tensor_parallel_inside_pipeline_stages(gpt):
    """TP x PP: the stages are split over tp as without pipelining, so the per-rank stage time drops."""
    both = plan(gpt, GPT, local(4), 16, tp=2, schedule="1f1b")
    pp_only = plan(gpt, GPT, local(2), 16, pp=2, schedule="1f1b")
    assert (both.mesh.dp, both.mesh.tp, both.mesh.pp) == (1, 2, 2) and both.split_points
    sharded = {m: s for m, s in both.tensor_parallel.items() if s != "replicate"}
    assert sharded, "the stages are tensor parallel"
    assert both.predicted.memory.params_bytes < pp_only.predicted.memory.params_bytes


REFUSED = [
    ({"tp": 3}, "must divide the 4 devices per node"),
    ({"pp": 1, "schedule": "gpipe"}, "needs pipeline stages but --pp 1 is pinned"),
    ({"pp": 2, "schedule": "none"}, "pipelines need one of"),
    ({"pp": 2, "zero": 2}, "--zero 2 with pipeline stages runs as ZeRO-1"),
    ({"dp": 1, "tp": 4, "zero": 1}, "--zero 1 with --dp 1 has nothing to shard over"),
    ({"dp": 4, "zero": 3, "dp_replicate": 3}, "--dp-replicate 3 must divide --dp 4"),
    ({"dp": 2, "pp": 2, "dp_replicate": 2}, "(HSDP) is planned without pipeline stages"),
    ({"dp": 4, "zero": 1, "dp_replicate": 2}, "shards with FSDP2: pin --zero 2 or 3"),
    ({"schedule": "zigzag"}, "--schedule zigzag must be one of"),
    (
        {"dp": 2, "pp": 2, "schedule": "zbv", "zero": 3},
        "--schedule zbv with --zero 3: FSDP2 reshards each stage and reduce-scatters its gradients when the input",
    ),
    (
        {"pp": 2, "schedule": "interleaved-zb", "recompute": "selective"},
        "--schedule interleaved-zb with --recompute selective: its policy lets a recomputed region run backward once",
    ),
    (
        {"dp": 2, "pp": 2, "schedule": "dualpipev", "microbatch_size": 4},
        "--microbatch-size 4 leaves 2 micro-batches per rank: dualpipev needs at least 2·pp = 4 micro-batches",
    ),
    ({"pp": 2, "schedule": "zbv", "virtual_stages": 3}, "it puts exactly 2 stages on each rank, in a V"),
    ({"pp": 4, "schedule": "zbv"}, "--schedule zbv puts 2 stages on each of --pp 4 ranks: needs 8 blocks"),
    (
        {"dp": 2, "pp": 2, "schedule": "dualpipev", "global_batch": 6},
        "dualpipev needs at least 2·pp = 4 micro-batches, and the per-rank batch 3 (dp=2) gives at most 3; "
        "use --global-batch 8 or more",
    ),
    ({"dp": 2, "tp": 1, "pp": 1}, "pin degrees whose product is 4"),
    ({"pp": 8}, "pin degrees whose product divides 4"),
]


@pytest.mark.parametrize("pins, message", REFUSED, ids=[m for _, m in REFUSED])
def test_pins_outside_the_runtime_are_refused(gpt, pins, message):
    pins = dict(pins)
    batch = pins.pop("global_batch", 16)
    with pytest.raises(AutoshardError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan(gpt, GPT, local(4), batch, **pins)


def test_zero0_and_zero1_beside_tp_and_pp_are_planned_and_lowered(gpt):
    """ZeRO-0 / ZeRO-1 with tp or pp run on FSDP2's machinery (ir.decisions.DP_RUNTIMES), never DDP."""
    for pins, op, arguments in (
        ({"dp": 2, "tp": 2, "zero": 0}, "apply_replicate", {}),
        ({"dp": 2, "tp": 2, "zero": 1}, "apply_fsdp", {"sync_every_microbatch": False}),
        ({"dp": 2, "pp": 2, "zero": 0, "schedule": "1f1b"}, "apply_replicate", {}),
        ({"dp": 2, "pp": 2, "zero": 1, "schedule": "1f1b"}, "apply_fsdp", {"reshard_after_forward": False}),
    ):
        p = plan(gpt, GPT, local(4), 16, microbatch_size=2, **pins)
        steps = {s.op: s for s in lower(p)}
        assert op in steps and "apply_ddp" not in steps, pins
        assert arguments.items() <= steps[op].kwargs.items(), (pins, steps[op].kwargs)
        assert p.predicted.comm_total_s > 0, pins


def test_zero1_beside_tp_communicates_once_per_step_and_zero2_every_microbatch(gpt):
    """Megatron's distributed optimizer: one gather and one reduce-scatter per step, so with m
    micro-batches ZeRO-1 moves 1/m of ZeRO-2's dp bytes and keeps whole gradients (more memory)."""
    one, two = (plan(gpt, GPT, local(4), 16, dp=2, tp=2, zero=z, microbatch_size=2) for z in (1, 2))
    assert one.num_microbatches == 4
    assert one.predicted.comm_total_s < two.predicted.comm_total_s
    assert one.predicted.memory.grads_bytes > two.predicted.memory.grads_bytes


def test_hsdp_is_searched_where_dp_spans_nodes_and_shards_inside_a_node(gpt):
    """Two nodes of 2: dp = 4 may run as HSDP 2 x 2 (FSDP2 over a node's 2 ranks, all-reduce across
    the nodes); the plan records it, the steps pass the replicas, and its state is sharded 2 ways, not 4."""
    cluster = load_cluster("local-cpu", nodes=2, devices_per_node=2)
    hsdp = plan(gpt, GPT, cluster, 16, dp=4, zero=3, dp_replicate=2)
    flat = plan(gpt, GPT, cluster, 16, dp=4, zero=3, dp_replicate=1)
    assert (hsdp.dp_replicate, flat.dp_replicate) == (2, 1)
    fsdp = next(s for s in lower(hsdp) if s.op == "apply_fsdp")
    assert (
        fsdp.kwargs["replicas"] == 2 and "replicas" not in next(s for s in lower(flat) if s.op == "apply_fsdp").kwargs
    )
    assert hsdp.predicted.memory.optimizer_bytes == pytest.approx(2 * flat.predicted.memory.optimizer_bytes, rel=0.01)
    unpinned = plan(gpt, GPT, cluster, 16, dp=4, zero=3)
    assert unpinned.dp_replicate in (1, 2)
    with pytest.raises(AutoshardError, match="HSDP"):
        plan(gpt, GPT, local(4), 16, dp=4, zero=3, dp_replicate=2)


def test_pins_that_need_the_graph(gpt):
    with pytest.raises(AutoshardError, match="--pp 8 needs at least 8 blocks"):
        plan(gpt, GPT, local(8), 16, pp=8)
    with pytest.raises(AutoshardError, match="interleaved-1f1b puts 2 stages on each of --pp 4"):
        plan(gpt, GPT, local(4), 16, pp=4, schedule="interleaved-1f1b")
    with pytest.raises(AutoshardError, match="--microbatch-size 3 does not divide"):
        plan(gpt, GPT, local(4), 16, pp=2, microbatch_size=3)


def test_cli_plans_recompute_inside_pipeline_stages(in_repo, capsys):
    code = main(
        [
            "plan",
            GPT,
            "--cluster",
            "local-cpu",
            "--devices-per-node",
            "4",
            "--global-batch",
            "16",
            "--tp",
            "2",
            "--pp",
            "2",
            "--recompute",
            "full",
            "--json",
        ]
    )
    out, _ = capsys.readouterr()
    decisions = json.loads(out)["decisions"]
    assert code == 0 and decisions["recompute"] == "full" and decisions["mesh"] == {"dp": 1, "tp": 2, "pp": 2}


def test_cli_plans_gpt_on_two_local_devices(in_repo, capsys):
    code = main(["plan", GPT, "--cluster", "local-cpu", "--devices-per-node", "2", "--global-batch", "16", "--json"])
    out, _ = capsys.readouterr()
    mesh = json.loads(out)["decisions"]["mesh"]
    assert code == 0 and mesh["dp"] * mesh["tp"] * mesh["pp"] == 2


# ---------------------------------------------------------------------------- a model DP alone cannot hold


@pytest.fixture(scope="module")
def deep(in_repo_module):
    return capture_graph(DEEP)


def test_wide_gpt_on_two_dgx_a100_nodes_needs_tp_or_pp(deep):
    cluster = load_cluster("dgx-a100-80gb", nodes=2)
    p = plan(deep, DEEP, cluster, 64)
    assert p.mesh.tp > 1 or p.mesh.pp > 1
    assert p.predicted.memory_peak_bytes_per_rank <= cluster.device.memory_bytes
    for mesh in [p.mesh] + [a.mesh for a in p.alternatives]:
        assert cluster.devices_per_node % mesh.tp == 0  # TP stays inside a node
    dp_only = [a for a in p.alternatives if a.mesh.tp == a.mesh.pp == 1]
    assert dp_only and all("does not fit" in a.why_not for a in dp_only)


def test_wide_gpt_with_dp_only_pinned_suggests_tp_and_pp(wide, deep):
    cluster = load_cluster("dgx-a100-80gb", nodes=2)
    with pytest.raises(AutoshardError, match=r"no plan fits in memory.*--tp 8.*--pp 8"):
        plan(deep, DEEP, cluster, 64, tp=1, pp=1, offload="none")  # host offload would let it fit
    offloaded = plan(deep, DEEP, cluster, 64, tp=1, pp=1)
    assert offloaded.decisions.offload == "cpu" and offloaded.zero_stage == 3
    with pytest.raises(AutoshardError, match="stays inside a node"):
        plan(wide, WIDE, cluster, 64, tp=16)


def test_wide_gpt_pipeline_pin_balances_stages(wide):
    cluster = load_cluster("dgx-a100-80gb", nodes=2)
    p = plan(wide, WIDE, cluster, 64, pp=8, schedule="1f1b")
    assert p.split_points == tuple(f"h.{k}" for k in range(1, 8))  # equal blocks: one per stage
    assert p.stages[1].ranks == (2, 3)  # pp rank 1 holds its dp × tp = 2 ranks
    with pytest.raises(AutoshardError, match=r"no plan fits in memory.*--tp 8"):
        plan(wide, WIDE, cluster, 64, pp=4, tp=1)  # four stages of 10B parameters each do not fit
    both = plan(wide, WIDE, cluster, 64, pp=4)  # unless tp splits them
    assert both.mesh.tp > 1 and both.predicted.memory_peak_bytes_per_rank <= cluster.device.memory_bytes


def test_tp_plans_do_not_depend_on_the_hash_seed(in_repo, tmp_path):
    """Same inputs, byte-identical plans, whatever order Python's string hashing gives sets: a TP plan
    (styles and reasons for every block) planned in processes with different hash seeds."""
    outputs = set()
    for seed in ("0", "1", "7", "42", "1234"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "AUTOSHARD_CACHE_DIR": str(tmp_path)}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "autoshard.cli",
                "plan",
                GPT,
                "--cluster",
                FAST_LINK,
                "--devices-per-node",
                "2",
                "--global-batch",
                "8",
                "--tp",
                "2",
                "--json",
            ],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        assert json.loads(proc.stdout)["review"]["tensor_parallel_reasons"]
        outputs.add(proc.stdout)
    assert len(outputs) == 1


def test_split_backward_is_refused_where_it_would_drop_part_of_a_gradient(in_repo_module):
    """T5 hands its relative position bias (made from positions and a weight) from block to block: on a
    stage after the first, torch's split backward finds that weight's gradient only where it meets the
    stage's inputs, and the part coming back from the next stage would be dropped (it crashed with
    "a tied copy got no gradient" on 2 CPU ranks). GPT's weights all meet the residual stream."""
    from autoshard.passes.planning.space import candidate_configs
    from autoshard.passes.planning.strategies import split_backward_graph_refusal

    t5 = capture_graph("tests/models/hf_t5.py:build")
    assert "relative_attention_bias.weight reaches" in split_backward_graph_refusal(t5[1])
    with pytest.raises(AutoshardError, match="--schedule zbv splits backward, but encoder.block.0"):
        plan(t5, "tests/models/hf_t5.py:build", local(2), 8, pp=2, schedule="zbv")
    assert not [
        c
        for c in candidate_configs(t5[1], local(2), 8, Pins(pp=2))
        if c.schedule in ("interleaved-zb", "zbv", "dualpipev")
    ]
    assert plan(t5, "tests/models/hf_t5.py:build", local(2), 8, pp=2).schedule in ("gpipe", "1f1b", "interleaved-1f1b")
    assert split_backward_graph_refusal(capture_graph(GPT)[1]) == ""


# ---------------------------------------------------------------------------- sequence parallelism in stages


def tp2_pp2(sequence_parallel: bool):
    """tp 2 x pp 2, 1F1B over 4 micro-batches of 2, with or without sequence parallelism."""
    from autoshard.ir.decisions import Decisions, Mesh

    return Decisions(Mesh(1, 2, 2), 0, 2, 4, schedule="1f1b", sequence_parallel=sequence_parallel)


def test_sequence_parallel_is_a_choice_inside_pipeline_stages(gpt):
    """tp > 1 offers sequence parallelism with or without stages; the pinned plan's stages run its styles."""
    from autoshard.ir.decisions import Mesh
    from autoshard.passes.planning.strategies import sequence_parallel_choices
    from autoshard.show import sequence_text

    assert sequence_parallel_choices(Mesh(1, 2, 2)) == (False, True)
    assert sequence_parallel_choices(Mesh(2, 1, 2)) == (False,)
    p = plan(
        gpt, GPT, load_cluster(FAST_LINK, devices_per_node=4), 16, tp=2, pp=2, schedule="1f1b", sequence_parallel=True
    )
    assert p.sequence_parallel and p.mesh.pp == 2 and p.split_points
    assert p.tensor_parallel["h.0.attn.c_proj"] == "rowwise-seq-output-dim1"
    assert "a pipeline boundary between them sends 1/2 of the tokens" in sequence_text(p)  # autoshard inspect


def test_sequence_parallel_stages_send_and_keep_a_tp_share_of_the_boundary(gpt):
    """With sequence parallelism the residual stream between blocks is each TP rank's 1/tp of the tokens: a
    pipeline boundary there sends (and its receive buffer holds) half of what it does without, at tp 2; the
    stages' saved activations are smaller, and the rank's p2p time with them."""
    from autoshard.cost.pipeline_step import rank_loads, stage_buffer_bytes
    from autoshard.cost.tables import CostTables
    from autoshard.cost.tp_units import boundary_shares, pipeline_units
    from autoshard.passes.planning.tp_layout import hand_tp_layout

    tables = CostTables(gpt[1], load_cluster(FAST_LINK, devices_per_node=4))
    off, on = tp2_pp2(False), tp2_pp2(True)
    for config in (off, on):
        hand_tp_layout(tables, config)
    assert boundary_shares(tables, off) == (1.0,) * 4
    assert boundary_shares(tables, on)[1:] == (0.5,) * 3  # h.0 takes its input whole and slices it itself
    whole, sharded = pipeline_units(tables, off)[0], pipeline_units(tables, on)[0]
    assert [s * 2 for s in sharded.boundary_bytes[1:]] == pytest.approx(whole.boundary_bytes[1:], rel=1e-3)
    assert sum(sharded.saved_bytes) < sum(whole.saved_bytes)
    owner = [0, 1]
    assert stage_buffer_bytes(tables, on, 1, (2, 4), owner) < stage_buffer_bytes(tables, off, 1, (2, 4), owner)
    loads = {c.sequence_parallel: rank_loads(tables, c, (2,)) for c in (off, on)}
    assert loads[True][1].p2p_s < loads[False][1].p2p_s
    assert loads[True][1].memory.activations_bytes < loads[False][1].memory.activations_bytes


def test_sequence_parallel_beside_cp_in_stages_is_searched_and_sends_a_tp_share_of_a_cp_ranks_tokens(gpt):
    """tp x pp x cp: the stages are traced on a cp rank's tokens, which sequence parallelism splits again over tp.
    Priced as the sequence-parallel stages of the micro-batch's b/cp samples (``cp_equivalent``): at tp 2 a boundary
    sends half of a cp rank's tokens, and the stages keep fewer activations."""
    from autoshard.cost.context_parallel import cp_equivalent
    from autoshard.cost.tables import CostTables
    from autoshard.cost.tp_units import pipeline_units
    from autoshard.ir.decisions import Decisions, Mesh
    from autoshard.passes.planning.strategies import sequence_parallel_choices
    from autoshard.passes.planning.tp_layout import hand_tp_layout

    assert sequence_parallel_choices(Mesh(tp=2, pp=2, cp=2)) == (False, True)
    tables = CostTables(gpt[1], load_cluster(FAST_LINK, devices_per_node=8))
    off, on = (
        cp_equivalent(Decisions(Mesh(tp=2, pp=2, cp=2), 0, 2, 4, schedule="1f1b", sequence_parallel=sp))
        for sp in (False, True)
    )
    for config in (off, on):
        hand_tp_layout(tables, config)
    whole, sharded = pipeline_units(tables, off)[0], pipeline_units(tables, on)[0]
    assert [s * 2 for s in sharded.boundary_bytes[1:]] == pytest.approx(whole.boundary_bytes[1:], rel=1e-3)
    assert sum(sharded.saved_bytes) < sum(whole.saved_bytes)
    fast = load_cluster(FAST_LINK, devices_per_node=8)
    pinned = plan(gpt, GPT, fast, 16, dp=1, tp=2, pp=2, cp=2, schedule="1f1b", sequence_parallel=True)
    assert pinned.sequence_parallel and (pinned.mesh.cp, pinned.mesh.pp) == (2, 2)
