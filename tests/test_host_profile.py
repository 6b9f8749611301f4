"""Host overheads and model profiles: the probes' maths, the cost model's use of them, the cluster file."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import yaml

from autoshard import host_probes, model_probes
from autoshard.cost import comm
from autoshard.cost.hardware import load_cluster
from autoshard.cost.parts import ADAM_BYTES_PER_PARAM
from autoshard.cost.profile import graph_signature
from autoshard.cost.step import price_parts
from autoshard.cost.tables import CostTables
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import Decisions, Mesh
from autoshard.ir.profile import ModelProfile
from autoshard.ir.topology import Cluster, HostOverheads
from autoshard.pipeline import capture_graph

GPT = "examples/gpt.py:build"
TRUE = dict(
    op_forward_us=12.0,
    op_backward_us=25.0,
    selective_op_us=60.0,
    checkpoint_block_us=700.0,
    fsdp_unit_zero2_us=4000.0,
    fsdp_unit_zero3_us=6000.0,
    fsdp_zero2_us_per_mib=3000.0,
    fsdp_zero3_us_per_mib=5000.0,
    ddp_tensor_us=50.0,
    zero1_tensor_us=200.0,
    optimizer_tensor_us=30.0,
    sharded_optimizer_tensor_us=250.0,
    pipeline_microbatch_us=3000.0,
    pipeline_step_us=1500.0,
    tp_module_us=400.0,
    weight_group_us=90.0,
    sequence_module_us=800.0,
    collective_wait_us=1500.0,
    tp_forward_share=0.35,
    fsdp_accumulate_unit_us=700.0,
)


@pytest.fixture(scope="module")
def cluster():
    return load_cluster("local-cpu", devices_per_node=2)


@pytest.fixture(scope="module")
def gpt(in_repo_module):
    return capture_graph(GPT, use_cache=True, proofs=False)[1]


def synthetic_probe_times(h: HostOverheads, c: host_probes.ProbeCounts, cluster: Cluster, ranks: int) -> dict:
    """What the probes would measure on a machine whose overheads are exactly ``h`` (host_probes' doc)."""
    us = 1e-6
    fwd = c.roofline_s + c.ops * h.op_forward_us * us
    fwd_bwd = fwd + 2 * c.roofline_s + c.ops * h.op_backward_us * us
    t = {
        "fwd": fwd,
        "fwd_bwd": fwd_bwd,
        "selective": fwd_bwd
        + c.light_block_ops * h.op_forward_us * us
        + c.light_roofline_s
        + (c.block_ops + c.light_block_ops) * h.selective_op_us * us,
        "full": fwd_bwd
        + c.block_ops * h.op_forward_us * us
        + c.block_roofline_s
        + host_probes.BLOCKS * h.checkpoint_block_us * us,
        "split": fwd_bwd + c.weight_groups * h.weight_group_us * us,
    }
    tensors, params = 6 * host_probes.BLOCKS + 6 + 2, 12345
    bandwidth = cluster.device.memory_bandwidth_gbps * 1e9
    adamw = tensors * h.optimizer_tensor_us * us + ADAM_BYTES_PER_PARAM * params / bandwidth
    t |= {"adamw": adamw, "tensors": tensors, "params": params}
    t["fwd_bwd_wide"] = 10 * fwd_bwd
    for width, suffix, base in ((host_probes.WIDTH, "", fwd_bwd), (host_probes.WIDE, "_wide", 10 * fwd_bwd)):
        sizes = host_probes.unit_param_bytes(width)
        for stage in (2, 3):
            a, c_mib = (getattr(h, f"fsdp_unit_zero{stage}_us"), getattr(h, f"fsdp_zero{stage}_us_per_mib"))
            t[f"fsdp{stage}{suffix}"] = (
                base
                + host_probes._fsdp_comm_s(sizes, cluster, ranks, stage)
                + sum(a * us + c_mib * us * b / 2**20 for b in sizes)
            )
    t["fsdp_accumulate"] = (
        fwd_bwd + len(host_probes.unit_param_bytes(host_probes.WIDTH)) * h.fsdp_accumulate_unit_us * us
    )
    link = cluster.intra_node
    t["sharded_adamw"] = (
        tensors * h.sharded_optimizer_tensor_us * us + ADAM_BYTES_PER_PARAM * params / ranks / bandwidth
    )
    t["ddp"] = fwd_bwd + comm.allreduce_s(4 * params, ranks, link) + tensors * h.ddp_tensor_us * us
    local = h.optimizer_tensor_us * us * tensors / ranks + ADAM_BYTES_PER_PARAM * params / ranks / bandwidth
    t["zero1"] = local + comm.all_gather_s(4 * params, ranks, link) + tensors * h.zero1_tensor_us * us
    tp_modules = len(host_probes.TP_STYLES) * host_probes.BLOCKS
    activation = 4 * host_probes.TOKENS * host_probes.WIDTH
    t["tp"] = (
        fwd_bwd + 4 * host_probes.BLOCKS * comm.allreduce_s(activation, ranks, link) + tp_modules * h.tp_module_us * us
    )
    t["tp_fwd"] = (
        fwd
        + 2 * host_probes.BLOCKS * comm.allreduce_s(activation, ranks, link)
        + h.tp_forward_share * tp_modules * h.tp_module_us * us
    )
    gathers = 2 * 2 * host_probes.BLOCKS + 1  # each sub-block's input and the head's, forward and backward
    t["tp_sp"] = (
        fwd_bwd
        + gathers * (comm.all_gather_s(activation, ranks, link) + comm.reduce_scatter_s(activation, ranks, link))
        + tp_modules * h.tp_module_us * us
        + (4 * host_probes.BLOCKS + 2) * h.sequence_module_us * us  # 2 norms and 2 gathers a block, scatter, gather
    )
    matmuls, gathers_alone = 0.003, host_probes.BETWEEN_COLLECTIVES * comm.all_gather_s(activation, ranks, link)
    t["collective_matmuls"], t["collective_gathers"] = matmuls, gathers_alone
    t["collective_between"] = matmuls + gathers_alone + host_probes.BETWEEN_COLLECTIVES * h.collective_wait_us * us
    stage = max(n * (h.op_forward_us + h.op_backward_us) * us + 3 * r for n, r in zip(c.stage_ops, c.stage_roofline_s))
    slope = stage + 2 * comm.p2p_s(c.boundary_bytes, link) + h.pipeline_microbatch_us * us
    t["pipeline"] = {m: (m + 1) * slope + h.pipeline_step_us * us for m in host_probes.PIPELINE_MICROBATCHES}
    return t


def test_the_probes_maths_recovers_known_overheads(cluster):
    """Probe times made from known overheads give those overheads back (``host_probes.fit_host``)."""
    truth = HostOverheads(**TRUE, source="test")
    counts = host_probes.probe_counts(cluster)
    fitted = host_probes.fit_host(synthetic_probe_times(truth, counts, cluster, 2), counts, cluster, 2, "test")
    for name, value in TRUE.items():
        assert getattr(fitted, name) == pytest.approx(value, rel=2e-3, abs=0.05), name


def test_host_overheads_are_a_named_part_and_grow_with_micro_batches(cluster, gpt):
    host = replace(cluster, host=HostOverheads(**TRUE, source="test"))
    for config in (
        Decisions(Mesh(2, 1, 1), 3, 4, 1),
        Decisions(Mesh(2, 1, 1), 3, 1, 4),
        Decisions(Mesh(1, 1, 2), 0, 2, 2, schedule="1f1b"),
    ):
        cuts = (2,) if config.mesh.pp > 1 else None
        bare, with_host = (
            price_parts(CostTables(gpt, cluster), config, cuts),
            price_parts(CostTables(gpt, host), config, cuts),
        )
        assert bare.host_s == 0 and with_host.host_s > 0
        assert with_host.step_time_s > bare.step_time_s
        assert with_host.compute_s == pytest.approx(bare.compute_s + with_host.host_s, rel=1e-9) or config.mesh.pp > 1
    one, four = (
        price_parts(CostTables(gpt, host), Decisions(Mesh(2, 1, 1), 3, b, m)).host_s for b, m in ((4, 1), (1, 4))
    )
    assert four > 3 * one * 0.9  # per micro-batch: ops, FSDP units


def test_gpu_hides_host_time_behind_the_device(gpt):
    """On nccl clusters host time counts only where it exceeds the device's time of that unit."""
    h100 = load_cluster("dgx-h100")
    small = replace(h100, host=HostOverheads(**{**TRUE, "op_forward_us": 1.0, "op_backward_us": 1.0}, source="t"))
    large = replace(h100, host=HostOverheads(**{**TRUE, "op_forward_us": 1e5, "op_backward_us": 1e5}, source="t"))
    units = {name: CostTables(gpt, c).units(1024, "none") for name, c in (("small", small), ("large", large))}
    device = sum(units["small"].forward_s)
    assert sum(units["small"].host_forward_s) < 0.05 * device  # hidden: only the excess of tiny units shows
    assert sum(units["large"].host_forward_s) > device  # a host slower than the kernels sets the pace


def test_gpu_hides_the_recompute_policy_under_the_backward(gpt):
    """Selective recompute's per-op host cost on a GPU hides under the micro-batch's queued kernels (autograd
    queues the recomputed ops among the backward's, and the forward's lead carries over): a policy costing less
    than the device's time adds nothing exposed, one costing more exposes only its excess over the forward,
    backward and recompute together (``cost.units.exposed_host``)."""
    h100 = load_cluster("dgx-h100")
    units = {}
    for name, sel_us in (("cheap", 1.0), ("dear", 1e5)):
        host = HostOverheads(
            **{**TRUE, "op_forward_us": 0.0, "op_backward_us": 0.0, "selective_op_us": sel_us}, source="t"
        )
        units[name] = CostTables(gpt, replace(h100, host=host)).units(1024, "selective")
    cheap, dear = units["cheap"], units["dear"]
    assert sum(cheap.host_recompute_s) == 0.0 < sum(cheap.recompute_s) < sum(cheap.backward_s)
    exposed = sum(dear.host_forward_s) + sum(dear.host_backward_s) + sum(dear.host_recompute_s)
    # the lead peaks before the prefix's backward (the embedding's: last in order, no recompute, no host)
    device = sum(dear.forward_s) + sum(dear.backward_s[1:]) + sum(dear.recompute_s[1:])
    policy_s = sum(host_times_of(gpt, "selective", 1e5))
    assert exposed == pytest.approx(policy_s - device)
    assert sum(dear.host_forward_s) == 0.0


def host_times_of(graph, recompute: str, selective_op_us: float) -> list[float]:
    """The recompute host seconds per unit before any hiding (``cost.units.host_times``)."""
    from autoshard.cost.units import host_times, node_units

    host = HostOverheads(
        **{**TRUE, "op_forward_us": 0.0, "op_backward_us": 0.0, "selective_op_us": selective_op_us}, source="t"
    )
    return host_times(graph, node_units(graph), recompute, host)[2]


def profile_of(graph, times, optimizer_s=0.01, step_loop_s=0.0, **pipeline) -> ModelProfile:
    return ModelProfile(GPT, graph_signature(graph), 2, times, "test", optimizer_s, step_loop_s, **pipeline)


def test_profile_scales_units_to_the_measured_totals(cluster, gpt):
    times = {
        1: {"none": (0.002, 0.006), "selective": (0.004, 0.011), "full": (0.003, 0.009)},
        4: {"none": (0.005, 0.015), "selective": (0.009, 0.027), "full": (0.006, 0.021)},
    }
    profiled = replace(cluster, profiles=(profile_of(gpt, times),))
    tables = CostTables(gpt, profiled)
    assert tables.profile is not None
    for b, mode in ((1, "none"), (4, "full"), (2, "selective")):
        u = tables.units(b, mode)
        fwd, fwd_bwd = (times[1]["none"][i] + (times[4]["none"][i] - times[1]["none"][i]) * (b - 1) / 3 for i in (0, 1))
        mode_total = times[1][mode][1] + (times[4][mode][1] - times[1][mode][1]) * (b - 1) / 3
        assert sum(u.forward_s) == pytest.approx(fwd)
        assert sum(u.forward_s) + sum(u.backward_s) == pytest.approx(fwd_bwd)
        assert sum(u.compute_s) == pytest.approx(mode_total)  # everything measured; no host time added twice
    parts = price_parts(tables, Decisions(Mesh(1, 1, 1), 0, 4, 1))
    assert parts.optimizer_s == pytest.approx(0.01)  # the measured AdamW step


@pytest.mark.parametrize(
    "config, cuts",
    [
        (Decisions(Mesh(2, 1, 1), 0, 2, 2), None),
        (Decisions(Mesh(2, 1, 1), 3, 4, 1), None),
        (Decisions(Mesh(1, 1, 2), 0, 1, 4, schedule="1f1b"), (2,)),
    ],
)
def test_the_profile_s_step_loop_is_priced_once_per_step(cluster, gpt, config, cuts):
    """t_loop (``cost.parts.step_loop_s``) joins the host time once a step, whatever the micro-batches, mesh or
    schedule; a profile without it prices as before."""
    times = {1: {"none": (0.002, 0.006)}, 4: {"none": (0.005, 0.015)}}
    before = price_parts(CostTables(gpt, replace(cluster, profiles=(profile_of(gpt, times),))), config, cuts)
    looped = replace(cluster, profiles=(profile_of(gpt, times, step_loop_s=0.0042),))
    after = price_parts(CostTables(gpt, looped), config, cuts)
    assert after.host_s - before.host_s == pytest.approx(0.0042)
    assert after.step_time_s - before.step_time_s == pytest.approx(0.0042)


@pytest.mark.parametrize(
    "config, link_gbps, synced",
    [
        (Decisions(Mesh(1, 1, 1), 0, 8, 1), 1e6, False),  # one rank: its loss's mean is its own
        (Decisions(Mesh(1, 1, 1, cp=2), 0, 8, 1), 1e6, True),  # cp 2: the ring's exchanges, the gradients' all-reduce
        (Decisions(Mesh(1, 1, 2), 0, 1, 4, schedule="1f1b"), 1e6, True),  # a pipeline pays the whole loop
        (Decisions(Mesh(1, 2, 1), 0, 8, 1), 1e-3, False),  # tp 2 on a slow link keeps every module whole: no collective
        (Decisions(Mesh(2, 1, 1), 0, 4, 1), 1e6, True),  # dp 2: the gradients' and the loss's all-reduce
        (Decisions(Mesh(1, 2, 1), 0, 8, 1), 1e6, True),  # tp 2 on a fast link shards modules: DTensor's collectives
    ],
)
def test_a_step_whose_ranks_share_no_collective_pays_the_loop_without_its_sync(
    cluster, in_repo_module, config, link_gbps, synced
):
    """t_sync (``step_sync_s``, the loss's all-reduce over every rank in the profile's step loop) is paid by every
    SPMD step whose ranks meet in a collective; a step with none (one data-parallel rank, a layout that shards
    nothing) pays t_loop − t_sync; a pipeline pays the whole loop (``cost.parts`` module doc). A sync above the loop
    takes the whole loop and no more."""
    from autoshard.passes.planning.tp_layout import hand_tp_layout

    gpt = capture_graph(GPT, use_cache=True)[1]  # with the TP proof: what may be sharded is proved, not assumed
    times = {1: {"none": (0.002, 0.006)}, 4: {"none": (0.005, 0.015)}}
    loop, sync = 0.0042, 0.0030
    link = replace(cluster.intra_node, bandwidth_gbps=link_gbps, latency_us=0.01 if link_gbps > 1 else 1e5)

    def host_s(step_sync_s: float) -> float:
        profile = replace(profile_of(gpt, times, step_loop_s=loop), step_sync_s=step_sync_s)
        tables = CostTables(gpt, replace(cluster, intra_node=link, profiles=(profile,)))
        hand_tp_layout(tables, config)
        if config.mesh.tp > 1:  # the layout solved on the link: whole on the slow one, sharded on the fast one
            assert (tables.layout_cost(config).comm_s > 0) == synced
        return price_parts(tables, config, (2,) if config.mesh.pp > 1 else None).host_s

    assert host_s(sync) - host_s(0.0) == pytest.approx(0.0 if synced else -sync)
    assert host_s(2 * loop) - host_s(0.0) == pytest.approx(0.0 if synced else -loop)


PIPELINE_1F1B = Decisions(Mesh(1, 1, 2), 0, 1, 4, schedule="1f1b")


def test_a_model_s_measured_pipeline_replaces_the_probes(cluster, gpt):
    """A profile's pipeline figures (``calibrate --model`` on the model itself) price a pipeline's schedule in place
    of the host probes' (``cost.parts.pipeline_host_s``): the same figures price the same, a smaller one less;
    SPMD plans are untouched."""
    times = {1: {"none": (0.002, 0.006)}, 4: {"none": (0.005, 0.015)}}
    host = HostOverheads(**TRUE, source="t")  # 3 ms per stage and micro-batch, 1.5 ms per step

    def price(config, cuts, **pipeline):
        profiled = replace(cluster, host=host, profiles=(profile_of(gpt, times, **pipeline),))
        return price_parts(CostTables(gpt, profiled), config, cuts).step_time_s

    probes = price(PIPELINE_1F1B, (2,))
    assert price(PIPELINE_1F1B, (2,), pipeline_microbatch_s=0.003, pipeline_step_s=0.0015) == pytest.approx(probes)
    lower = price(PIPELINE_1F1B, (2,), pipeline_microbatch_s=0.001, pipeline_step_s=0.0005)
    assert lower == pytest.approx(probes - (4 + 1) * 0.002 - 0.001)  # (m + p − 1)·Δx + Δy
    spmd = Decisions(Mesh(2, 1, 1), 0, 2, 2)
    assert price(spmd, None, pipeline_microbatch_s=0.001) == price(spmd, None)


def test_the_pipeline_fit_inverts_the_cost_model_s_pipeline(cluster, gpt):
    """``model_probes.pipeline_residual`` on 1F1B steps that the cost model itself prices with a known schedule time
    per micro-batch and per step (two stages cut before the middle block, b = 1, m = 2, 4 and 8, the optimizer priced,
    the step loop not: the timed step has none) gives both back: the fit and the price are one formula. Steps that
    take no longer than the rest of the price give 0."""
    from autoshard.model_probes import MODEL_PIPELINE_MICROBATCHES, ProfileRequest, pipeline_residual, pipeline_splits

    times = {1: {"none": (0.002, 0.006)}, 4: {"none": (0.005, 0.015)}}
    request = ProfileRequest(GPT, graph_signature(gpt), tuple(b.path for b in gpt.blocks), (1, 4))
    cuts = (request.blocks.index(pipeline_splits(request, 2)[0]),)
    host = HostOverheads(**TRUE, source="t")  # the probes' own figures, which the model's replace
    loop_s = 0.0031  # in the program's step, not in the timed one

    def steps(per_microbatch_s, per_step_s):
        known = profile_of(
            gpt, times, step_loop_s=loop_s, pipeline_microbatch_s=per_microbatch_s, pipeline_step_s=per_step_s
        )
        tables = CostTables(gpt, replace(cluster, host=host, profiles=(known,)))
        return {
            m: price_parts(tables, replace(PIPELINE_1F1B, num_microbatches=m), cuts).step_time_s - loop_s
            for m in MODEL_PIPELINE_MICROBATCHES
        }

    profiled = replace(cluster, host=host, profiles=(profile_of(gpt, times, step_loop_s=loop_s),))
    fitted = pipeline_residual(request, steps(0.0023, 0.0041), profiled, 2)
    assert fitted == pytest.approx((0.0023, 0.0041), rel=1e-6)
    assert pipeline_residual(request, steps(0.0, 0.0), profiled, 2) == pytest.approx((0.0, 0.0), abs=1e-9)


def test_the_step_ops_are_the_program_s_step_and_its_parts(in_repo_module, one_rank):
    """``model_probes._step_ops``: "whole" runs the program's step (a fresh batch, the optimizer's and the scheduler's
    step, the gradients freed, the loss's mean logged), "parts" forward + backward and the optimizer's step, keeping
    the gradients as the profile's calls do."""
    import torch

    from autoshard.runtime.model import build_model, load_model_file

    model_file = load_model_file(GPT)
    model = build_model(model_file, seed=0, device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = model_file.example_batch(2)
    parts, whole, alone = model_probes._step_ops(model_file, model, optimizer, batch, contextlib.nullcontext(), "cpu")
    weights = [p.detach().clone() for p in model.parameters()]
    parts()
    assert all(p.grad is not None for p in model.parameters())  # kept, as the profile's calls keep them
    assert any(not torch.equal(w, p) for w, p in zip(weights, model.parameters()))  # the optimizer stepped
    weights = [p.detach().clone() for p in model.parameters()]
    steps = optimizer.state[next(iter(model.parameters()))]["step"].item()
    whole()
    whole()
    assert all(p.grad is None for p in model.parameters())  # freed as each step frees them
    assert optimizer.state[next(iter(model.parameters()))]["step"].item() == steps + 2  # one optimizer step each
    assert any(not torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    alone()  # the same step, the loss read on its own rank
    assert all(p.grad is None for p in model.parameters())
    assert optimizer.state[next(iter(model.parameters()))]["step"].item() == steps + 3


def test_a_profile_is_the_least_squares_line_through_its_sizes(gpt):
    """Times on a line a + c·b come back exactly at and between the sizes; one size measured high moves the line
    by its share of the least-squares fit, not the whole error (``ModelProfile._at``)."""
    line = {
        b: {"none": (0.001 + 0.0005 * b, 0.003 + 0.0015 * b), "full": (0.001 + 0.0005 * b, 0.004 + 0.002 * b)}
        for b in (1, 2, 4, 8)
    }
    exact = profile_of(gpt, line)
    for b in (1, 2, 3, 4, 8, 16):
        fwd, bwd, rerun = exact.totals(b, "full")
        assert (fwd, fwd + bwd, rerun) == pytest.approx((0.001 + 0.0005 * b, 0.003 + 0.0015 * b, 0.001 + 0.0005 * b))
    noisy = {**line, 2: {**line[2], "full": (line[2]["full"][0], line[2]["full"][1] + 0.008)}}  # b 2 read 8 ms high
    rerun_2 = profile_of(gpt, noisy).totals(2, "full")[2]
    true_2 = 0.002
    assert true_2 < rerun_2 < true_2 + 0.008 / 2  # joining the points would give true + 8 ms


def test_a_profile_s_rounds_are_paired_and_a_slow_round_is_dropped():
    """A slow period lifts one round's figures: the median over rounds drops it, and a mode's figure is "none"'s
    plus its median difference from "none" in the same round, so a slow period on one mode of one round (the
    recompute then timed faster than none, as one measurement read) does not set the recompute's price."""
    true = {4: {"none": [0.005, 0.012], "full": [0.005, 0.021]}}
    slow_none = {4: {"none": [0.008, 0.020], "full": [0.005, 0.021]}}  # a slow period on "none" only
    slow_all = {4: {m: [t * 1.5 for t in v] for m, v in true[4].items()}}  # a slow period on the whole round
    for rounds in ([true, slow_none, true], [slow_all, true, true], [true, slow_none, slow_all]):
        figures = model_probes._paired_rounds(rounds)[4]
        assert figures["full"][1] - figures["none"][1] == pytest.approx(0.009)  # the recompute's 9 ms
    dropped = model_probes._paired_rounds([true, slow_none, true])[4]
    assert all(dropped[m] == pytest.approx(true[4][m]) for m in true[4])
    assert model_probes._paired_rounds([slow_none]) == slow_none  # one round: its own figures


def test_a_collective_between_compute_is_priced_with_its_wait(gpt):
    """The link a TP layout is solved and priced on (``tp_solve_link``) charges every collective its own fitted
    latency (calibrate's per-collective fits, which it used to drop) plus ``collective_wait_us``, scaled to the
    micro-batch like the rest of α."""
    calibrated = load_cluster("tests/clusters/cpu4_shared_cores.yaml")
    waits = replace(calibrated, host=replace(calibrated.host, collective_wait_us=1500.0))
    b = 2 * gpt.batch_size  # r = 2: α is halved (the solve is at the captured batch)
    own = calibrated.group_link([0, 1])
    assert own.collectives
    for cluster, wait_us in ((calibrated, 0.0), (waits, 1500.0)):
        link = CostTables(gpt, cluster).tp_solve_link(2, b)
        assert link.latency_us == pytest.approx((own.latency_us + wait_us) / 2)
        for name, latency_us, bandwidth_gbps in own.collectives:
            assert link.for_collective(name).latency_us == pytest.approx((latency_us + wait_us) / 2)
            assert link.for_collective(name).bandwidth_gbps == pytest.approx(bandwidth_gbps)


def test_a_profile_of_another_model_is_not_used(cluster, gpt):
    other = ModelProfile("x.py:build", "0" * 16, 2, {1: {"none": (1.0, 3.0)}}, "test")
    assert CostTables(gpt, replace(cluster, profiles=(other,))).profile is None


def test_cluster_file_round_trip_with_host_and_profiles(tmp_path, cluster, gpt):
    full = replace(
        cluster,
        host=HostOverheads(**TRUE, source="t"),
        profiles=(
            profile_of(
                gpt,
                {1: {"none": (0.002, 0.006)}, 2: {"none": (0.003, 0.008)}},
                step_loop_s=0.001,
                pipeline_microbatch_s=0.0007,
                pipeline_step_s=0.0,
                step_sync_s=0.0006,
            ),
        ),
    )
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(full.to_dict(), sort_keys=False))
    assert load_cluster(str(path)) == full
    assert Cluster.from_dict(full.to_dict()) == full
    wide = replace(
        full,
        profiles=(
            replace(
                full.profiles[0], wide_pipeline_stages=4, wide_pipeline_microbatch_s=0.002, wide_pipeline_step_s=0.0
            ),
        ),
    )
    assert Cluster.from_dict(wide.to_dict()) == wide and "wide_pipeline_stages" in wide.to_dict()["profiles"][0]
    assert "wide_pipeline_stages" not in full.to_dict()["profiles"][0]
    earlier = full.to_dict()  # a file from before the step loop was measured reads with none
    for key in ("step_loop_s", "pipeline_microbatch_s", "pipeline_step_s", "step_sync_s"):
        del earlier["profiles"][0][key]
    assert Cluster.from_dict(earlier).profiles[0].step_loop_s == 0.0
    assert Cluster.from_dict(earlier).profiles[0].step_sync_s == 0.0  # every step pays the whole loop
    assert Cluster.from_dict(earlier).profiles[0].pipeline_microbatch_s is None  # the host probes price it
    assert "host" not in cluster.to_dict() and "profiles" not in cluster.to_dict()  # presets: as before


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"times": {0: {"none": [1, 2]}}}, "positive micro-batch size"),
        ({"times": {1: {"none": [1, -2]}}}, "two seconds >= 0"),
        ({"times": {1: {"sometimes": [1, 2]}}}, "positive micro-batch size"),
        ({"ranks": 0}, "malformed"),
        ({"optimizer_s": "fast"}, "optimizer_s must be seconds"),
        ({"step_loop_s": -0.001}, "step_loop_s must be seconds"),
        (
            {"loop_s": 0.001},
            "may have pipeline_microbatch_s, pipeline_step_s, sequence_module_s, step_loop_s, step_sync_s, "
            "tp_forward_share, "
            "tp_module_s, wide_pipeline_microbatch_s, wide_pipeline_stages, wide_pipeline_step_s",
        ),
        ({"pipeline_microbatch_s": -1}, "pipeline_microbatch_s must be seconds"),
        (
            {"wide_pipeline_stages": 2, "wide_pipeline_microbatch_s": 0.001},
            "wide_pipeline_stages must be a stage count",
        ),
        ({"wide_pipeline_stages": 4, "wide_pipeline_step_s": -1}, "wide_pipeline_step_s must be seconds"),
    ],
)
def test_a_bad_profile_is_one_line(tmp_path, cluster, bad, message):
    good = {
        "model": GPT,
        "signature": "ab" * 8,
        "ranks": 2,
        "times": {1: {"none": [0.1, 0.3]}},
        "optimizer_s": 0.0,
        "source": "t",
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**cluster.to_dict(), "profiles": [{**good, **bad}]}))
    with pytest.raises(AutoshardError, match=message) as info:
        load_cluster(str(path))
    assert "\n" not in str(info.value) and "calibrate --model" in str(info.value)


