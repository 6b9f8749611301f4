"""Data-parallel communication and what hides it; the mesh's groups and their links.

DDP (ZeRO-0/1) all-reduces gradients in buckets of B bytes during the last micro-batch's
backward (``no_sync`` on the others); the last bucket is always exposed. ZeroRedundancy-
Optimizer (ZeRO-1) then broadcasts each rank's updated shard (an all-gather of the weights),
exposed. FSDP2 (ZeRO-2/3) all-gathers each block's weights before its forward (prefetched
behind the previous block's compute; the first is exposed) and reduce-scatters its gradients
after its backward (the last is exposed); ZeRO-3 gathers again for backward. Both do this
every micro-batch, one collective per unit (U = blocks + 1 latencies each way:
``per_unit_collectives_s``). DP collectives run on the dp group of rank 0 (ranks d·tp); a group that
spans n nodes with g members per node is priced as the cheaper of a flat ring on the NIC
share and the two-level form (``dp_collective_s``)::

    AR_2(S) = RS(S, g, intra) + AR(S/g, n, inter) + AG(S, g, intra)   (comm.hierarchical_allreduce_s)
    RS_2(S) = RS(S, g, intra) + RS(S/g, n, inter)         AG_2(S) = AG(S/g, n, inter) + AG(S, g, intra)

On CPU ranks (gloo) collectives and compute share the cores (``hides_comm`` false): the bytes a
collective moves (copies and reductions on those cores) are never hidden; only its waiting is,
where it is issued ahead of compute: FSDP2's per-unit latencies U·C(0) hide behind the forward
(all-gathers) and backward (reduce-scatters, ZeRO-3's re-gathers), the first unit's never.

How each ZeRO stage runs is ``ir.decisions.DP_RUNTIMES``. With tp or pp, ZeRO-0 is FSDP2's
``replicate``: one all-reduce per unit on the last micro-batch (its backward hides them as it hides
DDP's buckets); ZeRO-1 is ``fully_shard`` with the gradients summed whole until the last micro-batch
(Megatron's distributed optimizer): one all-gather per unit in the first forward and one
reduce-scatter per unit in the last backward, per step rather than per micro-batch.

HSDP (``Decisions.dp_replicate`` = n > 1): FSDP2 gathers and scatters over the dp_shard = dp / n
ranks of one node, and all-reduces each unit's reduced shard (S / dp_shard bytes) over the n
replicas, one per node (``replicate_allreduce_s``): the cross-node link carries 1 / dp_shard of
the gradients, once per micro-batch.

DP × PP (``pipeline_dp_comm``) is FSDP2 on each stage module (one unit): the stage's weights are
gathered once and kept unsharded until the last micro-batch, gradients accumulate unsharded and
are reduce-scattered once (``torch.distributed.pipelining`` turns resharding and gradient sync
off until the last backward). ZeRO-2: one all-gather and one reduce-scatter per step; ZeRO-3
gathers again around each micro-batch (2m all-gathers); ZeRO-1 is ZeRO-2's program (the schedule
keeps gradients whole), ZeRO-0 (``replicate``, Megatron-LM's DDP pipelines) one all-reduce after
the flush. Nothing overlaps them: exposed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from autoshard.cost import comm
from autoshard.cost.compute import ComputeTime
from autoshard.cost.memory import Precision
from autoshard.cost.parts import param_tensors
from autoshard.cost.tables import CostTables, hides_comm
from autoshard.cost.tp_units import spmd_microbatch
from autoshard.ir.decisions import Decisions, Mesh
from autoshard.ir.graph import OpGraph
from autoshard.ir.topology import Cluster, LinkSpec

BUCKET_CAP_CHOICES_MB = (1.0, 5.0, 25.0, 100.0)  # DDP bucket sizes the cost model picks from


@dataclass(frozen=True)
class CommTime:
    """Seconds of a step's collectives: all of them, and the part no compute hides."""

    total_s: float
    exposed_s: float


