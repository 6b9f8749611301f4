"""A pipelined step (pp > 1): per-rank loads, the slowest rank's pace, fill and drain.

With pp > 1 (``pipeline_parts``), stage s holds a run of units
(``cost.units``; cuts from ``passes.planning.stage_cuts``) and lives on pp rank s mod pp. Per
micro-batch, rank r spends T_r = C_r + P_r + X_r: C_r the compute of its stages, X_r their TP
collectives, P_r two transfers (activation forward, gradient backward) of the boundary
activation entering each of its stages but the first (docs/reference-numbers.md: b·s·h·bytes each way;
``boundary_transfer_s``), and the bytes of the tables the blocks share beside it (``boundary_round_trip_s``)::

    step_time    = m · T_max + (Σ_r T_r − T_max)/v + grad_accumulation + optimizer + DP_exposed
    compute      = m · C_{r*} + grad_accumulation + optimizer      r* the slowest rank, T_max = T_{r*}
    comm_exposed = m · (X_{r*} + P_{r*}) + DP_exposed
    bubble       = (Σ_r T_r − T_max)/v    (GPipe / 1F1B: v = 1; interleaved 1F1B: v chunks;
                                           ranks sharing fewer cores: "Shared cores" below)

The bubble is the fill and the drain: the first micro-batch's forward and the last one's
backward pass through every other rank once (1/v of its work per chunk), while the slowest
rank's m slots set the steady state. With equal ranks it is docs/reference-numbers.md's (p−1)/v · T; with
unequal ones (the embedding and the head make the end stages heavier) (p−1)/v · T_max would
charge every fill slot at the slowest rank's pace. The pipelined part m·T_max + bubble is at
least (m + (p−1)/v) · mean_r T_r, as the search's lower bound assumes: it is
(m − 1/v)·T_max + p·mean/v, and m ≥ 1/v, T_max ≥ mean. Against a timed run of the schedule
(``schedule.makespan_s``, tests): exact for GPipe; for 1F1B never below it, within a few
per cent typically and 25 % at most with stages up to 3× apart.

**Zero bubble** (interleaved-zb, zbv, dualpipev: ``schedule.ZERO_BUBBLE_SCHEDULES``). Backward is
split into I (the input's gradient, which the previous stage waits for) and W (the weights', which
nothing waits for; ``WEIGHT_GRAD_SHARE`` of the stage's backward), and W fills the fill and drain.
The pipelined part is the schedule's orders run with each stage's times (``schedule.makespan_s``:
F = the stage's forward work and wait, I = the rest of its backward and its wait, W its share of the
backward work), so unequal stages are priced as they run; bubble = that span − m·T_max ≥ 0 (every
rank runs its m·T_r of actions). With equal stages and T_F = T_I = T_W it is (p − 1)·T/(3v)
(``schedule`` module doc), a third of 1F1B's (p − 1)·T at v = 1. Stage s sits on the rank of
``schedule.rank_stages`` (in a V rank r holds stages r and 2p − 1 − r: the first and last stage's
memory and work share rank 0), and a boundary between two stages of one rank (the V's tip, stages
p − 1 and p on rank p − 1) sends nothing. Activations in flight are the rank's order counted action
by action (``split_backward_in_flight_bytes``): a stage keeps a micro-batch's until its W. With full
recompute a block reruns twice in a split backward (once per pass; g = 0: once) and once in a full one; the first stage's backward
torch runs whole, and DualPipeV splits only some (``stage_pipeline_units``). The weight pass's one autograd call
per parameter group is host time beyond one backward call's (``split_backward_host_s``).

**Shared cores.** CPU ranks on one node share its cores: ``autoshard calibrate`` measures every
figure with all R ranks busy, min(1, C/R) of a core each (C = ``host.shared_cores``: the cores
over threads per rank). A pipeline rank idle in the fill, the drain or waiting on a peer lends
its core to the busy ones, so when C < R the pipelined part m·T_max + bubble is the schedule run
with processor sharing instead (``schedule.shared_makespan_s``: n ranks busy each progress at
min(1, C/n) / min(1, C/R) of their calibrated pace; F and B of a stage are its rank's compute
and, after it, its transfers and TP collectives as a wait that takes no core, both split by the
stages' compute). The bubble is then that span − m·T_max, which can be negative: on 4 ranks sharing 2
cores, pp = 4 and m = 4 a rank is busy half the time, and the others run twice as fast meanwhile.
Ranks of an SPMD step are busy and idle together (every collective spans them): no change there.

grad_accumulation and optimizer are priced on the rank with the most parameters.

TP × PP: each stage is split over tp as without pipelining (``pipeline_units``). The boundary
activation is whole on every TP rank; each TP rank sends its own copy to its peer in the next
stage, α + S/B on the pp link; a runtime that scatter-gathers (Megatron-LM, Narayanan et al.
§4.1) sends S/t per rank and all-gathers it on the TP link: p2p(S/t) + AG(S, t). With sequence
parallelism a boundary inside the sequence-sharded stream (``tp_units.boundary_shares``) holds S/t on
each TP rank, which it sends as it is, α + S/(t·B), and the stage's output kept for its backward and its
receive buffers are 1/t likewise.

DP × PP collectives are ``cost.dp_comm.pipeline_dp_comm``'s, all exposed.

**CP × PP** (``cost.step.price_parts``). Each stage is priced as its data-parallel equivalent (dp·cp
ranks at micro-batch b/cp: ``cost.context_parallel.cp_equivalent``) plus the ring of the attentions in
its own units (``context_parallel.unit_ring_costs``): with R_u the ring's extra attention work of unit u
(forward, backward, recompute) and E_u its exposed exchange, rank r of stages S_r takes::

    C_r += Σ_{u ∈ S_r} R_u        T_r += Σ_{u ∈ S_r} E_u      (a wait beside its transfers, "cp_comm")

so a stage holding more attentions is slower by its own ring, and the schedule's fill and drain and the
slowest rank's m slots follow from those per-stage times as for any pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autoshard.cost import comm
from autoshard.cost.context_parallel import NO_RING, RingCost, add_rings, with_ring_bytes
from autoshard.cost.dp_comm import CommTime, dp_collective_s, pipeline_dp_comm, pp_link, tp_link
from autoshard.cost.experts import a2a_microbatch_s, expert_state_params, unit_expert_costs
from autoshard.cost.memory import MEGATRON_MIXED, shared_value_bytes, shared_value_sizes
from autoshard.cost.parts import (
    StepParts,
    fsdp_pipeline_host_s,
    grad_accumulation_s,
    optimizer_parts,
    pipeline_host_s,
    step_loop_s,
)
from autoshard.cost.rank_memory import StageLoad, in_flight, megatron_pipeline_memory, memory_pipeline
from autoshard.cost.schedule import (
    ZERO_BUBBLE_SCHEDULES,
    rank_orders,
    rank_stages,
    schedule_makespan_s,
    schedule_peak_in_flight,
    shared_makespan_s,
    split_backward_share,
    stage_owners,
)
from autoshard.cost.tables import CAPTURED_ELEM_BYTES, CostTables, layout_key
from autoshard.cost.tp_units import (
    boundary_shares,
    forward_reruns,
    pipeline_units,
    tp_host_per_unit_s,
    unit_weight_groups,
)
from autoshard.cost.units import Units, stage_ranges, stage_units
from autoshard.ir.decisions import MIXED, Decisions, Mesh
from autoshard.ir.plan import Memory
from autoshard.ir.topology import Cluster

# W's share of a stage's backward: a linear layer's backward is two matmuls of equal FLOPs, the input's
# gradient dX = dY·Wᵀ (I) and the weight's dW = Xᵀ·dY (W); the zero-bubble paper's T_I = T_W.
# Attention's score matmuls have no weight, so a transformer block's W is somewhat less.
WEIGHT_GRAD_SHARE = 0.5


@dataclass(frozen=True)
class RankLoad:
    """One pp rank's per-micro-batch work and its memory."""

    forward_s: float
    backward_s: float
    recompute_s: float
    p2p_s: float  # pipeline sends and receives of its stages' boundaries
    tp_comm_s: float  # its stages' TP collectives
    params: int
    memory: Memory
    host_s: float = 0.0  # its stages' host time (ops, schedule, FSDP hooks), not hidden by the device
    tensors: int = 0  # parameter tensors of its stages
    ep_comm_s: float = 0.0  # its stages' expert all-to-alls (``cost.experts``)
    expert_params: int = 0  # of ``params``, its expert shards (ep = dp: no other rank holds them, none synced)
    cp_comm_s: float = 0.0  # its stages' exposed ring exchange (``cost.context_parallel``)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s + self.host_s

    @property
    def time_s(self) -> float:
        return self.compute_s + self.p2p_s + self.tp_comm_s + self.ep_comm_s + self.cp_comm_s

    @property
    def wait_s(self) -> float:
        """Its transfers and collectives: what its stages wait on, beside their compute."""
        return self.p2p_s + self.tp_comm_s + self.ep_comm_s + self.cp_comm_s