def test_a_recomputed_forward_pays_its_dtensor_share_again(cluster, in_repo_module):
    """Recompute reruns a block's forward through DTensor (its op dispatch and the styles' hooks; selective's policy
    serves only the ops' outputs): each recomputed block's DTensor time grows by ``tp_forward_share`` per rerun,
    under selective and full alike, and 1 + σ times in a zero-bubble schedule's split backward (a block with a
    weight: its weight pass reruns it once); nothing outside
    the blocks, nothing without recompute, and the step prices the difference."""
    from autoshard.cost.pipeline_step import stage_forward_reruns
    from autoshard.cost.tp_units import modules_host_s, tp_host_per_unit_s, unit_weight_groups
    from autoshard.passes.planning.tp_layout import hand_tp_layout

    gpt = capture_graph(GPT, use_cache=True)[1]
    host = replace(cluster, host=HostOverheads(**{**TRUE, "tp_forward_share": 0.25}, source="t"))
    no_share = replace(host, host=replace(host.host, tp_forward_share=0.0))
    tables, bare = CostTables(gpt, host), CostTables(gpt, no_share)
    base = Decisions(Mesh(1, 2, 1), 0, 4, 2, sequence_parallel=True)
    hand_tp_layout(tables, base), hand_tp_layout(bare, base)
    modules = modules_host_s(tables, base)
    assert all(t > 0 for t in modules[1:-1])
    assert tp_host_per_unit_s(tables, base) == modules
    for mode in ("selective", "full"):
        config = replace(base, recompute=mode)
        per_unit = tp_host_per_unit_s(tables, config)
        assert per_unit[0] == modules[0] and per_unit[-1] == modules[-1]
        assert per_unit[1:-1] == pytest.approx([1.25 * t for t in modules[1:-1]])
        extra = price_parts(tables, config).host_s - price_parts(bare, config).host_s
        assert extra == pytest.approx(config.num_microbatches * 0.25 * sum(modules[1:-1]), rel=1e-9)
    zb = Decisions(Mesh(1, 2, 2), 0, 1, 8, recompute="full", schedule="zbv", virtual_stages=2)
    groups = unit_weight_groups(gpt)
    assert stage_forward_reruns(tables, zb, 0) == (0.0, *([1.0] * len(gpt.blocks)), 0.0)  # torch runs it whole
    assert all(g > 0 for g in groups[1:-1])
    assert stage_forward_reruns(tables, zb, 1) == (0.0, *([2.0] * len(gpt.blocks)), 0.0)


