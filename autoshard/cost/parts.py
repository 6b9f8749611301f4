"""A step's named parts, and the parts every step has: optimizer, gradient accumulation, host time.

Notation as in ``cost.step``: m micro-batches, W the device's memory bandwidth, g bytes per
gradient element::

    grad_accumulation = (m − 1)·3·g·Ψ_acc / W     (``grad_accumulation_s``: each micro-batch after
                        the first reads its gradients and the sum, writes the sum; Ψ_acc the rank's
                        parameters, / dp under FSDP without pipelining)
    optimizer         = k bytes · Ψ_opt / W       (``optimizer_step_s``: fp32 Adam, memory-bound; k the
                        runtime's ``optimizer_bytes_per_param``: 28 fused, 84 torch's foreach AdamW)
    host              = m · Σ_u host(u)  +  m · U · h_fsdp  +  T_opt · h_opt  +  t_loop

**Host** (``cluster.host``, measured by ``autoshard calibrate``; zero in the presets): the op
dispatch of every unit (``cost.units``, forward, backward, recompute), FSDP2's hooks and copies
per unit and micro-batch (U units: the blocks and the root; a pipeline stage is one unit), the
optimizer's loop over its T_opt parameter tensors (FSDP2's sharded DTensors cost more), and
with pipelining the schedule's bookkeeping per stage and micro-batch (``cost.pipeline_step``).
ZeRO-1's ZeroRedundancyOptimizer broadcasts each parameter tensor alone: T broadcasts' latencies.
Where the cluster has the model's measured profile (``cost.profile``), its AdamW step replaces
the optimizer's formula and loop (``optimizer_parts``), and t_loop is its step loop: what the program's
step does once besides forward, backward and the optimizer (the batch's draw, the scheduler, freeing the
gradients, the loss's mean over the ranks, the log; ``step_loop_s``). A step whose ranks share no
collective (one data-parallel rank, no pipeline, a tensor-parallel layout that shards nothing) runs
no all-reduce of its loss either, and does not wait for the slowest rank: it pays t_loop − t_sync,
t_sync what the profile's step loop spent in that all-reduce (``step_sync_s``). A pipeline pays the
whole loop: its loss's all-reduce ends its schedule's step, which the model's pipeline fit times, but
that fit's per-step term is clamped at 0 and need not hold it (4 ranks, 2026-11-28: without the loop's
sync the 4-stage 1F1B at b 2 was priced 31.6 ms and ran 34.5-37.8, above dp 4 b 2 at 30.1-31.6). Without a profile
t_loop = 0: on a GPU it is a fraction of a millisecond against steps of seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.cost.compute import model_flops_per_sample
from autoshard.cost.memory import Precision
from autoshard.cost.tables import ADAM_FUSED_BYTES_PER_PARAM, CostTables
from autoshard.ir.decisions import Decisions
from autoshard.ir.graph import OpGraph
from autoshard.ir.plan import Memory, Predicted
from autoshard.ir.topology import Cluster

ADAM_BYTES_PER_PARAM = ADAM_FUSED_BYTES_PER_PARAM  # fp32 Adam step: read w, g, m, v (16 B), write w, m, v (12 B)


@dataclass(frozen=True)
class StepParts:
    """One step's time by named part (seconds); the fields add up to ``step_time_s`` (``cost.step``).

    Pipelines: the compute parts are the slowest pp rank's (it sets the pace)."""

    forward_s: float
    backward_s: float
    recompute_s: float
    grad_accumulation_s: float
    optimizer_s: float
    tp_comm_s: float  # TP collectives, exposed: they sit between dependent matmuls
    p2p_s: float  # pipeline sends and receives, exposed
    dp_comm_exposed_s: float
    bubble_s: float
    dp_comm_total_s: float  # hidden or not (not part of the step time)
    memory: Memory
    host_s: float = 0.0  # host overheads not hidden by the device (module doc, "Host")
    ep_comm_s: float = 0.0  # expert parallelism's all-to-alls, exposed (``cost.experts``)
    cp_comm_s: float = 0.0  # context parallelism's ring exchange, exposed (``cost.context_parallel``)
    pp_rank_memory: tuple[Memory, ...] = ()  # pipelines: each pp rank's (``memory`` is the largest)
    offload_s: float = 0.0  # host offload's copies over the host link, exposed (``cost.offload``)
    host_memory_bytes_per_node: int = 0  # host offload: the state a node's host memory holds (``cost.offload``)

    @property
    def compute_s(self) -> float:
        return (
            self.forward_s
            + self.backward_s
            + self.recompute_s
            + self.grad_accumulation_s
            + self.optimizer_s
            + self.host_s
        )

    @property
    def comm_exposed_s(self) -> float:
        return self.tp_comm_s + self.p2p_s + self.dp_comm_exposed_s + self.ep_comm_s + self.cp_comm_s + self.offload_s

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.comm_exposed_s + self.bubble_s