def pipeline_parts(
    tables: CostTables, config: Decisions, cuts: tuple[int, ...], rings: tuple[RingCost, ...] | None = None
) -> StepParts:
    """The step's parts (module doc); ``rings``: the ring's cost per unit under context parallelism ("CP × PP"),
    ``config`` then being its data-parallel equivalent."""
    cluster, precision = tables.cluster, tables.precision
    loads = rank_loads(tables, config, cuts, rings)
    slowest = max(loads, key=lambda r: r.time_s)
    m = config.num_microbatches
    params = max(r.params for r in loads)
    dp = pipeline_dp_comm(cluster, config, max(r.params - r.expert_params for r in loads), precision)
    dp = _with_expert_replicas(dp, cluster, config, max(r.expert_params for r in loads), precision)
    optimizer_s, optimizer_host = optimizer_parts(tables, config, params, max(r.tensors for r in loads))
    fsdp_sync_s = fsdp_pipeline_host_s(cluster, config, config.virtual_stages, params, precision)[1]
    span_s = pipeline_span_s(tables, config, cuts, loads, rings)
    pace = paced_share(span_s, m * slowest.time_s)
    host_s = (
        m * slowest.host_s * pace
        + optimizer_host
        + fsdp_sync_s
        + pipeline_host_s(tables, config.mesh.pp)[1]
        + step_loop_s(tables)
    )
    return StepParts(
        forward_s=m * slowest.forward_s * pace,
        backward_s=m * slowest.backward_s * pace,
        recompute_s=m * slowest.recompute_s * pace,
        grad_accumulation_s=grad_accumulation_s(params, config, precision, cluster),
        optimizer_s=optimizer_s,
        tp_comm_s=m * slowest.tp_comm_s * pace,
        p2p_s=m * slowest.p2p_s * pace,
        dp_comm_exposed_s=dp.exposed_s,
        bubble_s=max(0.0, span_s - m * slowest.time_s),
        dp_comm_total_s=dp.total_s,
        memory=max((r.memory for r in loads), key=lambda mem: mem.peak_bytes),
        host_s=host_s,
        ep_comm_s=m * slowest.ep_comm_s * pace,
        cp_comm_s=m * slowest.cp_comm_s * pace,
        pp_rank_memory=tuple(r.memory for r in loads),
    )