def test_dtensor_host_counts_every_tensor_parallel_module_in_its_unit(cluster, in_repo_module):
    """Under sequence parallelism GPT-2's blocks hold 4 modules that shard no weight (2 norms on the sequence
    shard, the attention's and the MLP's input gathers) beside 6 sharded linears; ``sequence_module_us`` prices
    each of those per micro-batch in its block's unit and ``tp_module_us`` each linear; without SP only the
    linears run DTensor."""
    from autoshard.cost.tp_units import tp_host_per_unit_s
    from autoshard.passes.planning.tp_layout import hand_tp_layout

    gpt = capture_graph(GPT, use_cache=True)[1]  # with the TP proof: what may be sharded is proved, not assumed
    host = replace(
        cluster,
        host=HostOverheads(
            **{**TRUE, "tp_module_us": 1000.0, "sequence_module_us": 10.0, "collective_wait_us": 0.0}, source="t"
        ),
    )
    tables = CostTables(gpt, host)
    per_unit = {}
    for sp in (False, True):
        config = Decisions(Mesh(1, 2, 1), 0, 8, 1, sequence_parallel=sp)
        choice = hand_tp_layout(tables, config)
        assert choice.sequence_parallel == sp
        per_unit[sp] = tp_host_per_unit_s(tables, config)
    blocks = len(gpt.blocks)
    for u in range(1, blocks + 1):
        assert per_unit[False][u] == pytest.approx(6 * 1e-3)
    # block 0 also scatters the sequence on its way in
    assert per_unit[True][1] == pytest.approx(6 * 1e-3 + 5 * 1e-5)
    for u in range(2, blocks + 1):
        assert per_unit[True][u] == pytest.approx(6 * 1e-3 + 4 * 1e-5)