def dp_group_ranks(mesh: Mesh) -> list[int]:
    """Ranks of the DP group of rank 0; the mesh is laid out (pp, dp, tp), tp innermost."""
    return [d * mesh.tp for d in range(mesh.dp)]


def pp_group_ranks(mesh: Mesh) -> list[int]:
    """Ranks of the PP group of rank 0: stage s on pp rank s mod pp."""
    return [k * mesh.dp * mesh.tp for k in range(mesh.pp)]


def ranks_of_stage(mesh: Mesh, stage: int) -> tuple[int, ...]:
    """Global ranks holding pipeline stage ``stage``: pp rank r = stage mod pp, all its dp × tp."""
    r = stage % mesh.pp
    return tuple(r * mesh.dp * mesh.tp + i for i in range(mesh.dp * mesh.tp))


def dp_comm_time(
    graph: OpGraph,
    cluster: Cluster,
    config: Decisions,
    micro: ComputeTime,
    precision: Precision,
    params: float | None = None,
) -> CommTime:
    """DP collectives of one step (module doc); ``params`` per rank, default Ψ/(tp·pp)."""
    if config.mesh.dp == 1:
        return CommTime(0.0, 0.0)
    params = graph.param_count / (config.mesh.tp * config.mesh.pp) if params is None else params
    runtime = config.dp_runtime
    if not runtime.fsdp2:
        return _ddp_comm(cluster, params, config, micro, precision, param_tensors(graph))
    if runtime.name == "replicate":
        return _replicate_comm(graph, cluster, params, config, micro, precision)
    return _fsdp_comm(graph, cluster, params, config, micro, precision)


def shard_mesh(config: Decisions) -> Mesh:
    """The mesh whose dp group is one FSDP2 shard group: dp, or HSDP's dp_shard ranks of one node."""
    return config.mesh if config.dp_replicate == 1 else replace(config.mesh, dp=config.dp_shard)


def replicate_allreduce_s(size_bytes: float, config: Decisions, cluster: Cluster) -> float:
    """HSDP's all-reduce of a reduced shard over the dp_replicate replicas (one rank per node)."""
    if config.dp_replicate == 1:
        return 0.0
    stride = config.dp_shard * config.mesh.tp
    ranks = [k * stride for k in range(config.dp_replicate)]
    return comm.allreduce_s(size_bytes, config.dp_replicate, cluster.group_link(ranks))


def dp_collective_s(kind: str, size_bytes: float, mesh: Mesh, cluster: Cluster) -> float:
    """``kind`` ∈ {allreduce, reduce_scatter, all_gather} over the dp group: flat ring on the
    group's link, or the two-level form when that is cheaper (module doc)."""
    link, g = dp_group_shape(cluster, mesh)
    flat = {"allreduce": comm.allreduce_s, "reduce_scatter": comm.reduce_scatter_s, "all_gather": comm.all_gather_s}[
        kind
    ](size_bytes, mesh.dp, link)
    n = mesh.dp // g
    if n == 1 or g == 1 or mesh.dp % g:
        return flat
    intra = cluster.intra_node
    if kind == "allreduce":
        two_level = comm.hierarchical_allreduce_s(size_bytes, g, n, intra, link)
    elif kind == "reduce_scatter":
        two_level = comm.reduce_scatter_s(size_bytes, g, intra) + comm.reduce_scatter_s(size_bytes / g, n, link)
    else:
        two_level = comm.all_gather_s(size_bytes / g, n, link) + comm.all_gather_s(size_bytes, g, intra)
    return min(flat, two_level)


@functools.lru_cache(maxsize=256)
def dp_group_shape(cluster: Cluster, mesh: Mesh) -> tuple[LinkSpec, int]:
    """(the dp group's link, its members on one node); cached: group_link walks the topology graph."""
    ranks = dp_group_ranks(mesh)
    return cluster.group_link(ranks), sum(cluster.node_of(r) == 0 for r in ranks)


