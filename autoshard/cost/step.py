"""One training step of a configuration, priced as a sum of named parts.

With m micro-batches per step and per-micro-batch compute c = fwd + bwd + recompute::

    step_time = m·c + t_optimizer + comm_exposed + bubble
    comm_exposed = Σ over collectives of max(0, t_comm − t_compute it hides behind),
                   never less than the part that has nothing to hide behind

DDP (ZeRO-0/1) all-reduces gradients in buckets of B bytes during the last micro-batch's
backward (``no_sync`` on the others); the last bucket is always exposed. ZeroRedundancy-
Optimizer (ZeRO-1) then broadcasts each rank's updated shard (an all-gather of the weights),
exposed. FSDP2 (ZeRO-2/3) all-gathers each block's weights before its forward (prefetched
behind the previous block's compute; the first is exposed) and reduce-scatters its gradients
after its backward (the last is exposed); ZeRO-3 gathers again for backward. Both do this
every micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.cost import comm
from autoshard.cost.compute import ComputeTime, microbatch_compute, model_flops_per_sample
from autoshard.cost.memory import (Precision, activation_bytes, fsdp_unit_bytes, model_state_bytes,
                                   precision_for_backend)
from autoshard.ir.graph import OpGraph
from autoshard.ir.plan import Memory, Mesh, Predicted
from autoshard.ir.topology import Cluster, LinkSpec

ALLOCATOR_SLACK = 0.05  # caching-allocator fragmentation, a few % in practice (torch.cuda.memory_stats)
ADAM_BYTES_PER_PARAM = 28  # fp32 Adam step: read w, g, m, v (16 B), write w, m, v (12 B)
BUCKET_CAP_CHOICES_MB = (1.0, 5.0, 25.0, 100.0)  # DDP bucket sizes the cost model picks from


@dataclass(frozen=True)
class Config:
    """One point of the search space."""

    mesh: Mesh
    zero_stage: int
    microbatch_size: int
    num_microbatches: int
    recompute: str = "none"
    schedule: str = "none"
    ddp_bucket_cap_mb: float = 25.0


@dataclass(frozen=True)
class CommTime:
    total_s: float
    exposed_s: float


def dp_group_ranks(mesh: Mesh) -> list[int]:
    """Ranks of the DP group of rank 0; the mesh is laid out (pp, dp, tp), tp innermost."""
    return [d * mesh.tp for d in range(mesh.dp)]


def price(graph: OpGraph, cluster: Cluster, config: Config, global_batch: int) -> Predicted:
    """Predicted step time, memory and throughput of ``config`` (see module docstring)."""
    precision = precision_for_backend(cluster.backend)
    micro = microbatch_compute(graph, config.microbatch_size, config.recompute, cluster.device,
                               precision.activation_bytes)
    compute_s = config.num_microbatches * micro.total_s + optimizer_step_s(graph, config, cluster, precision)
    comms = dp_comm_time(graph, cluster, config, micro, precision)
    step_s = compute_s + comms.exposed_s
    memory = memory_per_rank(graph, config, precision)
    flops = global_batch * model_flops_per_sample(graph)
    return Predicted(
        step_time_s=step_s,
        compute_s=compute_s,
        comm_exposed_s=comms.exposed_s,
        bubble_s=0.0,
        memory_peak_bytes_per_rank=memory.peak_bytes,
        memory=memory,
        tokens_per_s=global_batch * graph.tokens_per_sample / step_s,
        samples_per_s=global_batch / step_s,
        mfu=flops / (step_s * config.mesh.world_size * cluster.device.peak_tflops * 1e12),
        comm_total_s=comms.total_s,
    )


def optimizer_step_s(graph: OpGraph, config: Config, cluster: Cluster, precision: Precision) -> float:
    """Adam is memory-bound: bytes of the local shard of state over memory bandwidth."""
    shards = config.mesh.dp if config.zero_stage >= 1 else 1
    local_params = graph.param_count / (config.mesh.tp * config.mesh.pp * shards)
    return local_params * ADAM_BYTES_PER_PARAM / (cluster.device.memory_bandwidth_gbps * 1e9)


def memory_per_rank(graph: OpGraph, config: Config, precision: Precision) -> Memory:
    params = graph.param_count // (config.mesh.tp * config.mesh.pp)
    p, g, o = model_state_bytes(params, config.zero_stage, config.mesh.dp, precision)
    acts = activation_bytes(graph, config.microbatch_size, config.recompute, precision)
    return Memory.from_parts(ALLOCATOR_SLACK, params_bytes=p, grads_bytes=g, optimizer_bytes=o,
                             activations_bytes=acts, transient_bytes=transient_bytes(graph, config, precision))


def transient_bytes(graph: OpGraph, config: Config, precision: Precision) -> int:
    """ZeRO-3: the unit being used and the one prefetched, unsharded, and one unit's gradients."""
    unit = fsdp_unit_bytes(graph, precision)
    if config.zero_stage == 3 and config.mesh.dp > 1:
        return 2 * unit + unit * precision.grad_bytes // precision.param_bytes
    if config.zero_stage == 2 and config.mesh.dp > 1:
        return unit * precision.grad_bytes // precision.param_bytes
    return 0