@pytest.mark.parametrize(
    "config, accumulating",
    [
        (Decisions(Mesh(2, 2, 1), 0, 1, 4), 3),  # replicate beside tp: the last micro-batch all-reduces
        (Decisions(Mesh(2, 2, 1), 1, 1, 4), 3),  # fully_shard beside tp, gradients summed whole until the last
        (Decisions(Mesh(2, 2, 1), 2, 1, 4), 0),  # reduce-scatters every micro-batch
        (Decisions(Mesh(2, 1, 2), 2, 1, 4, schedule="1f1b"), 3),  # torch's stages: every backward but after the last
        (Decisions(Mesh(2, 1, 2), 3, 1, 4, schedule="1f1b"), 0),  # regathers every micro-batch
    ],
)
def test_fsdp2_micro_batches_that_synchronise_nothing_pay_only_its_hooks(gpt, config, accumulating):
    """A micro-batch on which FSDP2 synchronises no gradient (its weights kept gathered, no collective) costs
    ``fsdp_accumulate_unit_us`` per unit, not the synchronising figure (``cost.parts.fsdp_step_host_s``,
    ``fsdp_pipeline_host_s``): with m micro-batches the step's host time is (m − 1)·U·(h_sync − h_acc) below
    pricing each as synchronising, U the units a rank steps through (blocks and root; a stage)."""
    from autoshard.passes.planning.tp_layout import hand_tp_layout

    cluster = load_cluster("local-cpu", devices_per_node=4)
    cuts = (2,) if config.mesh.pp > 1 else None
    host_s = {}
    for name, accumulate_us in (("synced", TRUE["fsdp_unit_zero2_us"]), ("measured", TRUE["fsdp_accumulate_unit_us"])):
        host = HostOverheads(
            **{**TRUE, "fsdp_zero2_us_per_mib": 0.0, "fsdp_accumulate_unit_us": accumulate_us}, source="t"
        )
        tables = CostTables(gpt, replace(cluster, host=host))
        hand_tp_layout(tables, config)
        host_s[name] = price_parts(tables, config, cuts).host_s
    units = len(gpt.blocks) + 1 if config.mesh.pp == 1 else 1
    saved_s = accumulating * units * (TRUE["fsdp_unit_zero2_us"] - TRUE["fsdp_accumulate_unit_us"]) * 1e-6
    assert host_s["synced"] - host_s["measured"] == pytest.approx(saved_s, abs=1e-12)