@functools.lru_cache(maxsize=256)
def pp_link(cluster: Cluster, mesh: Mesh) -> LinkSpec:
    """The link between consecutive pipeline stages (pp ranks 0 and 1)."""
    return cluster.group_link(pp_group_ranks(mesh)[:2])


@functools.lru_cache(maxsize=64)
def tp_link(cluster: Cluster, tp: int) -> LinkSpec:
    """The link of the TP group of rank 0 (ranks 0 .. tp − 1)."""
    return cluster.group_link(list(range(tp)))


def choose_bucket_cap_mb(
    graph: OpGraph, cluster: Cluster, config: Decisions, tables: CostTables | None = None
) -> float:
    """The DDP bucket size (from BUCKET_CAP_CHOICES_MB) with the least exposed communication."""
    if config.dp_runtime.fsdp2 or config.mesh.dp == 1 or config.mesh.pp > 1:
        return config.ddp_bucket_cap_mb
    tables = tables or CostTables(graph, cluster)
    micro, _, local = spmd_microbatch(tables, config)

    def exposed(cap_mb: float) -> float:
        trial = replace(config, ddp_bucket_cap_mb=cap_mb)
        return dp_comm_time(graph, cluster, trial, micro, tables.precision, local).exposed_s

    return min(BUCKET_CAP_CHOICES_MB, key=lambda cap: (exposed(cap), cap))


def _ddp_comm(
    cluster: Cluster, params: float, config: Decisions, micro: ComputeTime, precision: Precision, tensors: int = 1
) -> CommTime:
    mesh = config.mesh
    grad_bytes = params * precision.grad_bytes
    buckets = max(1, math.ceil(grad_bytes / (config.ddp_bucket_cap_mb * 2**20)))
    per_bucket_s = dp_collective_s("allreduce", grad_bytes / buckets, mesh, cluster)
    allreduce_total_s = buckets * per_bucket_s
    hidden_s = micro.backward_s if hides_comm(cluster) else 0.0
    exposed_s = max(allreduce_total_s - hidden_s, per_bucket_s)
    if config.zero_stage == 1:  # ZeroRedundancyOptimizer broadcasts the updated shards
        gather_s = zero1_gather_s(params * precision.param_bytes, tensors, mesh, cluster)
        return CommTime(allreduce_total_s + gather_s, exposed_s + gather_s)
    return CommTime(allreduce_total_s, exposed_s)


def zero1_gather_s(size_bytes: float, tensors: int, mesh: Mesh, cluster: Cluster) -> float:
    """ZeroRedundancyOptimizer's all-gather of the updated weights is one broadcast per parameter
    tensor from the rank that owns it: an all-gather's bytes, and T − 1 more broadcast latencies,
    (T − 1)·(dp − 1)·α_broadcast. It issues them all at once (async), so where ``calibrate`` measured
    what a tensor costs as issued (``host.zero1_tensor_us``, in ``dp_host_s``) that replaces the formula."""
    gather_s = dp_collective_s("all_gather", size_bytes, mesh, cluster)
    if cluster.host.zero1_tensor_us > 0:
        return gather_s
    link, _ = dp_group_shape(cluster, mesh)
    latency_us = link.for_collective("broadcast").latency_us
    return gather_s + max(0.0, (tensors - 1) * (mesh.dp - 1) * latency_us * 1e-6)


def per_unit_collectives_s(kind: str, total_bytes: float, units: int, mesh: Mesh, cluster: Cluster) -> float:
    """FSDP2 runs one collective per unit, each paying the group's latency: U · C(S / U) for S bytes
    over U units (exact for equal units; the α-β forms are affine in S, so unequal units move only
    which of the flat and two-level forms is cheaper)."""
    return units * dp_collective_s(kind, total_bytes / units, mesh, cluster)


