"""One training step of a set of decisions, priced as a sum of named parts.

Notation: mesh (dp, tp, pp) laid out (pp, dp, tp), tp innermost; m micro-batches of b samples
per dp replica; v virtual stages per pp rank; c = fwd + bwd + recompute of one micro-batch;
W the device's memory bandwidth; g bytes per gradient element.

Every step is a ``StepParts`` (``price_parts``), and ``Predicted`` sums it::

    step_time    = compute + comm_exposed + bubble
    compute      = forward + backward + recompute + grad_accumulation + optimizer + host
    comm_exposed = tp_comm + p2p + dp_exposed + offload

Host offload (``cost.offload``, SPMD ZeRO-3): the gradient sum and the optimizer on the CPU, the host link's
exposed copies as ``offload``, no model state in the device's memory (``with_offload``).

The parts come from the modules beside this one: ``cost.tables`` (what runs the plan, per-unit
costs, the TP layouts handed in), ``cost.tp`` and ``cost.tp_units`` (a TP rank's share of each
unit), ``cost.parts`` (optimizer, gradient accumulation, host time), ``cost.dp_comm`` (DP
collectives and what hides them), ``cost.rank_memory`` (memory per rank) and
``cost.pipeline_step`` (pp > 1).

**Without pipelining** (pp = 1; ``spmd_parts``)::

    forward + backward + recompute = m·c_tp        tp_comm = m·T_tp       p2p = bubble = 0
    dp_exposed = Σ_DP max(0, t_comm − t_compute it hides behind),
                 never less than the part that has nothing to hide behind
    host       = m · Σ_u (host(u) + tp_host(u))  +  m · h_fsdp(U units)  +  optimizer loop  +  DDP hooks
                 +  the step loop (``cost.parts.step_loop_s``; without its sync where the ranks share no
                    collective: dp = cp = 1 and a layout that shards nothing, ``ranks_meet``)

with c_tp and T_tp the layout's (``cost.tp``) for tp > 1. Pipelines: ``cost.pipeline_step``.

**Expert parallelism** (ep > 1, ``cost.experts``): the most-loaded rank's extra expert work and the
dispatch's recompute join forward, backward and recompute; the all-to-alls are ``ep_comm``
(exposed); the rank holds Ψ_dense + Ψ_E / ep parameters, the dense ones synchronised over dp and
the expert shards over the dp / ep ranks holding them (two DP groups, priced apart).
"""

from __future__ import annotations

from dataclasses import replace

from autoshard.cost.context_parallel import RingCost, add_rings, cp_equivalent, unit_ring_costs
from autoshard.cost.dp_comm import CommTime, dp_comm_time
from autoshard.cost.experts import a2a_microbatch_s, expert_params, expert_state_params, unit_expert_costs
from autoshard.cost.offload import offload_cost
from autoshard.cost.parts import (
    StepParts,
    dp_host_s,
    fsdp_step_host_s,
    grad_accumulation_s,
    optimizer_parts,
    param_tensors,
    predicted,
    step_loop_s,
)
from autoshard.cost.pipeline_step import pipeline_parts
from autoshard.cost.rank_memory import memory_spmd
from autoshard.cost.tables import CostTables
from autoshard.cost.tp_units import spmd_microbatch, tp_host_per_unit_s
from autoshard.ir.decisions import Decisions
from autoshard.ir.graph import OpGraph
from autoshard.ir.plan import Predicted
from autoshard.ir.topology import Cluster


def price(
    graph: OpGraph,
    cluster: Cluster,
    config: Decisions,
    global_batch: int,
    tables: CostTables | None = None,
    cuts: tuple[int, ...] | None = None,
) -> Predicted:
    """Predicted step time, memory and throughput of ``config`` (module doc); pipelines need ``cuts``."""
    tables = tables or CostTables(graph, cluster)
    return predicted(tables, config, global_batch, price_parts(tables, config, cuts))


def price_parts(tables: CostTables, config: Decisions, cuts: tuple[int, ...] | None = None) -> StepParts:
    """The step's time by part (``StepParts``) and its peak memory; pipelines need ``cuts``. Context
    parallelism is priced as its data-parallel equivalent plus the ring (``cost.context_parallel``); inside
    pipeline stages, each stage plus the ring of its own attentions (``cost.pipeline_step``, "CP × PP")."""
    if config.mesh.cp > 1 and config.mesh.pp > 1:  # each stage its own attentions' ring (cost.pipeline_step)
        assert cuts is not None and len(cuts) == config.num_stages - 1, "a pipeline is priced with its stage cuts"
        return pipeline_parts(tables, cp_equivalent(config), cuts, unit_ring_costs(tables, config))
    if config.mesh.cp > 1:
        rings = unit_ring_costs(tables, config)
        return with_ring(spmd_parts(tables, cp_equivalent(config), rings), add_rings(rings), config.num_microbatches)
    if config.mesh.pp > 1:
        assert cuts is not None and len(cuts) == config.num_stages - 1, "a pipeline is priced with its stage cuts"
        return pipeline_parts(tables, config, cuts)
    return spmd_parts(tables, config)


