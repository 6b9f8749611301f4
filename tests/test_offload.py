"""--offload: host offload (FSDP2's CPUOffloadPolicy) as a decision: searched for ZeRO-3 on GPU clusters, priced by
the host link, the CPU optimizer and the host memory, refused where it cannot run, lowered onto apply_fsdp, shown by
inspect. Planning only: tests/e2e/test_data_parallel_meshes.py trains an offload plan on CPU ranks."""

from dataclasses import replace

import pytest

import autoshard
from autoshard.cost.hardware import load_cluster
from autoshard.cost.offload import (
    CPU_ADAM_BYTES_PER_PARAM,
    HOST_CORE_GBPS,
    HOST_USABLE,
    offload_cost,
    offloaded_bytes_per_rank,
)
from autoshard.cost.step import price_parts
from autoshard.cost.tables import CostTables
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import Decisions, Mesh
from autoshard.ir.pins import Pins
from autoshard.passes.lowering.lower import lower
from autoshard.passes.planning.strategies import offload_choices
from autoshard.pipeline import capture_graph
from autoshard.show import offload_text

LLAMA_8B = "benchmarks/llama3.py:llama3_8b"  # Llama-3 8B: 32 blocks, d 4096, FFN 14336, vocab 128256
SMALL_GPUS = "tests/clusters/h100_16g.yaml"  # one DGX H100 node whose devices hold 16 GiB
GPT = "examples/gpt.py:build"
GIB = 2**30


@pytest.fixture(scope="module")
def gpt_tables(in_repo_module):
    """The example GPT priced on one DGX H100 node (bf16 autocast: fp32 shards, p = g = 4, o = 8 bytes)."""
    _, graph = capture_graph(GPT)
    return CostTables(graph, load_cluster("dgx-h100"))


def _zero3(offload: str, m: int = 1) -> Decisions:
    return Decisions(Mesh(dp=8), 3, 1, m, recompute="none", precision="bf16-autocast", offload=offload)


def test_offload_moves_the_state_off_the_device_and_onto_the_host(gpt_tables):
    """Device memory drops by the parameter, gradient and optimizer-state shards, (4 + 4 + 8)·Ψ/N bytes (two
    micro-batches: the gradient shards are held between them); a node's host holds them for its 8 ranks."""
    tables, psi = gpt_tables, gpt_tables.graph.param_count
    kept, moved = (price_parts(tables, _zero3(o, m=2)) for o in ("none", "cpu"))
    state = lambda mem: mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes  # noqa: E731
    assert moved.memory.optimizer_bytes == 0 and kept.memory.optimizer_bytes == psi * 8 // 8
    assert state(kept.memory) - state(moved.memory) == pytest.approx(16 * psi / 8, abs=8)
    assert moved.host_memory_bytes_per_node == 8 * offloaded_bytes_per_rank(tables.precision, _zero3("cpu", 2), psi)
    assert moved.host_memory_bytes_per_node == pytest.approx(16 * psi, abs=64) and kept.host_memory_bytes_per_node == 0


def test_the_host_link_time_is_the_bytes_over_its_bandwidth_and_the_optimizer_runs_on_the_host(gpt_tables):
    """H2D = m·2·p·Ψ/N / B_h (two all-gathers a micro-batch), D2H = m·g·Ψ/N / B_h; a link twice as fast takes half;
    the optimizer reads and writes K bytes per parameter at a rank's host bandwidth: the node's shared by its 8
    ranks, at most one core's (each rank runs on one thread)."""
    tables, psi = gpt_tables, gpt_tables.graph.param_count
    cluster, config = tables.cluster, _zero3("cpu", m=4)
    cost = offload_cost(cluster, config, tables.precision, psi, compute_s=1.0, dp_total_s=0.0)
    link = cluster.device.host_link_gbps * 1e9
    assert cost.h2d_s == pytest.approx(4 * 2 * 4 * psi / 8 / link)
    assert cost.d2h_s == pytest.approx(4 * 4 * psi / 8 / link)
    fast = replace(cluster, device=replace(cluster.device, host_link_gbps=2 * cluster.device.host_link_gbps))
    faster = offload_cost(fast, config, tables.precision, psi, compute_s=1.0, dp_total_s=0.0)
    assert (faster.h2d_s, faster.d2h_s) == pytest.approx((cost.h2d_s / 2, cost.d2h_s / 2))
    shared = cluster.device.host_memory_bandwidth_gbps / cluster.devices_per_node
    assert shared > HOST_CORE_GBPS  # a DGX H100: 50 GB/s of the host's per rank, but one thread streams 10
    assert cost.optimizer_s == pytest.approx(CPU_ADAM_BYTES_PER_PARAM * psi / 8 / (HOST_CORE_GBPS * 1e9))
    narrow = replace(cluster, device=replace(cluster.device, host_memory_bandwidth_gbps=8 * HOST_CORE_GBPS / 4))
    slower = offload_cost(narrow, config, tables.precision, psi, compute_s=1.0, dp_total_s=0.0)
    assert slower.optimizer_s == pytest.approx(4 * cost.optimizer_s)  # where the host's share is below a core's


