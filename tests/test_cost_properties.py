"""Properties of the cost model (hypothesis, derandomized): ZeRO memory, ring and hierarchical
all-reduce, recompute on captured graphs, and the pipeline bubble of the schedule simulator.

Extends tests/test_memory.py, tests/test_comm.py and tests/test_schedule.py, which check
neighbouring stages / degrees, ring traffic growth and hierarchical vs ring on bare links.
"""

from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from autoshard.cost import comm
from autoshard.cost.compute import microbatch_compute
from autoshard.cost.hardware import PRESETS
from autoshard.cost.memory import BF16_AUTOCAST, FP32, MEGATRON_MIXED, activation_bytes, model_state_bytes
from autoshard.cost.rank_memory import memory_spmd, state_bytes_per_param
from autoshard.cost.schedule import bubble_fraction, rank_orders, simulate
from autoshard.cost.tables import CostTables
from autoshard.cost.tp_units import spmd_microbatch
from autoshard.cost.units import unit_costs
from autoshard.ir.decisions import Decisions, Mesh
from autoshard.ir.topology import Cluster, LinkSpec
from autoshard.passes.planning.tp_layout import hand_tp_layout
from autoshard.pipeline import capture_graph

ROOT = Path(__file__).resolve().parent.parent
H100 = PRESETS["dgx-h100"]
PRECISIONS = (FP32, BF16_AUTOCAST, MEGATRON_MIXED)
RECOMPUTE = ("none", "selective", "full")  # least recompute first


def fast(examples: int):
    return settings(deadline=None, derandomize=True, max_examples=examples)


# ------------------------------------------------------------------ ZeRO model state

stages = st.integers(0, 3)
degrees = st.integers(1, 4096)


@fast(150)
@given(
    params=st.integers(1, 10**13),
    s=st.tuples(stages, stages),
    d=st.tuples(degrees, degrees),
    precision=st.sampled_from(PRECISIONS),
)
def test_zero_state_never_rises_with_stage_or_dp(params, s, d, precision):
    """Any higher stage, any larger dp: weights, gradients and optimizer state each no larger."""
    (lo_s, hi_s), (lo_d, hi_d) = sorted(s), sorted(d)
    here = model_state_bytes(params, lo_s, lo_d, precision)
    for there in (
        model_state_bytes(params, hi_s, lo_d, precision),
        model_state_bytes(params, lo_s, hi_d, precision),
        model_state_bytes(params, hi_s, hi_d, precision),
    ):
        assert all(a <= b for a, b in zip(there, here))


@fast(200)
@given(params=st.integers(1, 10**13), dp=degrees, precision=st.sampled_from(PRECISIONS))
def test_zero_ends(params, dp, precision):
    """dp = 1 shards nothing; ZeRO-3 divides the whole state by dp."""
    assert len({model_state_bytes(params, z, 1, precision) for z in range(4)}) == 1
    whole = sum(model_state_bytes(params, 0, dp, precision))
    assert sum(model_state_bytes(params, 3, dp, precision)) == pytest.approx(whole / dp, abs=3)


@fast(200)
@given(
    s=st.tuples(stages, stages),
    d=st.tuples(degrees, degrees),
    pp=st.integers(2, 8),
    precision=st.sampled_from(PRECISIONS),
)
def test_pipeline_stage_state_per_param_never_rises_with_stage_or_dp(s, d, pp, precision):
    """``rank_memory.state_bytes_per_param`` (FSDP on a stage: unsharded gradients and ZeRO-3 weights all step)."""
    (lo_s, hi_s), (lo_d, hi_d) = sorted(s), sorted(d)

    def per_param(zero, dp):
        return state_bytes_per_param(
            precision,
            Decisions(
                mesh=Mesh(dp=dp, pp=pp), zero_stage=zero, microbatch_size=1, num_microbatches=pp, schedule="1f1b"
            ),
        )

    here = per_param(lo_s, lo_d)
    assert per_param(hi_s, lo_d) <= here * (1 + 1e-12)
    assert per_param(lo_s, hi_d) <= here * (1 + 1e-12)


# ------------------------------------------------------------------ ring all-reduce

sizes = st.floats(0.0, 1e12)
ranks = st.integers(1, 100_000)
links = st.builds(LinkSpec, st.floats(0.1, 1e4), st.floats(0.0, 100.0), st.just("t"))