def paced_share(span_s: float, slowest_work_s: float) -> float:
    """The share of its m·T_max of work the slowest pp rank's parts are priced at: 1, unless the span is
    shorter. On ranks that share cores (``shared_cores``) T was measured with every rank busy, and a rank
    runs faster while the others wait in the schedule's bubbles, so the span can be under m·T_max; the parts
    then shrink by span / (m·T_max) and the bubble is 0 (a plan's parts are ≥ 0 and add up to the step)."""
    if slowest_work_s <= 0.0 or span_s >= slowest_work_s:
        return 1.0
    return span_s / slowest_work_s


def _with_expert_replicas(dp: CommTime, cluster: Cluster, config: Decisions, expert_params: int, precision) -> CommTime:
    """The stages' expert shards, left out of the dp wrapper, have their gradients all-reduced over the
    dp / ep ranks holding them once the schedule is done (``pipeline_parallel.sync_expert_grads``): exposed."""
    if config.expert_dp == 1 or not expert_params:
        return dp
    mesh = Mesh(dp=config.expert_dp, tp=config.mesh.tp * config.ep, pp=config.mesh.pp)  # stride ep·tp: the replicas
    total = dp_collective_s("allreduce", expert_params * precision.grad_bytes, mesh, cluster)
    return CommTime(dp.total_s + total, dp.exposed_s + total)