def dp_comm_time(graph: OpGraph, cluster: Cluster, config: Config, micro: ComputeTime,
                 precision: Precision) -> CommTime:
    dp = config.mesh.dp
    if dp == 1:
        return CommTime(0.0, 0.0)
    link = cluster.group_link(dp_group_ranks(config.mesh))
    params = graph.param_count / (config.mesh.tp * config.mesh.pp)
    if config.zero_stage <= 1:
        return _ddp_comm(params, config, micro, precision, link)
    return _fsdp_comm(graph, params, config, micro, precision, link)


def choose_bucket_cap_mb(graph: OpGraph, cluster: Cluster, config: Config) -> float:
    """The DDP bucket size (from BUCKET_CAP_CHOICES_MB) with the least exposed communication."""
    if config.zero_stage >= 2 or config.mesh.dp == 1:
        return config.ddp_bucket_cap_mb
    precision = precision_for_backend(cluster.backend)
    micro = microbatch_compute(graph, config.microbatch_size, config.recompute, cluster.device,
                               precision.activation_bytes)

    def exposed(cap_mb: float) -> float:
        trial = Config(**{**config.__dict__, "ddp_bucket_cap_mb": cap_mb})
        return dp_comm_time(graph, cluster, trial, micro, precision).exposed_s

    return min(BUCKET_CAP_CHOICES_MB, key=lambda cap: (exposed(cap), cap))


def _ddp_comm(params: float, config: Config, micro: ComputeTime, precision: Precision, link: LinkSpec) -> CommTime:
    dp = config.mesh.dp
    grad_bytes = params * precision.grad_bytes
    buckets = max(1, math.ceil(grad_bytes / (config.ddp_bucket_cap_mb * 2**20)))
    per_bucket_s = comm.allreduce_s(grad_bytes / buckets, dp, link)
    allreduce_total_s = buckets * per_bucket_s
    exposed_s = max(allreduce_total_s - micro.backward_s, per_bucket_s)
    if config.zero_stage == 1:  # ZeroRedundancyOptimizer broadcasts the updated shards
        gather_s = comm.all_gather_s(params * precision.param_bytes, dp, link)
        return CommTime(allreduce_total_s + gather_s, exposed_s + gather_s)
    return CommTime(allreduce_total_s, exposed_s)


def _fsdp_comm(graph: OpGraph, params: float, config: Config, micro: ComputeTime, precision: Precision,
               link: LinkSpec) -> CommTime:
    dp, units = config.mesh.dp, max(1, len(graph.blocks)) + 1
    gather_s = comm.all_gather_s(params * precision.activation_bytes, dp, link)
    scatter_s = comm.reduce_scatter_s(params * precision.grad_bytes, dp, link)
    regather_s = gather_s if config.zero_stage == 3 else 0.0
    fwd_exposed = max(gather_s - micro.forward_s, gather_s / units)
    bwd_exposed = max(regather_s + scatter_s - micro.backward_s - micro.recompute_s, scatter_s / units)
    m = config.num_microbatches
    return CommTime(m * (gather_s + regather_s + scatter_s), m * (fwd_exposed + bwd_exposed))