def test_the_pipeline_fit_on_shared_cores_prices_one_pipeline_on_its_cores(gpt):
    """With 4 ranks on 2 cores, ``_pipeline_times`` runs two 2-stage pipelines side by side, each rank its own
    pipeline's (no dp wrapper, a plain AdamW): ``pipeline_residual`` prices one of them on 1 core (the node's 2 over
    the 2 pipelines), not a dp 2 × pp 2 plan whose FSDP2 hooks and sharded optimizer the timed step never ran, so it
    gives back the schedule time such a pipeline was priced with."""
    from autoshard.model_probes import MODEL_PIPELINE_MICROBATCHES, ProfileRequest, pipeline_residual, pipeline_splits

    times = {1: {"none": (0.002, 0.006)}, 4: {"none": (0.005, 0.015)}}
    request = ProfileRequest(GPT, graph_signature(gpt), tuple(b.path for b in gpt.blocks), (1, 4))
    cuts = (request.blocks.index(pipeline_splits(request, 2)[0]),)
    node = load_cluster("local-cpu", devices_per_node=4)
    host = HostOverheads(**TRUE, shared_cores=2.0, source="t")
    one_core = replace(node, host=replace(host, shared_cores=1.0))
    known = profile_of(gpt, times, pipeline_microbatch_s=0.0023, pipeline_step_s=0.0041)
    tables = CostTables(gpt, replace(one_core, profiles=(known,)))
    steps = {
        m: price_parts(tables, replace(PIPELINE_1F1B, num_microbatches=m), cuts).step_time_s
        for m in MODEL_PIPELINE_MICROBATCHES
    }
    profiled = replace(node, host=host, profiles=(profile_of(gpt, times),))
    assert pipeline_residual(request, steps, profiled, 4) == pytest.approx((0.0023, 0.0041), rel=1e-6)