def _fsdp_comm(
    graph: OpGraph, cluster: Cluster, params: float, config: Decisions, micro: ComputeTime, precision: Precision
) -> CommTime:
    """FSDP2's per-unit collectives (module doc): every micro-batch (ZeRO-2/3), or once per step
    (ZeRO-1, gradients summed whole); HSDP over a node's dp_shard ranks plus the replicas' all-reduce."""
    mesh, units = shard_mesh(config), max(1, len(graph.blocks)) + 1
    gather_s = per_unit_collectives_s("all_gather", params * precision.activation_bytes, units, mesh, cluster)
    scatter_s = per_unit_collectives_s("reduce_scatter", params * precision.grad_bytes, units, mesh, cluster)
    scatter_s += units * replicate_allreduce_s(params * precision.grad_bytes / config.dp_shard / units, config, cluster)
    regather_s = gather_s if config.zero_stage == 3 else 0.0
    fwd_s, bwd_s = micro.forward_s, micro.backward_s + micro.recompute_s
    if hides_comm(cluster):
        fwd_exposed = max(gather_s - fwd_s, gather_s / units)
        bwd_exposed = max(regather_s + scatter_s - bwd_s, scatter_s / units)
    else:  # CPU ranks: only the waiting hides (module doc)
        gather_wait = per_unit_collectives_s("all_gather", 0.0, units, mesh, cluster)
        scatter_wait = per_unit_collectives_s("reduce_scatter", 0.0, units, mesh, cluster)
        regather_wait = gather_wait if config.zero_stage == 3 else 0.0
        fwd_exposed = gather_s - gather_wait + max(gather_wait - fwd_s, gather_wait / units)
        bwd_exposed = (
            regather_s
            + scatter_s
            - regather_wait
            - scatter_wait
            + max(regather_wait + scatter_wait - bwd_s, scatter_wait / units)
        )
    times = config.num_microbatches if config.dp_runtime.sync_every_microbatch else 1
    return CommTime(times * (gather_s + regather_s + scatter_s), times * (fwd_exposed + bwd_exposed))


def _replicate_comm(
    graph: OpGraph, cluster: Cluster, params: float, config: Decisions, micro: ComputeTime, precision: Precision
) -> CommTime:
    """FSDP2's ``replicate`` (ZeRO-0 with tp or pp): one all-reduce per unit in the last micro-batch's
    backward, behind the units still to run (GPUs); on CPU ranks only their waiting hides."""
    units = max(1, len(graph.blocks)) + 1
    total_s = per_unit_collectives_s("allreduce", params * precision.grad_bytes, units, config.mesh, cluster)
    bwd_s = micro.backward_s + micro.recompute_s
    if hides_comm(cluster):
        return CommTime(total_s, max(total_s - bwd_s, total_s / units))
    wait_s = per_unit_collectives_s("allreduce", 0.0, units, config.mesh, cluster)
    return CommTime(total_s, total_s - wait_s + max(wait_s - bwd_s, wait_s / units))


def pipeline_dp_comm(cluster: Cluster, config: Decisions, params: int, precision: Precision) -> CommTime:
    """Per stage over dp, all exposed: FSDP2 ZeRO-1 (and 2, which runs as 1 in a pipeline) one gather
    + one scatter per step, ZeRO-3 2m gathers; ZeRO-0 (``replicate``, as Megatron-LM's DDP pipelines)
    one all-reduce of the gradients after the flush."""
    if config.mesh.dp == 1:
        return CommTime(0.0, 0.0)
    if config.zero_stage == 0:
        total = dp_collective_s("allreduce", params * precision.grad_bytes, config.mesh, cluster)
        return CommTime(total, total)
    gather_s = dp_collective_s("all_gather", params * precision.activation_bytes, config.mesh, cluster)
    scatter_s = dp_collective_s("reduce_scatter", params * precision.grad_bytes, config.mesh, cluster)
    gathers = 2 * config.num_microbatches if config.zero_stage == 3 else 1
    total = gathers * gather_s + scatter_s
    return CommTime(total, total)