@fast(150)
@given(size=st.integers(0, 2**50), p=ranks)
def test_ring_traffic_is_exactly_2_p_minus_1_over_p_s(size, p):
    """Each rank sends 2(p−1)/p · S (exact to the last bits of a float)."""
    exact = Fraction(2 * (p - 1), p) * size
    assert comm.ring_allreduce_bytes_per_rank(size, p) == pytest.approx(float(exact), rel=1e-12, abs=0)


@fast(150)
@given(size=st.floats(1.0, 1e12), n=st.integers(1, 10_000), extra=st.integers(0, 10**6))
def test_ring_traffic_tends_to_2s(size, n, extra):
    """For every p ≥ N the traffic is within 2S/N of 2S, and below it."""
    p = n + extra
    traffic = comm.ring_allreduce_bytes_per_rank(size, p)
    assert traffic < 2 * size
    assert 2 * size - traffic <= 2 * size / n * (1 + 1e-9)


@fast(150)
@given(size=st.floats(1.0, 1e12), p=st.integers(2, 100_000), bw=st.floats(0.1, 1e4))
def test_ring_busbw_is_the_link_bandwidth_for_any_p(size, p, bw):
    """With α = 0, nccl-tests' busbw = algbw · 2(p−1)/p of the modelled ring is B, whatever p."""
    t = comm.ring_allreduce_s(size, p, LinkSpec(bw, 0.0, "t"))
    assert size / t * 2 * (p - 1) / p == pytest.approx(bw * 1e9, rel=1e-9)


@fast(150)
@given(size=sizes, p=ranks, link=links)
def test_reduce_scatter_plus_all_gather_is_a_ring_all_reduce(size, p, link):
    """RS(S) + AG(S) = ring AR(S), latency terms included; the tree differs only in its latency."""
    ring = comm.ring_allreduce_s(size, p, link)
    assert comm.reduce_scatter_s(size, p, link) + comm.all_gather_s(size, p, link) == pytest.approx(ring, rel=1e-9)
    tree_latency = comm.tree_allreduce_s(0.0, p, link)
    assert tree_latency == pytest.approx(2 * (p - 1).bit_length() * link.latency_us * 1e-6)  # 2⌈log2 p⌉α
    assert comm.allreduce_s(size, p, link) == pytest.approx(min(ring, comm.tree_allreduce_s(size, p, link)))
    assert comm.allreduce_s(size, p, link) <= ring


# ------------------------------------------------------------------ hierarchical all-reduce


@st.composite
def two_level_clusters(draw):
    """n ≥ 2 nodes of g devices; the inter-node link no faster than the intra-node one; any latencies."""
    intra_bw = draw(st.floats(1.0, 2000.0))
    inter_bw = intra_bw * draw(st.floats(0.001, 1.0))
    intra = LinkSpec(intra_bw, draw(st.floats(0.0, 50.0)), "intra")
    inter = LinkSpec(inter_bw, draw(st.floats(0.0, 50.0)), "inter")
    return Cluster("two-level", draw(st.integers(2, 16)), draw(st.integers(1, 16)), H100.device, intra, inter, "nccl")


@fast(80)
@given(cluster=two_level_clusters(), size=sizes)
def test_hierarchical_never_loses_to_a_flat_ring_on_the_cluster(cluster, size):
    """``comm.hierarchical_allreduce_s`` on the cluster's links vs a ring over all ranks on the link
    ``Cluster.group_link`` gives the whole cluster (the NIC share, the larger latency)."""
    g, n = cluster.devices_per_node, cluster.nodes
    flat_link = cluster.group_link(range(cluster.world_size))
    assert flat_link.bandwidth_gbps == pytest.approx(cluster.inter_node.bandwidth_gbps)
    assert flat_link.latency_us == max(cluster.intra_node.latency_us, cluster.inter_node.latency_us)
    two_level = comm.hierarchical_allreduce_s(size, g, n, cluster.intra_node, cluster.inter_node)
    assert two_level <= comm.ring_allreduce_s(size, g * n, flat_link) * (1 + 1e-9) + 1e-15