def test_the_wide_pipeline_fit_inverts_the_cost_model_s_pipeline_of_as_many_stages(gpt):
    """With 4 ranks and 4 blocks ``_pipeline_times`` also runs one 4-stage pipeline (``wide_stages``), cut before
    blocks 1, 2 and 3 (``pipeline_splits``): ``pipeline_residual`` with ``stages`` 4 prices it on the node's 2 cores
    and gives back the schedule time such a pipeline was priced with, whatever the 2-stage fit says."""
    from autoshard.model_probes import (
        ProfileRequest,
        pipeline_microbatches,
        pipeline_residual,
        pipeline_splits,
        wide_stages,
    )

    times = {1: {"none": (0.002, 0.006)}, 4: {"none": (0.005, 0.015)}}
    request = ProfileRequest(GPT, graph_signature(gpt), tuple(b.path for b in gpt.blocks), (1, 4))
    assert len(request.blocks) == 4 and wide_stages(request, 4) == 4
    assert pipeline_splits(request, 4) == request.blocks[1:]
    assert pipeline_microbatches(4) == (4, 8, 16) and min(pipeline_microbatches(3)) >= 3  # 1F1B: m >= stages
    cuts = (1, 2, 3)
    node = replace(
        load_cluster("local-cpu", devices_per_node=4), host=HostOverheads(**TRUE, shared_cores=2.0, source="t")
    )
    pairs = dict(pipeline_microbatch_s=0.0009, pipeline_step_s=0.0002)
    known = profile_of(gpt, times, **pairs, wide_pipeline_stages=4, wide_pipeline_microbatch_s=0.0031)
    known = replace(known, wide_pipeline_step_s=0.0057)
    tables = CostTables(gpt, replace(node, profiles=(known,)))
    pp4 = Decisions(Mesh(1, 1, 4), 0, 1, 4, schedule="1f1b")
    steps = {
        m: price_parts(tables, replace(pp4, num_microbatches=m), cuts).step_time_s for m in pipeline_microbatches(4)
    }
    profiled = replace(node, profiles=(profile_of(gpt, times, **pairs),))
    assert pipeline_residual(request, steps, profiled, 4, stages=4) == pytest.approx((0.0031, 0.0057), rel=1e-6)


