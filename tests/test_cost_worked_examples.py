"""The worked examples and published figures of docs/reference-numbers.md, computed
with autoshard's own cost functions (ring all-reduce traffic and times, ZeRO memory per stage,
pipeline bubbles, and the activation figures the memory model uses).

Already covered elsewhere, not repeated here: 64 MiB over 8 ranks → 112 MiB per rank and the
six ring times at 900 / 50 GB/s, reduce-scatter / all-gather = half (tests/test_comm.py);
32 KiB ≈ 18 µs on 8×H200 and 8 B / 1 MiB over 32 A100 ranks on HDR IB (tests/test_comm.py);
ZeRO-1 7.5B/64 = 31.4 GB, 12B/8 DP 192 GB and ZeRO-3 24 GB (tests/test_memory.py); the
simulated bubble (p−1)/(v·m + p−1) for a few (p, m, v) (tests/test_schedule.py).

The alpha-beta model misses some nccl-tests measurements by more than 20 %; those are strict
xfails below, each naming the gap, so that a calibration that closes one shows up as XPASS.
"""

import random
from dataclasses import fields, replace
from pathlib import Path

import pytest

from autoshard.cost import comm
from autoshard.cost.compute import ComputeTime
from autoshard.cost.dp_comm import dp_collective_s, dp_comm_time
from autoshard.cost.hardware import PRESETS, load_cluster
from autoshard.cost.memory import BF16_AUTOCAST, FP32, MEGATRON_MIXED, model_state_bytes
from autoshard.cost.pipeline_step import rank_loads, stage_action_times
from autoshard.cost.rank_memory import in_flight
from autoshard.cost.schedule import bubble_fraction, makespan_s, rank_orders, shared_makespan_s, simulate
from autoshard.cost.step import price
from autoshard.cost.tables import CostTables
from autoshard.cost.tp import tp_activation_fraction
from autoshard.cost.units import unit_costs
from autoshard.ir.decisions import Decisions, Mesh
from autoshard.ir.topology import Cluster, LinkSpec
from autoshard.passes.planning.search import lower_bound_s
from autoshard.pipeline import capture_graph

ROOT = Path(__file__).resolve().parent.parent
MiB, GiB, GB = 2**20, 2**30, 1e9
H100 = PRESETS["dgx-h100"]
A100 = PRESETS["dgx-a100-80gb"]