def with_ring(parts: StepParts, ring: RingCost, m: int) -> StepParts:
    """``parts`` of the data-parallel equivalent plus, for each of the m micro-batches, the ring's extra
    attention compute and its exposed exchange (``cost.context_parallel``)."""
    return replace(
        parts,
        forward_s=parts.forward_s + m * ring.forward_extra_s,
        backward_s=parts.backward_s + m * ring.backward_extra_s,
        recompute_s=parts.recompute_s + m * ring.recompute_extra_s,
        cp_comm_s=m * ring.exposed_s,
    )


def ranks_meet(tables: CostTables, config: Decisions) -> bool:
    """Whether an SPMD step's ranks meet in a collective: more than one data-parallel rank (context parallelism is
    priced as data parallelism, and expert parallelism needs dp > 1), or a tensor-parallel layout that shards a
    module. A tp group whose layout keeps every module whole runs the model on each rank alone: its loss's mean is
    over one data-parallel rank (``cost.parts.step_loop_s``)."""
    return config.mesh.dp > 1 or (config.mesh.tp > 1 and bool(tables.layout_cost(config).choice.sharded))


def spmd_parts(tables: CostTables, config: Decisions, rings: tuple[RingCost, ...] | None = None) -> StepParts:
    """An SPMD step's parts; ``rings``: the ring's cost per unit under context parallelism, ``config`` then being
    its data-parallel equivalent (its buffers join the units' backward moments: ``rank_memory.memory_spmd``)."""
    graph, cluster, precision = tables.graph, tables.cluster, tables.precision
    micro, tp_comm_s, local = spmd_microbatch(tables, config)
    m = config.num_microbatches
    experts = unit_expert_costs(tables, config)
    dense, expert_local = expert_state_params(local, expert_params(graph), config) if config.ep > 1 else (local, 0)
    dp = dp_comm_time(graph, cluster, config, micro, precision, dense)
    if expert_local:
        replicas = replace(config.mesh, dp=config.expert_dp, tp=config.mesh.tp * config.ep)  # ranks ep·tp apart
        expert_dp = dp_comm_time(graph, cluster, replace(config, mesh=replicas), micro, precision, expert_local)
        dp = CommTime(dp.total_s + expert_dp.total_s, dp.exposed_s + expert_dp.exposed_s)
    local = dense + expert_local
    units = tables.config_units(config)
    tensors = param_tensors(graph)
    optimizer_s, optimizer_host = optimizer_parts(tables, config, local, tensors)
    tp_host_s = sum(tp_host_per_unit_s(tables, config))
    expert_units = len(graph.experts) if config.ep > 1 else 0  # each expert group its own dp unit
    host_s = (
        m * (sum(units.host_s) + tp_host_s + sum(e.host_s for e in experts))
        + fsdp_step_host_s(cluster, config, len(graph.blocks) + 1 + expert_units, local, precision)
        + optimizer_host
        + dp_host_s(cluster, config, tensors)
        + step_loop_s(tables, synced=ranks_meet(tables, config))
    )
    parts = StepParts(
        forward_s=m * (micro.forward_s + sum(e.forward_s for e in experts)),
        backward_s=m * (micro.backward_s + sum(e.backward_s for e in experts)),
        recompute_s=m * (micro.recompute_s + sum(e.recompute_s for e in experts)),
        grad_accumulation_s=grad_accumulation_s(local, config, precision, cluster),
        optimizer_s=optimizer_s,
        tp_comm_s=m * tp_comm_s,
        p2p_s=0.0,
        dp_comm_exposed_s=dp.exposed_s,
        bubble_s=0.0,
        dp_comm_total_s=dp.total_s,
        memory=memory_spmd(tables, config, dense, expert_local, rings),
        host_s=host_s,
        ep_comm_s=m * a2a_microbatch_s(experts),
    )
    return with_offload(parts, tables, config, local) if config.offloaded else parts


def with_offload(parts: StepParts, tables: CostTables, config: Decisions, local_params: int) -> StepParts:
    """``parts`` with the state on the host (``cost.offload``): the gradient sum and AdamW on the CPU in place of
    the device's, the host link's exposed copies, and the host memory a node holds."""
    compute_s = parts.forward_s + parts.backward_s + parts.recompute_s
    cost = offload_cost(tables.cluster, config, tables.precision, local_params, compute_s, parts.dp_comm_total_s)
    return replace(
        parts,
        grad_accumulation_s=cost.grad_accumulation_s,
        optimizer_s=cost.optimizer_s,
        offload_s=cost.exposed_s,
        host_memory_bytes_per_node=cost.host_bytes_per_node,
    )