def predicted(tables: CostTables, config: Decisions, global_batch: int, parts: StepParts) -> Predicted:
    """The plan's ``Predicted``: the parts summed, throughput and MFU at ``global_batch``."""
    graph, cluster = tables.graph, tables.cluster
    step_s = parts.step_time_s
    flops = global_batch * model_flops_per_sample(graph)
    return Predicted(
        step_time_s=step_s,
        compute_s=parts.compute_s,
        comm_exposed_s=parts.comm_exposed_s,
        bubble_s=parts.bubble_s,
        memory_peak_bytes_per_rank=parts.memory.peak_bytes,
        memory=parts.memory,
        tokens_per_s=global_batch * graph.tokens_per_sample / step_s,
        samples_per_s=global_batch / step_s,
        mfu=flops / (step_s * config.mesh.world_size * cluster.mean_peak_tflops * 1e12),
        comm_total_s=parts.tp_comm_s + parts.p2p_s + parts.dp_comm_total_s + parts.ep_comm_s + parts.offload_s,
        pp_rank_memory=parts.pp_rank_memory,
        host_memory_bytes_per_node=parts.host_memory_bytes_per_node,
    )


def optimizer_step_s(
    local_params: float, config: Decisions, cluster: Cluster, bytes_per_param: int = ADAM_BYTES_PER_PARAM
) -> float:
    """Adam is memory-bound: bytes of the local shard of state over memory bandwidth."""
    shards = config.dp_shard if config.zero_stage >= 1 else 1
    return local_params / shards * bytes_per_param / (cluster.device.memory_bandwidth_gbps * 1e9)


def param_tensors(graph: OpGraph) -> int:
    """Parameter tensors of the model (not buffers; a tied one once)."""
    return sum(not p.is_buffer for p in graph.params)


def fsdp_host_s(
    cluster: Cluster, config: Decisions, units: int, params: float, precision: Precision, synced: bool = True
) -> float:
    """FSDP2's host time per micro-batch over ``units`` units holding ``params`` parameters: on a micro-batch that
    synchronises its gradients U·a + c·MiB(params) (``HostOverheads``: per unit, and per MiB copied in and out), on one
    that does not (``synced`` False: weights kept gathered, gradients summed whole, no collective) U·a_acc
    (``fsdp_accumulate_unit_us``); 0 without FSDP."""
    if config.mesh.dp == 1 or not config.dp_runtime.fsdp2:
        return 0.0
    host, z3 = cluster.host, config.zero_stage == 3
    if not synced:
        return units * host.fsdp_accumulate_unit_us * 1e-6
    per_unit_us = host.fsdp_unit_zero3_us if z3 else host.fsdp_unit_zero2_us
    per_mib_us = host.fsdp_zero3_us_per_mib if z3 else host.fsdp_zero2_us_per_mib
    return (units * per_unit_us + per_mib_us * params * precision.param_bytes / 2**20) * 1e-6


def fsdp_step_host_s(cluster: Cluster, config: Decisions, units: int, params: float, precision: Precision) -> float:
    """FSDP2's host time over a step's m micro-batches of an SPMD step: m synchronised ones, or with a runtime that
    synchronises only the last (``DPRuntime.sync_every_microbatch`` False: ZeRO-0 and 1 beside tp, ``grad_sync``)
    m − 1 that accumulate and one that synchronises (``fsdp_host_s``)::

        H = m·h_sync            or      (m − 1)·h_acc + h_sync"""
    m = config.num_microbatches
    synced = fsdp_host_s(cluster, config, units, params, precision)
    if config.dp_runtime.sync_every_microbatch:
        return m * synced
    return (m - 1) * fsdp_host_s(cluster, config, units, params, precision, synced=False) + synced