def busbw_gbps(size_bytes: float, ranks: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: algbw · 2(n−1)/n (docs/reference-numbers.md, Hardware)."""
    return size_bytes / seconds * 2 * (ranks - 1) / ranks / 1e9


# ------------------------------------------------------------------ ring all-reduce


def test_busbw_of_the_64mib_worked_example_is_the_link_bandwidth():
    """docs/reference-numbers.md, Formulas / Ring all-reduce and Hardware ("busbw = algbw · 2(n−1)/n"): 64 MiB over
    8 ranks at 900 GB/s takes ≈ 0.13 ms, and with α = 0 its bus bandwidth is the link's 900 GB/s,
    which is why comm.py's B is comparable to a measured busbw."""
    link = LinkSpec(900.0, 0.0, "docs/reference-numbers.md worked example")
    t = comm.ring_allreduce_s(64 * MiB, 8, link)
    assert t == pytest.approx(0.13e-3, rel=0.03)
    assert busbw_gbps(64 * MiB, 8, t) == pytest.approx(900.0)
    assert comm.ring_allreduce_bytes_per_rank(64 * MiB, 8) / t == pytest.approx(900e9)


def test_2gb_is_1b_bf16_params():
    """docs/reference-numbers.md, Formulas / Ring all-reduce: "2 GB (1B params, bf16) at 900 GB/s ≈ 3.9 ms; at
    50 GB/s ≈ 70 ms" — the gradient bytes of 1B parameters in autoshard's bf16 precision."""
    grads = model_state_bytes(10**9, 0, 8, MEGATRON_MIXED)[1]
    assert grads == 2e9
    assert comm.allreduce_s(grads, 8, LinkSpec(900.0, 0.0, "t")) == pytest.approx(3.9e-3, rel=0.03)
    assert comm.allreduce_s(grads, 8, LinkSpec(50.0, 0.0, "t")) == pytest.approx(70e-3, rel=0.03)


@pytest.mark.parametrize(
    "size_bytes, measured_gbps",
    [
        (1 * MiB, 72.0),
        (128 * MiB, 411.0),
        (1 * GiB, 464.0),
        (16 * GiB, 481.0),
    ],
)
def test_nccl_tests_8xh200_busbw_on_the_nvlink4_preset(size_bytes, measured_gbps):
    """docs/reference-numbers.md, Hardware: nccl-tests all-reduce on 8×H200 in one node (NVLink 4, as the dgx-h100
    preset's intra-node link): busbw 1 MiB 72, 128 MiB 411, 1 GiB 464, 16 GiB 481 GB/s; the model
    is within 20 % (1 MiB +15 %, the large sizes within 7 %)."""
    t = comm.allreduce_s(size_bytes, 8, H100.intra_node)
    assert busbw_gbps(size_bytes, 8, t) == pytest.approx(measured_gbps, rel=0.2)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="alpha-beta gap: at 16 MiB the model's busbw is 353 GB/s against the "
    "measured 242 (+46 %); NCCL's protocol and channel ramp-up is not in α + S/B",
)
def test_nccl_tests_8xh200_busbw_16mib():
    """docs/reference-numbers.md, Hardware: 8×H200 all-reduce busbw at 16 MiB is 242 GB/s."""
    t = comm.allreduce_s(16 * MiB, 8, H100.intra_node)
    assert busbw_gbps(16 * MiB, 8, t) == pytest.approx(242.0, rel=0.2)


def test_nccl_8xa100_large_message_busbw():
    """docs/reference-numbers.md, Hardware: NCCL all-reduce on 8×A100 in one node ≈ 235 GB/s busbw for large messages
    (the dgx-a100-80gb preset's NVLink 3 link is that measured busbw, not the 300 GB/s spec)."""
    t = comm.allreduce_s(1 * GiB, 8, A100.intra_node)
    assert busbw_gbps(1 * GiB, 8, t) == pytest.approx(235.0, rel=0.2)


def a100_dp32_allreduce_s(size_bytes: float) -> float:
    """A dp = 32 all-reduce on 4 DGX A100 nodes as the planner prices it (flat or two-level)."""
    return dp_collective_s("allreduce", size_bytes, Mesh(dp=32), load_cluster("dgx-a100-80gb", nodes=4))


def test_nccl_tests_32_a100_8_byte_latency_as_the_planner_prices_it():
    """docs/reference-numbers.md, Hardware: all-reduce of 8 B over 32 A100 ranks on HDR IB takes 55-58 µs; the
    planner's DP collective (``dp_comm.dp_collective_s`` on dgx-a100-80gb × 4 nodes) says ≈ 60 µs."""
    assert a100_dp32_allreduce_s(8) == pytest.approx(56.5e-6, rel=0.1)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="two-level gap: dp_collective_s picks the hierarchical form on 4 DGX A100 "
    "nodes, 82 µs for 1 MiB against the measured 143 µs (−43 %; the flat fit gives 141 µs); "
    "cost/dp_comm.py's choice or the latency terms would need to change",
)
def test_nccl_tests_32_a100_1mib_as_the_planner_prices_it():
    """docs/reference-numbers.md, Hardware: all-reduce of 1 MiB over 32 A100 ranks on HDR IB takes 143 µs."""
    assert a100_dp32_allreduce_s(MiB) == pytest.approx(143e-6, rel=0.2)