def test_overlapped_copies_hide_behind_compute_and_the_accumulating_ones_do_not(gpt_tables):
    """The parameter copies and the first micro-batch's gradient copies hide in the compute the dp collectives
    leave; with no compute they are all exposed; every later micro-batch's gradient copy is blocking (exposed)."""
    tables, psi = gpt_tables, gpt_tables.graph.param_count
    one = offload_cost(tables.cluster, _zero3("cpu"), tables.precision, psi, compute_s=10.0, dp_total_s=1.0)
    assert one.exposed_s == 0.0
    bare = offload_cost(tables.cluster, _zero3("cpu"), tables.precision, psi, compute_s=1.0, dp_total_s=1.0)
    assert bare.exposed_s == pytest.approx(bare.h2d_s + bare.d2h_s)
    four = offload_cost(tables.cluster, _zero3("cpu", m=4), tables.precision, psi, compute_s=10.0, dp_total_s=1.0)
    assert four.exposed_s == pytest.approx(3 * four.d2h_s / 4)
    priced = price_parts(tables, _zero3("cpu", m=4))
    assert priced.offload_s > 0 and priced.comm_exposed_s >= priced.offload_s


def test_offload_is_searched_only_where_fsdp2_offloads_and_refused_elsewhere_in_one_line():
    gpus, cpus = load_cluster("dgx-h100"), load_cluster("local-cpu")
    assert offload_choices(_zero3("none"), Pins(), gpus) == ("none", "cpu")
    assert offload_choices(_zero3("none"), Pins(), cpus) == ("none",)  # nothing to offload to
    assert offload_choices(replace(_zero3("none"), zero_stage=2), Pins(), gpus) == ("none",)
    piped = Decisions(Mesh(dp=4, pp=2), 3, 1, 2, schedule="1f1b")
    assert offload_choices(piped, Pins(), gpus) == ("none",)
    assert offload_choices(piped, Pins(offload="cpu"), gpus) == ()
    for pins, match in (
        (dict(offload="nvme"), "--offload nvme is not emitted: no maintained library"),
        (dict(offload="cpu", pp=2), "--offload cpu: pipeline stages are not offloaded yet"),
        (dict(offload="cpu", zero=2), "--offload cpu: FSDP2's CPUOffloadPolicy offloads ZeRO-3's shards"),
        (dict(offload="disk"), "--offload disk must be one of none, cpu, nvme"),
    ):
        with pytest.raises(AutoshardError, match=match):
            autoshard.plan(GPT, cluster="dgx-h100", global_batch=8, **pins)
    with pytest.raises(AutoshardError, match="CPU ranks .gloo. keep their state in host memory already"):
        autoshard.plan(GPT, cluster="local-cpu", global_batch=8, offload="cpu")


@pytest.fixture(scope="module")
def plan_8b(in_repo_module):
    """Llama-3 8B on 8 devices of 16 GiB: its state alone is 15 GiB a rank under ZeRO-3."""
    return autoshard.plan(LLAMA_8B, cluster=SMALL_GPUS, global_batch=8, seq_len=2048, float8="off")


def test_an_8b_model_that_fits_no_layout_gets_an_offload_plan_priced_with_its_host_link(plan_8b):
    plan = plan_8b
    assert plan.decisions.offload == "cpu" and plan.zero_stage == 3 and plan.mesh.pp == 1
    assert plan.predicted.memory_peak_bytes_per_rank <= 16 * GIB
    assert plan.predicted.memory.optimizer_bytes == 0
    host = plan.predicted.host_memory_bytes_per_node
    assert 16 * 8.0e9 < host <= HOST_USABLE * 2 * 2**40  # 16 B per parameter on the node's host
    without = [a for a in plan.alternatives if a.offload == "none"]
    assert without and all(a.why_not.startswith("does not fit") for a in without)
    assert "without it the best plan" in offload_text(plan) and "does not fit" in offload_text(plan)
    fsdp = next(s for s in lower(plan) if s.op == "apply_fsdp")
    assert ("offload", True) in fsdp.arguments and "CPUOffloadPolicy" in fsdp.why


def test_a_host_too_small_for_the_offloaded_state_is_refused_with_its_reason(in_repo_module, tmp_path):
    """A node with 64 GiB of host memory cannot hold the 8B state (~120 GiB): no plan fits, and the refusal names
    the host memory as what the leanest plan misses."""
    small = tmp_path / "small_host.yaml"
    small.write_text(
        "preset: dgx-h100\nnodes: 1\ndevice: {memory_bytes: 17179869184, host_memory_bytes: 68719476736}\n"
    )
    with pytest.raises(AutoshardError, match=r"offloaded state needs 1\d\d\.\d GiB of host memory per node"):
        autoshard.plan(LLAMA_8B, cluster=str(small), global_batch=8, seq_len=2048, float8="off", dp=8, zero=3)