@pytest.mark.parametrize(
    "ranks, blocks, wide", [(2, 4, None), (4, 4, 4), (8, 4, 4), (6, 4, 3), (4, 2, None), (8, 12, 8), (16, 12, 8)]
)
def test_the_wide_pipeline_has_as_many_stages_as_the_ranks_and_blocks_allow(ranks, blocks, wide):
    from autoshard.model_probes import ProfileRequest, pipeline_splits, wide_stages

    request = ProfileRequest(GPT, "ab" * 8, tuple(f"h.{i}" for i in range(blocks)), (1,))
    assert wide_stages(request, ranks) == wide
    if wide is not None:
        splits = pipeline_splits(request, wide)
        assert len(splits) == wide - 1 and list(splits) == sorted(set(splits), key=request.blocks.index)
        assert request.blocks[0] not in splits


def test_each_pipeline_is_priced_with_the_fit_nearest_in_stages(gpt):
    """A profile with both pipeline fits prices 2- and 3-stage pipelines with the pairs' (a tie goes to 2), 4 stages and
    more with the wide one's (``ModelProfile.pipeline_fit``); without the wide fit every pipeline takes the pairs'."""
    times = {1: {"none": (0.002, 0.006)}, 4: {"none": (0.005, 0.015)}}
    pairs = profile_of(gpt, times, pipeline_microbatch_s=0.001, pipeline_step_s=0.002)
    both = replace(pairs, wide_pipeline_stages=4, wide_pipeline_microbatch_s=0.003, wide_pipeline_step_s=0.004)
    assert [both.pipeline_fit(p) for p in (2, 3, 4, 8)] == [(0.001, 0.002)] * 2 + [(0.003, 0.004)] * 2
    assert {pairs.pipeline_fit(p) for p in (2, 3, 4, 8)} == {(0.001, 0.002)}
    node = replace(
        load_cluster("local-cpu", devices_per_node=4), host=HostOverheads(**TRUE, shared_cores=2.0, source="t")
    )

    def price(config, cuts, profile):
        return price_parts(CostTables(gpt, replace(node, profiles=(profile,))), config, cuts).step_time_s

    pp2, pp4 = Decisions(Mesh(2, 1, 2), 0, 1, 4, schedule="1f1b"), Decisions(Mesh(1, 1, 4), 0, 1, 4, schedule="1f1b")
    assert price(pp2, (2,), both) == price(pp2, (2,), pairs)
    assert price(pp4, (1, 2, 3), both) > price(pp4, (1, 2, 3), pairs)