def test_nccl_tests_32_a100_8gib_busbw_as_the_planner_prices_it():
    """docs/reference-numbers.md, Hardware: all-reduce of 8 GiB over 32 A100 ranks on HDR IB: busbw 116 GB/s; the
    planner's two-level form (NVLink 3 at its measured 235 GB/s busbw) gives ≈ 130 (+12 %)."""
    assert busbw_gbps(8 * GiB, 32, a100_dp32_allreduce_s(8 * GiB)) == pytest.approx(116.0, rel=0.2)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="two-level gap: dp_collective_s gives busbw 125 GB/s at 128 MiB "
    "against the measured 99 (+27 %); the flat ring on the 25 GB/s NIC share gives 25, far below: "
    "neither form matches NCCL's multi-channel rings over 8 NICs at mid sizes",
)
def test_nccl_tests_32_a100_128mib_busbw_as_the_planner_prices_it():
    """docs/reference-numbers.md, Hardware: all-reduce of 128 MiB over 32 A100 ranks on HDR IB: busbw 99 GB/s."""
    assert busbw_gbps(128 * MiB, 32, a100_dp32_allreduce_s(128 * MiB)) == pytest.approx(99.0, rel=0.2)


# ------------------------------------------------------------------ ZeRO model state


def state_gb(params: float, stage: int, dp: int, precision=MEGATRON_MIXED) -> float:
    return sum(model_state_bytes(params, stage, dp, precision)) / GB


@pytest.mark.parametrize("params, dp", [(7.5e9, 64), (12e9, 8), (1e9, 16), (175e9, 1024), (3e9, 1)])
def test_zero_formulas_every_stage(params, dp):
    """docs/reference-numbers.md, Formulas / Model state per rank (K = 12): DP 16Ψ; ZeRO-1 4Ψ + 12Ψ/N_d;
    ZeRO-2 2Ψ + 14Ψ/N_d; ZeRO-3 16Ψ/N_d."""
    psi = params / GB
    assert state_gb(params, 0, dp) == pytest.approx(16 * psi)
    assert state_gb(params, 1, dp) == pytest.approx(4 * psi + 12 * psi / dp)
    assert state_gb(params, 2, dp) == pytest.approx(2 * psi + 14 * psi / dp)
    assert state_gb(params, 3, dp) == pytest.approx(16 * psi / dp)


def test_zero_paper_7_5b_on_64_ranks_every_stage():
    """docs/reference-numbers.md, Formulas / Model state per rank, the 7.5B, N_d = 64 example (ZeRO paper, Figure 1):
    DP 120 GB, ZeRO-1 31.4 GB, ZeRO-2 16.6 GB, ZeRO-3 1.9 GB."""
    assert [round(state_gb(7.5e9, stage, 64), 1) for stage in range(4)] == [120.0, 31.4, 16.6, 1.9]


def test_12b_on_8_ranks_zero1_and_zero2():
    """docs/reference-numbers.md, Formulas / Model state per rank, the 12B, N_d = 8 example between its two given
    ends (DP 192 GB, ZeRO-3 24 GB): ZeRO-1 48 + 18 = 66 GB, ZeRO-2 24 + 21 = 45 GB."""
    assert state_gb(12e9, 1, 8) == pytest.approx(66.0)
    assert state_gb(12e9, 2, 8) == pytest.approx(45.0)


@pytest.mark.parametrize("precision", [FP32, BF16_AUTOCAST, MEGATRON_MIXED])
def test_every_precision_keeps_16_bytes_per_param(precision):
    """docs/reference-numbers.md, Formulas / Model state per rank (16Ψ for DP, 16Ψ/N_d for ZeRO-3), in all three of
    autoshard's precisions (memory.py: the emitted programs' (4, 4, 8) is the same 16Ψ split differently)."""
    assert state_gb(12e9, 0, 8, precision) == pytest.approx(192.0)
    assert state_gb(12e9, 3, 8, precision) == pytest.approx(24.0)


@pytest.fixture(scope="module")
def mlp_graph():
    return capture_graph(f"{ROOT / 'tests/models/mlp.py'}:build", use_cache=True, proofs=False)[1]