def pipeline_span_s(
    tables: CostTables,
    config: Decisions,
    cuts: tuple[int, ...],
    loads: list[RankLoad],
    rings: tuple[RingCost, ...] | None = None,
) -> float:
    """The pipelined part of the step: m·T_max + (Σ_r T_r − T_max)/v (module doc); a zero-bubble
    schedule's orders run with each stage's times ("Zero bubble"); on a host whose ranks share fewer
    cores (``shared_cores``), the schedule run with processor sharing."""
    m, v = config.num_microbatches, config.virtual_stages
    times = [r.time_s for r in loads]
    cores = shared_cores(tables.cluster, config.mesh)
    split = config.schedule in ZERO_BUBBLE_SCHEDULES
    if cores is None and not split:
        return m * max(times) + (sum(times) - max(times)) / v
    forward, backward, forward_wait, backward_wait = stage_action_times(tables, config, cuts, loads, rings)
    weight = [WEIGHT_GRAD_SHARE * b for b in backward] if split else None
    if cores is None:  # every rank runs its m·T_r of actions: at least m·T_max (max() drops float rounding)
        return max(
            m * max(times),
            schedule_makespan_s(
                config.schedule,
                config.mesh.pp,
                m,
                v,
                [f + w for f, w in zip(forward, forward_wait)],
                [b + w for b, w in zip(backward, backward_wait)],
                weight,
            ),
        )
    orders = rank_orders(config.schedule, config.mesh.pp, m, v)
    return shared_makespan_s(
        orders,
        len(forward),
        forward,
        backward,
        config.mesh.dp * config.mesh.tp,
        cores,
        forward_wait,
        backward_wait,
        weight,
    )


def shared_cores(cluster: Cluster, mesh: Mesh) -> float | None:
    """C when the mesh's R ranks sit on one node that runs only C < R of them at full speed at once
    (CPU ranks: ``HostOverheads.shared_cores``); None when every rank has its own core or device."""
    cores, ranks = cluster.host.shared_cores, mesh.dp * mesh.tp * mesh.pp
    if not cores or ranks <= cores or ranks > cluster.devices_per_node:
        return None
    return cores


def stage_action_times(
    tables: CostTables,
    config: Decisions,
    cuts: tuple[int, ...],
    loads: list[RankLoad],
    rings: tuple[RingCost, ...] | None = None,
) -> tuple[list[float], list[float], list[float], list[float]]:
    """(F work, B work, F wait, B wait) seconds of one micro-batch on each stage: its rank's compute
    (with host time; the ring's extra attention work of its units under context parallelism, ``rings``) and its
    transfers and collectives (``RankLoad``) shared among the rank's stages by their compute, and within a
    stage between forward and backward + recompute the same way."""
    ranges = stage_ranges(cuts, pipeline_units(tables, config)[0].blocks)
    parts = []
    pp, owner = config.mesh.pp, stage_owners(config.schedule, config.mesh.pp, config.virtual_stages)
    for s, rng in enumerate(ranges):
        units = stage_pipeline_units(tables.for_pp_rank(config, owner[s]), config, s)
        idx = stage_units(rng, units.blocks)
        ring = _ring_of(rings, idx)
        parts.append(
            (
                sum(units.forward_s[u] for u in idx) + ring.forward_extra_s,
                sum(units.backward_s[u] + units.recompute_s[u] for u in idx)
                + ring.backward_extra_s
                + ring.recompute_extra_s,
            )
        )
    rank_compute = [sum(f + b for s, (f, b) in enumerate(parts) if owner[s] == r) for r in range(pp)]
    out: tuple[list[float], ...] = ([], [], [], [])
    for s, (f, b) in enumerate(parts):
        load, total = loads[owner[s]], rank_compute[owner[s]]
        work, wait = (load.compute_s / total, load.wait_s / total) if total else (0.0, 0.0)
        for column, value in zip(out, (f * work, b * work, f * wait, b * wait)):
            column.append(value)
    return out