def test_the_tp_fit_inverts_the_cost_model_s_dtensor_time(cluster, gpt):
    """``model_probes.tp_residual`` on micro-batches whose DTensor time per module, and the share of it a recomputed
    forward runs again, the cost model prices from the model's profile (``ModelProfile.tp_module_s``,
    ``sequence_module_s``, ``tp_forward_share``, as ``cost.step`` adds them to a step) gives the three figures back;
    steps that take no longer than the rest of the price give 0 and no share (the host probes' figures no longer count
    once the profile has its own). The layouts timed shard every module the proof allows, with and without sequence
    parallelism, whatever the link would choose."""
    from autoshard.cost.tp_units import tp_host_per_unit_s
    from autoshard.model_probes import (
        RECOMPUTED,
        probe_layouts,
        profile_request,
        tp_microbatch_s,
        tp_probe_decisions,
        tp_residual,
    )

    times = {
        1: {"none": (0.002, 0.006), "full": (0.003, 0.009)},
        4: {"none": (0.005, 0.015), "full": (0.006, 0.021)},
    }
    request = profile_request(GPT, (1, 4))
    _, proved = capture_graph(GPT)
    layouts = probe_layouts(proved)
    assert set(layouts) == {"tp", "sp"} and dict(request.tp_layouts) == {
        name: tuple(sorted(c.sharded.items())) for name, c in layouts.items()
    }
    assert layouts["sp"].sequence_parallel and all(style != "replicate" for style in layouts["tp"].sharded.values())
    host = HostOverheads(**TRUE, source="t")  # the probes' own figures, which the model's replace
    timed = {name: tp_probe_decisions(name, 1) for name in layouts}
    timed["sp" + RECOMPUTED] = replace(timed["sp"], recompute="full")

    def tables_with(*figures):
        fields = dict(zip(("tp_module_s", "sequence_module_s", "tp_forward_share"), figures))
        tables = CostTables(
            proved, replace(cluster, host=host, profiles=(replace(profile_of(proved, times), **fields),))
        )
        for name, choice in layouts.items():
            tables.add_tp_layout(choice, 1, name == "sp")
        return tables

    def steps(*figures):
        """The timed steps: each price without DTensor time, plus what the step's price adds for it."""
        known, none = tables_with(*figures), tables_with(0.0, 0.0, 0.0)
        out = {}
        for name, config in timed.items():
            dtensor_s = price_parts(known, config).step_time_s - price_parts(none, config).step_time_s
            assert dtensor_s == pytest.approx(
                sum(tp_host_per_unit_s(known, config)) - sum(tp_host_per_unit_s(none, config))
            )
            out[name] = tp_microbatch_s(none, config) + dtensor_s
        return out

    profiled = replace(cluster, host=host, profiles=(profile_of(proved, times),))
    assert tp_residual(request, steps(0.0021, 0.0034, 0.41), profiled) == pytest.approx(
        (0.0021, 0.0034, 0.41), rel=1e-6
    )
    nothing = tp_residual(request, steps(0.0, 0.0, 0.0), profiled)  # no DTensor time: no share of it to fit
    assert nothing[:2] == pytest.approx((0.0, 0.0), abs=1e-9) and nothing[2] is None
    only_tp = {"tp": steps(0.0021, 0.0, 0.0)["tp"]}
    assert tp_residual(request, only_tp, profiled) == pytest.approx((0.0021, TRUE["sequence_module_us"] * 1e-6, None))


def test_a_profile_keeps_the_modelled_gain_of_compiled_blocks(gpt):
    """The profile times the eager model; a compiled variant's forward and backward are the measured ones
    times the cost model's ratio of the variant to the eager model, compute and host (``cost.tables.variant_totals``),
    not the eager totals again."""

    def forward_backward(units) -> tuple[float, float]:
        host_f, host_b = units.host_forward_s or (0.0,), units.host_backward_s or (0.0,)
        return sum(units.forward_s) + sum(host_f), sum(units.backward_s) + sum(host_b)

    h100 = load_cluster("dgx-h100", nodes=1)
    times = {1: {"none": (0.002, 0.006)}, 4: {"none": (0.005, 0.015)}}
    modelled, profiled = CostTables(gpt, h100), CostTables(gpt, replace(h100, profiles=(profile_of(gpt, times),)))
    eager = forward_backward(profiled.units(4, "none"))
    for variant in (dict(compiled=True),):  # float8 and the compiled loss go the same way (the GPT's are priced alike)
        gain = [
            v / e
            for v, e in zip(
                forward_backward(modelled.units(4, "none", **variant)), forward_backward(modelled.units(4, "none"))
            )
        ]
        assert any(abs(g - 1) > 0.01 for g in gain), variant  # the variant is priced apart from the eager model
        got = forward_backward(profiled.units(4, "none", **variant))
        assert got == pytest.approx([t * g for t, g in zip(eager, gain)], rel=1e-9)