def test_zero3_communicates_1_5x_dp(mlp_graph):
    """docs/reference-numbers.md, Formulas / Model state per rank: "ZeRO-3 communication is 1.5× DP's (3Ψ vs 2Ψ)",
    from ``dp_comm.dp_comm_time`` in Megatron's bf16 precision on a latency-free node; ZeRO-2 moves the
    same 2Ψ as DP (reduce-scatter + all-gather)."""
    link = LinkSpec(900.0, 0.0, "t")
    cluster = Cluster("t", 1, 8, H100.device, link, LinkSpec(50.0, 0.0, "t"), "nccl")
    psi, idle = 1e9, ComputeTime(0.0, 0.0, 0.0)

    def total_s(zero):
        config = Decisions(mesh=Mesh(dp=8), zero_stage=zero, microbatch_size=1, num_microbatches=1)
        return dp_comm_time(mlp_graph, cluster, config, idle, MEGATRON_MIXED, psi).total_s

    assert total_s(0) == pytest.approx(comm.ring_allreduce_s(2 * psi, 8, link))
    assert total_s(2) == pytest.approx(total_s(0))
    assert total_s(3) == pytest.approx(1.5 * total_s(0))


# ------------------------------------------------------------------ activations (Korthikanti et al.)

GPT_S, GPT_H, GPT_LAYERS = 64, 64, 4  # examples/gpt.py's default config


@pytest.fixture(scope="module")
def gpt_graph():
    return capture_graph(f"{ROOT / 'examples/gpt.py'}:build", use_cache=True, proofs=False)[1]


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tp_activation_fraction_is_korthikanti_without_the_attention_matrix(t):
    """docs/reference-numbers.md, Formulas / Activation memory per transformer layer: TP keeps sbh(10 + 24/t) of the
    unparallelised sbh·34 (the 5as/h score term is absent: SDPA keeps no s×s matrix)."""
    s, b, h = 2048, 1, 12288
    assert tp_activation_fraction(t) == pytest.approx(s * b * h * (10 + 24 / t) / (s * b * h * 34))


@pytest.mark.parametrize("b", [1, 2, 8])
def test_full_recompute_keeps_2sbh_per_layer_and_the_boundary_is_bsh2(gpt_graph, b):
    """docs/reference-numbers.md, Formulas: full recompute keeps 2sbh per layer (its input, 16-bit), and a pipeline
    boundary sends b·s·h·2 bytes (bf16) per micro-batch each way (``units.unit_costs``)."""
    units = unit_costs(gpt_graph, b, "full", H100.device, activation_elem_bytes=2)
    assert units.blocks == GPT_LAYERS
    assert units.saved_bytes[1:-1] == (2 * GPT_S * b * GPT_H,) * GPT_LAYERS
    assert units.boundary_bytes == (b * GPT_S * GPT_H * 2,) * GPT_LAYERS


@pytest.mark.parametrize("p, v", [(2, 2), (4, 2), (8, 2), (8, 4)])
def test_first_stage_holds_p_microbatches_more_when_interleaved(p, v):
    """docs/reference-numbers.md, Formulas / Activation memory: the first pipeline stage holds p micro-batches in
    1F1B, × (1 + (p−1)/(p·v)) with interleaving (``rank_memory.in_flight``, m large)."""
    assert in_flight("1f1b", 64, p, 1, 0) == p
    assert in_flight("interleaved-1f1b", 64, p, v, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))


# ------------------------------------------------------------------ pipeline bubble