def fsdp_pipeline_host_s(
    cluster: Cluster, config: Decisions, units: int, params: float, precision: Precision
) -> tuple[float, float]:
    """FSDP2's host time on a pipeline rank of ``units`` stage modules, (per micro-batch, per step). torch's stages run
    every backward without synchronising gradients (``PipelineStage.backward_maybe_with_nosync``) and synchronise once
    after the last (``perform_reduce_grad``). Under ZeRO-0 to 2 the weights stay gathered between micro-batches:
    h_acc per micro-batch and h_sync − h_acc once; under ZeRO-3 they are gathered again each micro-batch: h_sync
    each (``fsdp_host_s``)."""
    synced = fsdp_host_s(cluster, config, units, params, precision)
    if config.zero_stage == 3:
        return synced, 0.0
    accumulate = fsdp_host_s(cluster, config, units, params, precision, synced=False)
    return accumulate, synced - accumulate


def dp_host_s(cluster: Cluster, config: Decisions, tensors: int) -> float:
    """DDP's hooks on the synchronising micro-batch, and ZeroRedundancyOptimizer's step, per tensor."""
    if config.mesh.dp == 1 or config.dp_runtime.fsdp2:
        return 0.0
    host = cluster.host
    return tensors * (host.ddp_tensor_us + (host.zero1_tensor_us if config.zero_stage == 1 else 0.0)) * 1e-6


def optimizer_parts(tables: CostTables, config: Decisions, local_params: float, tensors: int) -> tuple[float, float]:
    """(optimizer_s, its host time): the model's measured AdamW step (``cost.profile``) over the rank's
    share of the parameters where there is one and the parameters are plain tensors; else the
    memory-bound formula and the per-tensor loop."""
    profile, cluster = tables.profile, tables.cluster
    sharded = config.mesh.dp > 1 and config.dp_runtime.fsdp2  # DTensor parameters
    if profile is not None and profile.optimizer_s and not sharded:
        shards = config.mesh.dp if config.zero_stage == 1 else 1
        return profile.optimizer_s * local_params / tables.graph.param_count / shards, 0.0
    return (
        optimizer_step_s(local_params, config, cluster, tables.runtime.optimizer_bytes_per_param),
        optimizer_host_s(cluster, config, tensors),
    )


def step_loop_s(tables: CostTables, synced: bool = True) -> float:
    """t_loop (module doc): the model's measured step loop, without its sync where the step's ranks share no
    collective (``synced`` False), or 0 without its profile."""
    profile = tables.profile
    if profile is None:
        return 0.0
    return profile.step_loop_s if synced else max(0.0, profile.step_loop_s - profile.step_sync_s)


def pipeline_host_s(tables: CostTables, stages: int) -> tuple[float, float]:
    """A pipeline schedule's own time over ``stages`` pipeline ranks, (per stage and micro-batch, per step): the
    model's, measured on itself by ``calibrate --model`` on the timed pipeline nearest in stages
    (``ModelProfile.pipeline_fit``), else the host probes' (``pipeline_microbatch_us``, ``pipeline_step_us``)."""
    profile, host = tables.profile, tables.cluster.host
    fit = profile.pipeline_fit(stages) if profile is not None else None
    if fit is not None:
        return fit
    return host.pipeline_microbatch_us * 1e-6, host.pipeline_step_us * 1e-6


def optimizer_host_s(cluster: Cluster, config: Decisions, tensors: int) -> float:
    """The optimizer's loop over its parameter tensors: T·h_opt (FSDP2: sharded tensors; ZeRO-1:
    each rank steps T/dp of them)."""
    host = cluster.host
    if config.mesh.dp > 1 and config.dp_runtime.fsdp2:
        return tensors * host.sharded_optimizer_tensor_us * 1e-6
    shards = config.mesh.dp if config.zero_stage == 1 else 1
    return tensors / shards * host.optimizer_tensor_us * 1e-6


def grad_accumulation_s(local_params: float, config: Decisions, precision: Precision, cluster: Cluster) -> float:
    """(m − 1)·3·g·Ψ_acc / W: every micro-batch after the first adds its gradients to the sum (read both,
    write the sum; g bytes each). Ψ_acc: the rank's parameters, / dp where FSDP keeps the sum sharded
    (ZeRO-2/3 without pipelining; with pipelining the stage's gradients accumulate unsharded)."""
    runtime = config.dp_runtime
    shards = config.dp_shard if runtime.fsdp2 and runtime.sync_every_microbatch and config.mesh.pp == 1 else 1
    moved = (config.num_microbatches - 1) * 3 * precision.grad_bytes * local_params / shards
    return moved / (cluster.device.memory_bandwidth_gbps * 1e9)