def stage_pipeline_units(tables: CostTables, config: Decisions, stage: int) -> Units:
    """The units stage ``stage`` runs. Under full recompute a block reruns once in a full backward and twice
    in a split one (``tp_units.pipeline_units``); with σ_s the share of stage s's micro-batches whose
    backward its rank splits (``schedule.split_backward_share``: 1 in interleaved-zb and zbv, part of them in
    DualPipeV; 0 on the first stage, whose backward torch runs whole)::

        recompute_s(u) = once(u) + σ_s · (split(u) − once(u))        (host time alike)"""
    split = pipeline_units(tables, config)[0]
    if config.schedule not in ZERO_BUBBLE_SCHEDULES or config.recompute != "full":
        return split
    m, v = config.num_microbatches, config.virtual_stages
    share = stage_split_share(config, stage)
    if share == 1.0:
        return split
    once = pipeline_units(tables, config, first_stage=True)[0]

    def mixed(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(x + share * (y - x) for x, y in zip(a, b))

    return tables.memo(
        ("stage_pipeline_units", config.schedule, config.mesh.pp, m, v, stage, tables.point_key(config)),
        lambda: replace(
            split,
            recompute_s=mixed(once.recompute_s, split.recompute_s),
            host_recompute_s=mixed(once.host_recompute_s, split.host_recompute_s),
        ),
    )


def stage_forward_reruns(tables: CostTables, config: Decisions, stage: int) -> tuple[float, ...]:
    """How many times stage ``stage`` reruns each unit's forward per micro-batch: once per recomputed block
    (``tp_units.forward_reruns``), 1 + σ_s · [g_u > 0] under full recompute in a zero-bubble schedule's split
    backward (as ``stage_pipeline_units``; g_u: the unit's ops that read a parameter, whose weight pass reruns
    the unit once)."""
    reruns = forward_reruns(config, len(tables.graph.blocks))
    share = stage_split_share(config, stage)
    if config.recompute != "full" or not share:
        return reruns
    return tuple(n * (1 + share * min(g, 1)) for n, g in zip(reruns, unit_weight_groups(tables.graph)))


def split_backward_host_s(tables: CostTables, config: Decisions, stage: int, idx) -> float:
    """Host seconds per micro-batch that stage ``stage``'s split backward costs beyond one backward call: its
    weight pass makes one ``autograd`` call per parameter group (``stage_backward_weight``), σ_s · G_s ·
    ``weight_group_us`` (σ_s: ``schedule.split_backward_share``; G_s: the ops of its units ``idx`` that read a
    parameter, ``tp_units.unit_weight_groups``; 0 on the first stage, whose backward torch runs whole)."""
    us, share = tables.cluster.host.weight_group_us, stage_split_share(config, stage)
    if not us or not share:
        return 0.0
    groups = unit_weight_groups(tables.graph)
    return share * sum(groups[u] for u in idx) * us * 1e-6


def _ring_of(rings: tuple[RingCost, ...] | None, idx) -> RingCost:
    """The ring's cost of the units ``idx`` (none without context parallelism)."""
    return add_rings(rings[u] for u in idx) if rings else NO_RING


def rank_loads(
    tables: CostTables, config: Decisions, cuts: tuple[int, ...], rings: tuple[RingCost, ...] | None = None
) -> list[RankLoad]:
    """Each pp rank's load per micro-batch (``RankLoad``); ``rings``: the ring's cost per unit under context
    parallelism, added to the units of the rank's stages ("CP × PP")."""
    whole = tables  # the pipeline's transfers run on the whole cluster's links
    pp, v = config.mesh.pp, config.virtual_stages
    owner = stage_owners(config.schedule, pp, v)
    loads = []
    for r in range(pp):
        tables = whole.for_pp_rank(config, r)  # heterogeneous: priced on its node group's device ("Node groups")
        units, tp_comm = pipeline_units(tables, config)
        ranges = stage_ranges(cuts, units.blocks)
        experts = unit_expert_costs(tables, config)
        mine = [(s, ranges[s]) for s in rank_stages(config.schedule, pp, v, r)]
        idx = [u for s, rng in mine for u in stage_units(rng, units.blocks)]
        runs = {s: stage_pipeline_units(tables, config, s) for s, _ in mine}
        rerun = {u: runs[s] for s, rng in mine for u in stage_units(rng, units.blocks)}
        tp_hosts = {s: tp_host_per_unit_s(tables, config, stage_forward_reruns(tables, config, s)) for s, _ in mine}
        tp_host = {u: tp_hosts[s][u] for s, rng in mine for u in stage_units(rng, units.blocks)}
        shares = boundary_shares(whole, config)
        p2p = sum(
            boundary_round_trip_s(whole, config, units.boundary_bytes[i], sequence_sharded=shares[i] < 1)
            for s, (i, _) in mine
            if s > 0 and owner[s - 1] != r
        )  # adjacent stages on one rank (the V's tip) send nothing
        whole_experts = sum(experts[u].params for u in idx)
        params, expert_shards = expert_state_params(sum(units.params[u] for u in idx), whole_experts, config)
        held = with_ring_bytes(units, rings)  # a cp ring's buffers in its blocks' backwards
        stages = [stage_load(tables, config, held, experts, s, rng, owner) for s, rng in mine]
        ring = _ring_of(rings, idx)
        host_s = (
            sum(rerun[u].host_s[u] + tp_host[u] + experts[u].host_s for u in idx)
            + sum(split_backward_host_s(tables, config, s, stage_units(rng, units.blocks)) for s, rng in mine)
            + len(mine) * pipeline_host_s(tables, pp)[0]
            + fsdp_pipeline_host_s(tables.cluster, config, len(mine), params, tables.precision)[0]
        )  # FSDP2: a unit per stage
        loads.append(
            RankLoad(
                sum(units.forward_s[u] + experts[u].forward_s for u in idx) + ring.forward_extra_s,
                sum(units.backward_s[u] + experts[u].backward_s for u in idx) + ring.backward_extra_s,
                sum(rerun[u].recompute_s[u] + experts[u].recompute_s for u in idx) + ring.recompute_extra_s,
                p2p,
                sum(tp_comm[u] for u in idx),
                params + expert_shards,
                rank_memory(tables, config, r, stages, units, mine, ring.backward_bytes),
                host_s,
                sum(units.tensors[u] for u in idx),
                a2a_microbatch_s(experts, idx),
                expert_shards,
                ring.exposed_s,
            )
        )
    return loads


def rank_memory(
    tables: CostTables,
    config: Decisions,
    pp_rank: int,
    stages: list[StageLoad],
    units: Units,
    mine: list[tuple[int, tuple[int, int]]],
    ring_bytes: int = 0,
) -> Memory:
    """Pipeline rank ``pp_rank``'s peak: the moments of autoshard's programs (``rank_memory.memory_pipeline``),
    or, priced for Megatron-LM, its in-flight micro-batches over its own state (``megatron_pipeline_memory``), with a
    block's workspace or, under context parallelism, its ring attention's backward (``ring_bytes``: the largest of
    the rank's units', ``RingCost.backward_bytes``) if larger, as the stages' moments hold it."""
    if tables.precision != MEGATRON_MIXED:
        return memory_pipeline(tables, config, pp_rank, stages)
    pp, v = config.mesh.pp, config.virtual_stages
    idx = [u for _, rng in mine for u in stage_units(rng, units.blocks)]
    if config.schedule in ZERO_BUBBLE_SCHEDULES:
        saved = {s: sum(units.saved_bytes[u] for u in stage_units(rng, units.blocks)) for s, rng in mine}
        acts = split_backward_in_flight_bytes(config, pp_rank, saved)
    else:
        acts = in_flight(config.schedule, config.num_microbatches, pp, v, pp_rank) * sum(
            units.saved_bytes[u] for u in idx
        )
    acts += max(max(units.workspace_bytes[u] for u in idx), ring_bytes)
    return megatron_pipeline_memory(
        tables.precision, config, sum(s.params for s in stages), acts, sum(s.expert_params for s in stages)
    )


def stage_load(
    tables: CostTables,
    config: Decisions,
    units: Units,
    experts,
    index: int,
    block_range: tuple[int, int],
    owner: list[int],
) -> StageLoad:
    """What stage ``index`` (blocks ``block_range``) puts on its rank (``rank_memory.StageLoad``): its units'
    parameters, saved activations, workspaces and activation gradients on one TP rank, the output the
    schedule keeps for its backward (the next stage's input, or the model's output) and its receive buffers
    (``stage_buffer_bytes``)."""
    blocks, last = units.blocks, index == len(owner) - 1
    idx = stage_units(block_range, blocks)
    params, expert_shards = expert_state_params(
        sum(units.params[u] for u in idx), sum(experts[u].params for u in idx), config
    )
    output = model_output_bytes(tables, config) if last else units.boundary_bytes[block_range[1]]
    in_blocks = [u for u in idx if 0 < u <= blocks]
    return StageLoad(
        index,
        params,
        expert_shards,
        saved_bytes=sum(units.saved_bytes[u] for u in idx) + output,
        workspace_bytes=stage_workspace_bytes(config, index, [units.workspace_bytes[u] for u in in_blocks]),
        weight_grad_bytes=_sum_at(tables.weight_grad_units(config), idx) if stage_split_share(config, index) > 0 else 0,
        backward_bytes=max((units.backward_bytes[u] for u in in_blocks), default=0) if units.backward_bytes else 0,
        loss_bytes=units.workspace_bytes[-1] if last else 0,
        buffer_bytes=stage_buffer_bytes(tables, config, index, block_range, owner),
    )


def _sum_at(values: tuple[int, ...], idx) -> int:
    """Σ values[u] over ``idx``, the per-unit tuple read once rather than looked up again for each unit."""
    return sum(values[u] for u in idx)


def stage_workspace_bytes(config: Decisions, index: int, workspaces: list[int]) -> int:
    """R_s of ``rank_memory.pipeline_moments``: what a recomputed block keeps again for its backward, the largest
    of the stage's blocks', R_k; the sum of them where the stage's rank splits its backward under checkpointed
    blocks (a zero-bubble schedule, full or per-block recompute, not the first stage: ``split_backward_share``)::

        R_s = Σ_k R_k   (split)        R_s = max_k R_k   (otherwise)

    Each checkpointed block reruns in the input pass and again in the weight pass (``runtime.pipeline_parallel``'s
    group); a rerun's tensors that its pass does not read stay until the stage's graph is freed at the end of the
    weight pass, so the blocks' reruns pile up instead of following one another. Σ_k R_k bounds it from above: the
    weight pass of a probe of 4 GPT blocks under the group held 2.9 MB at its peak against one block's 1.2 MB (4.8 MB
    summed; 2026-11-28). What each pass reads of a block, and frees, is not priced."""
    split = config.recompute in ("full", MIXED) and stage_split_share(config, index) > 0
    return sum(workspaces) if split else max(workspaces, default=0)


def stage_split_share(config: Decisions, stage: int) -> float:
    """σ_s: the share of stage ``stage``'s micro-batches whose backward its rank splits into input and weight
    passes (``schedule.split_backward_share``: 1 in interleaved-zb and zbv, part of them in DualPipeV); 0 for the
    schedules that never split, and on the first stage, whose backward torch runs whole (its inputs need no
    gradient)."""
    if stage == 0 or config.schedule not in ZERO_BUBBLE_SCHEDULES:
        return 0.0
    m, v = config.num_microbatches, config.virtual_stages
    return split_backward_share(config.schedule, config.mesh.pp, m, v)[stage]


def model_output_bytes(tables: CostTables, config: Decisions) -> int:
    """The model's output of one micro-batch on a TP rank, as trained: the last stage's output, which the
    schedule keeps until the loss's backward."""
    graph = tables.graph
    if not graph.nodes:
        return 0
    ratio = tables.precision.activation_bytes / CAPTURED_ELEM_BYTES
    nbytes = tables.rank_share(config).value_bytes(graph, graph.nodes[-1].name, ratio)
    return int(nbytes * config.microbatch_size / graph.batch_size)


def stage_buffer_bytes(
    tables: CostTables, config: Decisions, index: int, block_range: tuple[int, int], owner: list[int]
) -> int:
    """Receive buffers of one micro-batch on stage ``index``: torch's stage makes one per micro-batch for each
    input (but the first stage's) and for the gradient of each output (but the last stage's), in the dtype
    the split traced (the model's: ``CAPTURED_ELEM_BYTES``), and keeps them; a boundary is the residual
    stream entering a block and the tables the blocks share (``memory.shared_value_bytes``); none between two
    stages of one rank (the V's tip)."""
    key = ("stage_boundary_bytes", layout_key(config))
    boundary = tables.memo(key, lambda: _boundary_bytes(tables, config))
    first, end = block_range
    receives = boundary[first] if index > 0 and owner[index - 1] != owner[index] else 0
    if index < len(owner) - 1 and owner[index + 1] != owner[index]:
        receives += boundary[end]
    return receives


def _boundary_bytes(tables: CostTables, config: Decisions) -> list[int]:
    """Per block, what a stage beginning there receives of one micro-batch (``stage_buffer_bytes``): the residual
    stream on one TP rank (1/tp of its tokens under sequence parallelism: ``tp_units.boundary_shares``) and the
    shared tables whole."""
    graph = tables.graph
    scale = config.microbatch_size / graph.batch_size
    shared = shared_value_bytes(graph)
    shares = boundary_shares(tables, config)
    return [int((b.input_bytes * k + shared) * scale) for b, k in zip(graph.blocks, shares)]


def stage_in_flight(config: Decisions) -> tuple[float, ...]:
    """Per stage, the micro-batches of its rank's activations that rank holds at its peak (the stage-cut
    memory constraint): ``rank_memory.in_flight`` of rank s mod pp; a zero-bubble schedule's order counted
    with every stage of the rank equal (``split_backward_in_flight_bytes`` with 1/v each) on its rank."""
    pp, m, v = config.mesh.pp, config.num_microbatches, config.virtual_stages
    if config.schedule not in ZERO_BUBBLE_SCHEDULES:
        return tuple(in_flight(config.schedule, m, pp, v, s % pp) for s in range(config.num_stages))
    owner = stage_owners(config.schedule, pp, v)
    per_rank = [
        split_backward_in_flight_bytes(config, r, {s: 1 / v for s in rank_stages(config.schedule, pp, v, r)})
        for r in range(pp)
    ]
    return tuple(per_rank[owner[s]] for s in range(config.num_stages))


def split_backward_in_flight_bytes(config: Decisions, pp_rank: int, stage_bytes: dict[int, float]) -> float:
    """Saved activations rank ``pp_rank`` holds at its peak under a zero-bubble schedule, its order counted
    action by action (``schedule.peak_in_flight``: each stage's bytes from its F until its W or full B;
    the other schedules take ``rank_memory.in_flight``). With equal stages and m ≥ 2p: p micro-batches
    on every rank for interleaved-zb and zbv, p + 1/2 for dualpipev, against 1F1B's p − r on rank r."""
    return schedule_peak_in_flight(
        config.schedule, config.mesh.pp, config.num_microbatches, config.virtual_stages, pp_rank, stage_bytes
    )


def boundary_round_trip_s(
    tables: CostTables, config: Decisions, residual_bytes: float, sequence_sharded: bool = False
) -> float:
    """One pipeline boundary per micro-batch, both ways: the residual stream forward and its gradient back
    (``boundary_transfer_s`` each), and beside it the tables the blocks share (``memory.shared_value_sizes``: a
    causal mask, rotary cos and sin), forward whole and back only where they carry a gradient. torch's stage posts
    a boundary's tensors as one batch of P2P ops, so their latencies overlap: the tables add their bytes, not a
    latency each (``benchmarks/experiments/p2p_tables.py``, gloo, 4 ranks on 2 cores: one 8 KiB boundary 410-455 µs,
    with three 2 KiB tables beside it 495-655 µs, against p2p α 450 µs; that per-op host time has no calibrated
    figure and is not priced)::

        P = 2·X(S_res) + Σ_j s_j/B · (1 + [j has a gradient])        s_j at the micro-batch's size

    (s_j scaled as the receive buffers count it, ``stage_buffer_bytes``; a boundary of a (b, 1, s, s) mask is s² bytes a sample: 64 MiB at 8,192 tokens)."""
    scale = config.microbatch_size / tables.graph.batch_size
    shared_bytes = sum(size * scale * (1 + grad) for size, grad in shared_value_sizes(tables.graph))
    tables_s = comm.p2p_bytes_s(shared_bytes, pp_link(tables.cluster, config.mesh))
    return 2 * boundary_transfer_s(tables, config, residual_bytes, sequence_sharded) + tables_s


def boundary_transfer_s(
    tables: CostTables, config: Decisions, size_bytes: float, sequence_sharded: bool = False
) -> float:
    """One pipeline boundary of S bytes on a TP rank, one way: each TP rank sends its whole copy to its peer,
    α + S/B on the pp link; or, with the runtime's scatter-gather (Narayanan et al. §4.1), 1/t of it,
    then the t receivers all-gather: p2p(S/t) + AG(S, t) on the TP link. ``sequence_sharded`` (sequence
    parallelism: S is already this rank's 1/t of the tokens, and its stage runs on them): α + S/B."""
    link, tp = pp_link(tables.cluster, config.mesh), config.mesh.tp
    if not tables.runtime.p2p_scatter_gather or tp == 1 or sequence_sharded:
        return comm.p2p_s(size_bytes, link)
    return comm.p2p_s(size_bytes / tp, link) + comm.all_gather_s(size_bytes, tp, tp_link(tables.cluster, tp))