def idle_over_busy(grid) -> float:
    idle = sum(a is None for row in grid for a in row)
    return idle / (sum(len(row) for row in grid) - idle)


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4)])
def test_megatron_145b_row_bubble(schedule, v):
    """docs/reference-numbers.md, Pipeline bubble, on Published configurations row 145.6B (PP 8, 1536 GPUs,
    TP 8 → DP 24, global batch 2304, micro-batch 2 → m = 48): the simulated grid's overhead is (p−1)/m = 7/48
    for GPipe / 1F1B and (p−1)/(v·m) interleaved; its idle share (p−1)/(v·m + p−1)."""
    p, m = 8, 2304 // (1536 // (8 * 8) * 2)
    assert m == 48
    grid = simulate(rank_orders(schedule, p, m, v), p * v)
    assert idle_over_busy(grid) == pytest.approx((p - 1) / (v * m))
    assert bubble_fraction(grid) == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p, m", [(2, 1), (4, 4), (4, 8), (8, 3)])
def test_forward_only_utilization(p, m):
    """docs/reference-numbers.md, Pipeline bubble: forward-only utilization m/(m + p − 1) — the forward half of the
    simulated GPipe grid (all forwards, then all backwards) ends after m + p − 1 slots."""
    grid = simulate(rank_orders("gpipe", p, m), p)
    forward_slots = 1 + max(t for row in grid for t, a in enumerate(row) if a is not None and a.kind == "F")
    busy = sum(a is not None and a.kind == "F" for row in grid for a in row)
    assert forward_slots == m + p - 1
    assert busy / (p * forward_slots) == pytest.approx(m / (m + p - 1))


@pytest.mark.parametrize(
    "schedule, v, m",
    [
        ("1f1b", 1, 1),
        ("1f1b", 1, 2),
        ("1f1b", 1, 8),
        ("gpipe", 1, 1),
        ("gpipe", 1, 4),
        ("interleaved-1f1b", 2, 4),
        ("interleaved-1f1b", 2, 8),
    ],
)
def test_priced_pipeline_step_against_a_timed_schedule(mlp_graph, schedule, v, m):
    """The priced pipeline (``step.price``, pp = 2 on the 4-block MLP, unequal ranks: the second
    also receives the boundary) against the schedule run with each rank's priced time per
    micro-batch (backward twice forward; ``schedule.makespan_s``): GPipe exactly; 1F1B never
    below it and within 25 %; interleaved between docs/reference-numbers.md's m + (p−1)/v slots at the mean
    rank's pace (the search's lower bound) and at the slowest rank's."""
    p = 2
    cluster = load_cluster("local-cpu", devices_per_node=p)
    config = Decisions(
        mesh=Mesh(pp=p), zero_stage=0, microbatch_size=1, num_microbatches=m, schedule=schedule, virtual_stages=v
    )
    cuts = (2,) if v == 1 else (1, 2, 3)
    tables = CostTables(mlp_graph, cluster)
    predicted = price(mlp_graph, cluster, config, global_batch=m, tables=tables, cuts=cuts)
    times = [load.time_s for load in rank_loads(tables, config, cuts)]
    assert max(times) > 1.01 * min(times)  # the ranks differ, or this checks nothing new
    pipelined_s = m * max(times) + predicted.bubble_s
    if v == 1:
        timed_s = makespan_s(rank_orders(schedule, p, m), p, [t / 3 for t in times], [2 * t / 3 for t in times])
        assert (
            pipelined_s == pytest.approx(timed_s)
            if schedule == "gpipe"
            else timed_s * (1 - 1e-9) <= pipelined_s <= 1.25 * timed_s
        )
    else:
        mean = sum(times) / p
        assert (m + (p - 1) / v) * mean <= pipelined_s <= (m + (p - 1) / v) * max(times)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 2), (4, 1), (4, 4), (4, 8), (8, 3)])