@fast(80)
@given(cluster=two_level_clusters(), size=st.floats(1.0, 1e12))
def test_hierarchical_strictly_wins_on_bandwidth_when_the_nics_are_slower(cluster, size):
    """α = 0, g ≥ 2, B_inter < B_intra: the flat ring costs 2S(g−1)/g · (1/B_inter − 1/B_intra) more."""
    g, n = cluster.devices_per_node, cluster.nodes
    assume(g >= 2 and cluster.inter_node.bandwidth_gbps < cluster.intra_node.bandwidth_gbps * (1 - 1e-6))
    intra = LinkSpec(cluster.intra_node.bandwidth_gbps, 0.0, "intra")
    inter = LinkSpec(cluster.inter_node.bandwidth_gbps, 0.0, "inter")
    gap = comm.ring_allreduce_s(size, g * n, inter) - comm.hierarchical_allreduce_s(size, g, n, intra, inter)
    expected = 2 * size * (g - 1) / g * (1 / (inter.bandwidth_gbps * 1e9) - 1 / (intra.bandwidth_gbps * 1e9))
    assert gap > 0
    assert gap == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------------ recompute on captured graphs

GPT_CONFIGS = {  # small examples/gpt.py configurations; 4 heads so that tp ∈ {1, 2, 4} divides them
    "gpt_2x32": dict(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64),
    "gpt_3x48": dict(n_layer=3, n_embd=48, n_head=4, block_size=24, vocab_size=96),
}
MODEL_FILE = """\
import sys
sys.path.insert(0, {examples!r})
import gpt

loss_fn = gpt.loss_fn


def build():
    return gpt.build(**{config!r})


def example_batch(batch_size):
    return gpt.example_batch(batch_size, seq_len={seq}, vocab_size={vocab})
"""


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """Captured once per module: the residual MLP, the example GPT, and two smaller GPTs."""
    folder = tmp_path_factory.mktemp("models")
    specs = {"mlp": f"{ROOT / 'tests/models/mlp.py'}:build", "gpt": f"{ROOT / 'examples/gpt.py'}:build"}
    for name, config in GPT_CONFIGS.items():
        path = folder / f"{name}.py"
        path.write_text(
            MODEL_FILE.format(
                examples=str(ROOT / "examples"), config=config, seq=config["block_size"], vocab=config["vocab_size"]
            )
        )
        specs[name] = f"{path}:build"
    return {name: capture_graph(spec, use_cache=True)[1] for name, spec in specs.items()}


@pytest.fixture(scope="module")
def tables(graphs):
    """Cost tables on dgx-h100 (bf16 autocast), shared so TP layouts are solved once per (tp, b)."""
    return {name: CostTables(graph, H100) for name, graph in graphs.items()}


def non_increasing(values) -> bool:
    return all(a >= b for a, b in zip(values, values[1:]))


@fast(60)
@given(
    name=st.sampled_from(["mlp", "gpt", "gpt_2x32", "gpt_3x48"]),
    b=st.integers(1, 256),
    precision=st.sampled_from(PRECISIONS),
)
def test_more_recompute_never_raises_activation_memory(graphs, name, b, precision):
    """none ≥ selective ≥ full (``memory.activation_bytes``) on real captured graphs, and the per-unit
    split (``units.unit_costs``) adds up to the same figure in every mode."""
    graph = graphs[name]
    acts = [activation_bytes(graph, b, r, precision) for r in RECOMPUTE]
    assert non_increasing(acts), dict(zip(RECOMPUTE, acts))
    for r, whole in zip(RECOMPUTE, acts):
        units = unit_costs(graph, b, r, H100.device, precision.activation_bytes)
        assert sum(units.saved_bytes) + max(units.workspace_bytes) == pytest.approx(
            whole, abs=len(units.saved_bytes) + 1
        )


@fast(60)
@given(name=st.sampled_from(["mlp", "gpt", "gpt_2x32", "gpt_3x48"]), b=st.integers(1, 256))
def test_more_recompute_never_saves_time(graphs, name, b):
    """The other side of the trade: recompute seconds none ≤ selective ≤ full."""
    times = [microbatch_compute(graphs[name], b, r, H100.device, 2).recompute_s for r in RECOMPUTE]
    assert times[0] == 0.0 and times[0] <= times[1] <= times[2]


