"""Host offload (``decisions.offload`` "cpu": FSDP2's ``CPUOffloadPolicy``): what moves to the host, and its price.

Under ZeRO-3 each rank holds 1/N of its Ψ parameters (N = ``Decisions.dp_shard``) as fp32 shards (p bytes per
element), their gradients (g) and AdamW's m and v (o). With the policy all three live in the host memory of the
rank's node, pinned, and the device keeps only what a step gathers and makes (the gathered units, the unsharded
gradients until reduced, the activations): ``cost.rank_memory`` counts W = G = O = 0 on the device.

Per step of m micro-batches, over the device's host link of bandwidth B_h (``DeviceSpec.host_link_gbps``, per
direction), with D devices per node sharing the host's memory bandwidth B_m (``host_memory_bandwidth_gbps``)::

    H2D   = m · 2·p·Ψ/N / B_h      every unit's shard copied to the device before each of its two all-gathers
                                   (forward, and again in backward: ZeRO-3 reshards after forward); FSDP2 issues
                                   the copy with the all-gather, prefetched one unit ahead: OVERLAPPED with the
                                   compute, in the window the dp collectives leave free
    D2H_1 = g·Ψ/N / B_h            the first micro-batch's reduce-scattered gradient shards copied to the host,
                                   non-blocking into pinned memory: OVERLAPPED as H2D
    D2H_a = (m − 1)·g·Ψ/N / B_h    every later micro-batch's: FSDP2 copies them blocking, since the CPU adds them
                                   to the sum at once (torch 2.13 ``foreach_reduce``): EXPOSED
    add   = (m − 1)·3·g·Ψ/N / B_r      that sum on the CPU (read both, write one), ``grad_accumulation``
    opt   = K·Ψ/N / B_r            AdamW on the CPU: the optimizer kernel picks torch's per-tensor loop for
                                   host tensors (``runtime.recipe.optimizer_kernel``), the same elementwise passes
                                   as its foreach AdamW, K = 84 bytes per parameter (``cost.eager``)
    B_r   = min(B_m / D, T·B_core) a rank's host bandwidth: the D ranks of a node step at once on its memory
                                   bandwidth, each on T = 1 thread (torchrun and ``autoshard run`` start ranks
                                   with OMP_NUM_THREADS=1), which streams at most B_core = HOST_CORE_GBPS

    exposed = max(0, H2D + D2H_1 − max(0, C − T_dp)) + D2H_a

with C the step's forward, backward and recompute and T_dp its dp collectives' total (they share the window).
The host memory a node needs is D·(p + g + o)·Ψ/N; a plan fits where that is at most HOST_USABLE of the
node's host memory (``host_fits``). The foreach loop's temporaries on the host are one tensor's, left out.

NVMe offload (``--offload nvme``) is refused: no maintained library offloads FSDP2's state to NVMe (DeepSpeed's
ZeRO-Infinity runs its own engine, not FSDP2); it would move the same bytes over the drives' ~7 GB/s each.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.cost.eager import ADAMW_FOREACH_BYTES_PER_PARAM
from autoshard.cost.memory import Precision
from autoshard.ir.decisions import Decisions
from autoshard.ir.topology import Cluster

# The share of a node's host memory offloaded state may take: the OS, the data loaders and the ranks' Python
# processes (torch's CPU libraries, the program) keep the rest.
HOST_USABLE = 0.8
CPU_ADAM_BYTES_PER_PARAM = ADAMW_FOREACH_BYTES_PER_PARAM  # per-tensor AdamW on the host: foreach's passes (doc)
# One core's streaming bandwidth, which a rank's single-threaded CPU work reaches at most: single-thread STREAM on
# server cores (Sapphire Rapids, EPYC) reads 10-15 GB/s; torch's per-tensor AdamW on one thread measured 102 M
# parameters/s = 8.6 GB/s at K = 84 B on dev-cpu (EPYC, 2026-12-02). The low end of the first.
HOST_CORE_GBPS = 10.0
THREADS_PER_RANK = 1  # OMP_NUM_THREADS as ranks are started (``launch.run_torchrun``, torchrun's own default)


@dataclass(frozen=True)
class OffloadCost:
    """One step's offload by part (seconds; bytes per node): the module doc's terms."""

    h2d_s: float  # parameter shards to the device, all micro-batches
    d2h_s: float  # gradient shards to the host, all micro-batches
    exposed_s: float  # what of the copies the compute does not hide
    grad_accumulation_s: float  # the gradient sum on the CPU
    optimizer_s: float  # AdamW on the CPU
    host_bytes_per_node: int  # the state a node's host memory holds


def offloaded_bytes_per_rank(precision: Precision, config: Decisions, local_params: int) -> int:
    """(p + g + o)·Ψ/N: a rank's parameter, gradient and optimizer-state shards, all on the host."""
    per_param = precision.param_bytes + precision.grad_bytes + precision.optimizer_bytes
    return local_params * per_param // config.dp_shard


def offload_cost(
    cluster: Cluster, config: Decisions, precision: Precision, local_params: int, compute_s: float, dp_total_s: float
) -> OffloadCost:
    """The module doc's terms for a rank of ``local_params`` parameters (Ψ) whose step computes ``compute_s`` (C)
    beside ``dp_total_s`` of dp collectives (T_dp)."""
    device, m = cluster.device, config.num_microbatches
    shard = local_params / config.dp_shard
    link_bps = device.host_link_gbps * 1e9
    host_bps = rank_host_bps(cluster)
    h2d_s = m * 2 * precision.param_bytes * shard / link_bps
    d2h_first_s = precision.grad_bytes * shard / link_bps
    d2h_later_s = (m - 1) * d2h_first_s
    window_s = max(0.0, compute_s - dp_total_s)
    return OffloadCost(
        h2d_s=h2d_s,
        d2h_s=d2h_first_s + d2h_later_s,
        exposed_s=max(0.0, h2d_s + d2h_first_s - window_s) + d2h_later_s,
        grad_accumulation_s=(m - 1) * 3 * precision.grad_bytes * shard / host_bps,
        optimizer_s=cpu_optimizer_s(cluster, shard),
        host_bytes_per_node=cluster.devices_per_node * offloaded_bytes_per_rank(precision, config, local_params),
    )


def rank_host_bps(cluster: Cluster) -> float:
    """B_r = min(B_m / D, T·B_core) (module doc), bytes per second."""
    shared = cluster.device.host_memory_bandwidth_gbps / cluster.devices_per_node
    return min(shared, THREADS_PER_RANK * HOST_CORE_GBPS) * 1e9


def cpu_optimizer_s(cluster: Cluster, shard_params: float) -> float:
    """opt = K·Ψ/N / B_r (module doc) for a rank's ``shard_params`` = Ψ/N."""
    return CPU_ADAM_BYTES_PER_PARAM * shard_params / rank_host_bps(cluster)


def host_fits(cluster: Cluster, host_bytes_per_node: int) -> bool:
    """The offloaded state of a node's ranks fits in HOST_USABLE of its host memory."""
    return host_bytes_per_node <= HOST_USABLE * cluster.device.host_memory_bytes