def test_fill_and_drain_bubble_bounds_timed_schedules(schedule, p, m):
    """``cost.pipeline_step``'s m·T_max + (Σ_r T_r − T_max) against the timed schedule over random unequal
    stage times (up to 3× apart): exact for GPipe, never below 1F1B and within 25 % of it, where
    docs/reference-numbers.md's (m + p − 1)·T_max overestimates by up to 77 %."""
    rng = random.Random(p * 100 + m)
    for _ in range(50):
        times = [rng.uniform(1.0, 3.0) for _ in range(p)]
        timed = makespan_s(rank_orders(schedule, p, m), p, [t / 3 for t in times], [2 * t / 3 for t in times])
        formula = m * max(times) + sum(times) - max(times)
        if schedule == "gpipe":
            assert formula == pytest.approx(timed)
        else:
            assert timed * (1 - 1e-9) <= formula <= 1.25 * timed


SHARED = str(ROOT / "tests/clusters/cpu4_shared_cores.yaml")  # 4 gloo ranks calibrated on 2 cores


@pytest.mark.parametrize(
    "schedule, pp, v, m", [("gpipe", 4, 1, 4), ("1f1b", 4, 1, 8), ("1f1b", 2, 1, 4), ("interleaved-1f1b", 2, 2, 4)]
)
def test_pipelines_on_shared_cores_are_the_schedule_run_with_processor_sharing(gpt_graph, schedule, pp, v, m):
    """4 ranks calibrated on 2 cores (``host.shared_cores`` 2): the pipelined part of the step is the
    schedule run with processor sharing on the stages' priced work and waits, shorter than the same
    cluster without sharing; the parts still add up, and the search's lower bound stays below it."""
    shared = load_cluster(SHARED)
    alone = replace(shared, host=replace(shared.host, shared_cores=0.0))
    dp = 4 // pp
    config = Decisions(
        mesh=Mesh(dp=dp, pp=pp),
        zero_stage=0,
        microbatch_size=8 // dp // m,
        num_microbatches=m,
        schedule=schedule,
        virtual_stages=v,
    )
    cuts = tuple(round(len(gpt_graph.blocks) * k / (pp * v)) for k in range(1, pp * v))
    tables = CostTables(gpt_graph, shared)
    loads = rank_loads(tables, config, cuts)
    forward, backward, forward_wait, backward_wait = stage_action_times(tables, config, cuts, loads)
    for r, load in enumerate(loads):  # each rank's work and waits are its priced time per micro-batch
        mine = range(r, pp * v, pp)
        assert sum(forward[s] + backward[s] for s in mine) == pytest.approx(load.compute_s)
        assert sum(forward_wait[s] + backward_wait[s] for s in mine) == pytest.approx(load.p2p_s + load.tp_comm_s)
    span = shared_makespan_s(
        rank_orders(schedule, pp, m, v), pp * v, forward, backward, dp, 2.0, forward_wait, backward_wait
    )
    sharing = price(gpt_graph, shared, config, global_batch=8, tables=tables, cuts=cuts)
    unshared = price(gpt_graph, alone, config, global_batch=8, cuts=cuts)
    gain = span - m * max(load.time_s for load in loads)  # < 0 where ranks run faster in the others' bubbles
    assert sharing.step_time_s < unshared.step_time_s
    assert sharing.step_time_s == pytest.approx(unshared.step_time_s - unshared.bubble_s + gain, rel=1e-12)
    assert sharing.bubble_s == pytest.approx(max(gain, 0.0), abs=1e-15)
    for part in fields(sharing):  # what a plan file holds: every part >= 0 (``ir.plan_schema``)
        value = getattr(sharing, part.name)
        assert not isinstance(value, float) or value >= 0.0, part.name
    assert lower_bound_s(tables, config) <= sharing.step_time_s


def test_two_ranks_on_two_cores_share_nothing(gpt_graph):
    shared = load_cluster(SHARED, devices_per_node=2)
    alone = replace(shared, host=replace(shared.host, shared_cores=0.0))
    config = Decisions(mesh=Mesh(pp=2), zero_stage=0, microbatch_size=2, num_microbatches=4, schedule="1f1b")
    cuts = (len(gpt_graph.blocks) // 2,)
    assert price(gpt_graph, shared, config, 8, cuts=cuts) == price(gpt_graph, alone, config, 8, cuts=cuts)