@fast(25)
@given(
    name=st.sampled_from(["gpt", "gpt_2x32", "gpt_3x48"]),
    b=st.integers(1, 8),
    tp=st.sampled_from([1, 2, 4]),
    zero=st.sampled_from([0, 2, 3]),
)
def test_more_recompute_never_raises_priced_activations(tables, name, b, tp, zero):
    """The planner's per-rank activations and peak (``rank_memory.memory_spmd``) with TP over 1, 2, 4 ranks of
    a dgx-h100 node: none ≥ selective ≥ full; the optimizer state does not depend on recompute (the gradients
    at the peak may: less recompute can move the peak from the root's reduce to the loss's backward)."""
    dp = 8 // tp
    zero = 0 if tp == 1 and zero == 0 else max(zero, 2)
    memories = []
    for r in RECOMPUTE:
        config = Decisions(mesh=Mesh(dp=dp, tp=tp), zero_stage=zero, microbatch_size=b, num_microbatches=1, recompute=r)
        hand_tp_layout(tables[name], config)
        local = spmd_microbatch(tables[name], config)[2]
        memories.append(memory_spmd(tables[name], config, local))
    acts = [m.activations_bytes for m in memories]
    assert non_increasing(acts), dict(zip(RECOMPUTE, acts))
    assert non_increasing([m.peak_bytes for m in memories])
    assert len({m.optimizer_bytes for m in memories}) == 1


# ------------------------------------------------------------------ pipeline bubble


def check_grid(grid, pp: int, m: int, v: int) -> None:
    """Every F and B of every stage once, on the rank that holds the stage, after what it needs."""
    stages = pp * v
    slot = {}
    for rank, row in enumerate(grid):
        for t, a in enumerate(row):
            if a is not None:
                assert a.stage % pp == rank
                slot[(a.stage, a.kind, a.microbatch)] = t
    assert len(slot) == sum(a is not None for row in grid for a in row) == 2 * stages * m
    for (s, kind, i), t in slot.items():
        if kind == "F" and s > 0:
            assert slot[(s - 1, "F", i)] < t
        if kind == "B":
            assert slot[(s, "F", i)] < t
            if s < stages - 1:
                assert slot[(s + 1, "B", i)] < t


def idle_over_busy(grid) -> float:
    idle = sum(a is None for row in grid for a in row)
    return idle / (sum(len(row) for row in grid) - idle)


@fast(100)
@given(schedule=st.sampled_from(["gpipe", "1f1b"]), pp=st.integers(1, 8), m=st.integers(1, 32))
def test_gpipe_and_1f1b_bubble_is_exact(schedule, pp, m):
    """Simulated idle share = (p−1)/(m + p−1), overhead (p−1)/m, for every p and m."""
    grid = simulate(rank_orders(schedule, pp, m), pp)
    check_grid(grid, pp, m, 1)
    assert bubble_fraction(grid) == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    assert idle_over_busy(grid) == pytest.approx((pp - 1) / m, abs=1e-12)


def torch_interleaved_microbatches(pp: int, m: int) -> bool:
    """torch's ScheduleInterleaved1F1B: max(1, m // p) rounds, m a multiple of them."""
    return m % max(1, m // pp) == 0


@fast(100)
@given(pp=st.integers(1, 8), m=st.integers(1, 48), v=st.integers(1, 4))
def test_interleaved_bubble_is_divided_by_v(pp, m, v):
    """For the schedules the planner admits (m ≥ p, torch's rounds): idle share (p−1)/(v·m + p−1),
    overhead (p−1)/(v·m), exactly."""
    assume(m >= pp and torch_interleaved_microbatches(pp, m))
    grid = simulate(rank_orders("interleaved-1f1b", pp, m, v), pp * v)
    check_grid(grid, pp, m, v)
    assert bubble_fraction(grid) == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-12)
    assert idle_over_busy(grid) == pytest.approx((pp - 1) / (v * m), abs=1e-12)


@fast(60)
@given(pp=st.integers(2, 8), m=st.integers(1, 7), v=st.integers(1, 4))
def test_interleaved_with_fewer_microbatches_than_ranks(pp, m, v):
    """m < p (one round of m): the schedule still runs, and each of the v − 1 chunk changes costs
    every rank 2(p − m) more idle slots than the formula: 2(p−1) + 2(v−1)(p−m) per rank."""
    assume(m < pp)
    grid = simulate(rank_orders("interleaved-1f1b", pp, m, v), pp * v)
    check_grid(grid, pp, m, v)
    idle = 2 * (pp - 1) + 2 * (v - 1) * (pp - m)
    assert bubble_fraction(grid) == pytest.approx(idle / (2 * v * m + idle), abs=1e-12)
    assert bubble_fraction(grid) >= (pp - 1) / (v * m + pp - 1) - 1e-12


def test_interleaved_refuses_microbatches_torch_refuses():
    """torch's rule: 9 micro-batches on 4 ranks make 2 rounds, and 9 is not a multiple of 2."""
    with pytest.raises(ValueError, match="multiple of the 2 rounds"):
        rank_orders("interleaved-1f1b", 4, 9, 2)
