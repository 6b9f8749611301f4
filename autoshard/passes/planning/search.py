"""Search: the fastest configuration that fits, over the joint space, exactly on the cost model.

**Variables.** A configuration c = (mesh (dp, tp, pp), ZeRO stage z, micro-batch b, recompute r,
schedule σ with v virtual stages) from ``passes.planning.strategies`` (every combination the runtime
supports, pins applied), and inside it three decisions solved exactly for that c:

    TP layout  L(v) ∈ {R, S, P} on every value of a block      CP-SAT, once per (tp, b) and block
               signature (repeated blocks share one model)      (``passes.layouts.segment_model``)
    stage cuts 0 = c_0 < c_1 < … < c_{pp·v} = L                 dynamic programming, once per
                                                                 (b, r, stages, tp) (``passes.planning.stage_cuts``)
    DDP bucket B ∈ BUCKET_CAP_CHOICES_MB                         least exposed all-reduce (``cost.dp_comm``)

**Objective and constraints.** With T(c) the cost model's step time (``cost.step``: compute,
exposed communication, bubble and host time as named parts), M(c) the peak memory per rank and
C the device memory::

    minimise    T(c)
    subject to  M(c) ≤ C                               (``Priced.fits``)
                dp·tp·pp = devices, tp | devices per node, B mod dp = 0, …   (``strategies``)
                cuts(c) = argmin_cuts max_s T_stage(s) s.t. M_stage(s) ≤ C  (``time_cuts``, ``memory_cuts``)

**Method.** Every candidate gets a lower bound (``lower_bound_s``)::

    LB(c) = (m + (pp − 1)/v) · Σ_u compute(u) / (tp · pp) ≤ T(c)

(perfect division of the compute over the tp·pp ranks that share a replica, no communication, no
imbalance; the pipeline's (pp − 1)/v bubble slots are kept, because the cost model prices the
step as (m + (pp − 1)/v)·T_max with T_max ≥ the mean rank's compute ≥ Σ_u compute(u) / (tp·pp);
with a measured profile or host time in the units it is still below T(c)). On a node whose ranks share
fewer cores than there are ranks (``cost.pipeline_step.shared_cores``) the bubble slots go: idle ranks lend
their cores, and the node does at most R rank-seconds of calibrated work per second, so the span is
at least the mean rank's work, m · Σ_u compute(u) / (tp·pp); so is a zero-bubble schedule's, whose weight
gradients fill the fill and the drain (``cost.pipeline_step``, "Zero bubble"). Candidates are priced in increasing LB (ties in candidate order); the first time LB
exceeds the fastest feasible T found, no candidate left can beat it and the search stops. The
answer is the minimum of T over all candidates that fit, as brute-force enumeration of the same
space finds it (``tests/test_search_exact.py``): the plan is optimal on the cost model, and the
plan's ``search`` field says so (``optimal``, ``gap`` 0, candidates and how many were priced).
With ``--time-limit`` the search may stop sooner; it then reports gap = 1 − LB_next / T_best,
a bound on how far the plan can be from the optimum. Where a second core is free, a forked worker prices
candidates ahead beside this process (``passes.planning.price_ahead``); the loop then reads their prices, so
the candidates priced and the plan are the same, byte for byte.

Ties on T break on lower peak memory, then lower ZeRO stage, larger micro-batch, less
recompute, the simpler mesh (smaller tp, then smaller pp) and schedule (``_rank``), so the same
inputs always give the same plan. Per-(b, r) unit costs, TP layouts (solved once per (tp, b) by
``passes.planning.tp_layout`` and handed to the cost tables) and stage cuts are cached in ``CostTables``
and shared by every candidate that needs them.

**Review.** Besides the candidates priced on the way, the lowest-bound candidate of up to
MESH_RIVALS meshes that pruning skipped is priced too (``mesh_rivals``): ``alternatives`` keeps
the best of each mesh, schedule, ZeRO stage and recompute mode with its parts and why it lost
(``why_not``). When nothing fits, ``explain_infeasible`` names the binding constraint and the
smallest changes that would make a plan fit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from autoshard.cost.context_parallel import cp_equivalent
from autoshard.cost.dp_comm import choose_bucket_cap_mb
from autoshard.cost.memory import precision_for_backend
from autoshard.cost.offload import HOST_USABLE, cpu_optimizer_s, host_fits
from autoshard.cost.pipeline_step import shared_cores, stage_in_flight
from autoshard.cost.rank_memory import ALLOCATOR_SLACK, state_bytes_per_param
from autoshard.cost.schedule import stage_owners
from autoshard.cost.step import price
from autoshard.cost.tables import CostTables, Runtime
from autoshard.cost.tp_units import pipeline_units
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import Decisions, Mesh, TPChoice, offload_refusal
from autoshard.ir.graph import OpGraph
from autoshard.ir.plan import RECOMPUTE_MODES, SCHEDULES, Alternative, Predicted
from autoshard.ir.plan_format import ZERO_BUBBLE_SCHEDULES
from autoshard.ir.topology import MAX_DEVICES, Cluster
from autoshard.passes.layouts.loss import loss_parallel_layout
from autoshard.passes.planning.price_ahead import MIN_CANDIDATES, forking_pays, price_ahead, units_on_two_cores
from autoshard.passes.planning.recompute import choose_recompute
from autoshard.passes.planning.stage_cuts import PS_PER_S, PartitionProblem, best_cuts, cut_refusals
from autoshard.passes.planning.strategies import legal_tp_degrees, pinned_cuts, pipeline_degrees
from autoshard.passes.planning.tp_layout import hand_tp_layout

MAX_ALTERNATIVES = 12
RECOMPUTE_ORDER = ("none", "mixed", "selective", "alternate", "full")  # ties go to less recompute
MESH_RIVALS = 6  # meshes pruned by their bound that are still priced once, for the alternatives table
GIB = 2**30
StageCutsPin = str | tuple[int, ...] | None  # ir.pins.Pins.stage_cuts


@dataclass(frozen=True)
class Priced:
    config: Decisions
    predicted: Predicted
    fits: bool
    cuts: tuple[int, ...] = ()  # pipeline: the first block of stages 1 .. S−1
    tp_choice: TPChoice | None = field(default=None, compare=False)  # the TP layout when tp > 1


@dataclass(frozen=True)
class SearchResult:
    best: Priced
    alternatives: tuple[Alternative, ...]
    report: dict = field(default_factory=dict)  # the plan's ``search``: candidates, priced, optimal, gap


def search(
    graph: OpGraph,
    cluster: Cluster,
    configs: list[Decisions],
    global_batch: int,
    time_limit_s: float | None = None,
    mixed_recompute: bool = True,
    runtime: str = "autoshard",
    stage_cuts: StageCutsPin = None,
    precision: str | None = None,
) -> SearchResult:
    """The fastest configuration that fits (module doc), and the best rivals priced on the way; priced
    for ``runtime`` (``cost.tables.Runtime.named``) in the ``--precision`` pinned (None: the runtime's), with
    ``--stage-cuts`` where pinned (``pinned_cuts``)."""
    start = time.perf_counter()
    tables = CostTables(graph, cluster, Runtime.named(runtime, cluster, graph, precision))
    if time_limit_s is None and forking_pays(len(configs)):
        units_on_two_cores(tables, [cp_equivalent(c) for c in configs])  # the tables the bounds read
    bounds = [lower_bound_s(tables, config) for config in configs]
    order = sorted(range(len(configs)), key=lambda i: (bounds[i], i))

    def price_one(i: int) -> list[Priced]:
        if configs[i].sequence_parallel and not hand_tp_layout(tables, configs[i]).sequence_parallel:
            return []  # the model keeps no region on 1/tp of the tokens: the same plan as without
        if configs[i].loss_parallel and not hand_tp_layout(tables, configs[i]).loss_parallel:
            return []  # the layout gathers no output projection it could leave on vocabulary shards
        return price_with_mixed(graph, cluster, configs[i], global_batch, tables, mixed_recompute, stage_cuts)

    ahead = (
        price_ahead(order, bounds, price_one, _fastest_s) if time_limit_s is None and forking_pays(len(order)) else {}
    )
    priced: list[Priced] = []
    fastest_s, stopped = float("inf"), False
    for n, i in enumerate(order):  # noqa: B007 (n, where the loop stopped, is read after it)
        if bounds[i] > fastest_s:
            break  # in bound order: no configuration left can be faster
        if time_limit_s is not None and fastest_s < float("inf") and time.perf_counter() - start > time_limit_s:
            stopped = True
            break
        got = ahead[i] if i in ahead else price_one(i)  # priced ahead on a second core, or here
        priced += got
        fastest_s = min(fastest_s, _fastest_s(got))
    else:
        n = len(order)
    feasible = sorted((p for p in priced if p.fits), key=_rank)
    if not priced and configs and all(c.sequence_parallel for c in configs):
        raise AutoshardError(
            f"--sequence-parallel on: this model's tensor-parallel layout at tp="
            f"{configs[0].mesh.tp} keeps no region between its sharded linears that sequence "
            f"parallelism could hold on 1/tp of the tokens; "
            f"leave --sequence-parallel off, or let the planner choose"
        )
    if not priced and configs and all(c.loss_parallel for c in configs):
        choice = hand_tp_layout(tables, replace(configs[0], loss_parallel=False))
        _, why = loss_parallel_layout(graph, choice, tables.tp_solve_link(configs[0].mesh.tp, 1))
        raise AutoshardError(
            f"--loss-parallel on: at tp={configs[0].mesh.tp} {why}; leave --loss-parallel off, or let the "
            f"planner choose"
        )
    if not feasible:
        raise AutoshardError(explain_infeasible(graph, cluster, priced))
    best = feasible[0]
    unpriced = mesh_rivals(configs, order[n:], {p.config.mesh for p in priced})
    rivals = _rivals_priced(
        unpriced, lambda i: [price_config(graph, cluster, configs[i], global_batch, tables, stage_cuts)]
    )
    report = search_report(len(configs), len(priced), best, bounds[order[n]] if stopped else None)
    return SearchResult(best, alternatives(best, priced + rivals, cluster), report)


def _rivals_priced(unpriced: list[int], price_one) -> list[Priced]:
    """The rivals (``mesh_rivals``) priced, in order: on two cores where forking pays (``price_ahead`` with no
    bound to stop it). Each is a mesh the search never priced, whose tables are built for it alone: GPT-3 175B's
    six took 0.9 s of a 5 s search (cProfile)."""
    ahead = {}
    if len(unpriced) > 1 and forking_pays(MIN_CANDIDATES):
        ahead = price_ahead(unpriced, {i: float("-inf") for i in unpriced}, price_one, _fastest_s)
    return [p for i in unpriced for p in (ahead[i] if i in ahead else price_one(i))]


def _fastest_s(priced: list[Priced]) -> float:
    return min((p.predicted.step_time_s for p in priced if p.fits), default=float("inf"))


def price_with_mixed(
    graph: OpGraph,
    cluster: Cluster,
    config: Decisions,
    global_batch: int,
    tables: CostTables,
    mixed_recompute: bool = True,
    stage_cuts: StageCutsPin = None,
) -> list[Priced]:
    """``config`` priced; when it keeps every block's activations and does not fit, also the per-block
    recompute that fits at the least cost (``passes.planning.recompute``), unless recompute is pinned."""
    p = price_config(graph, cluster, config, global_batch, tables, stage_cuts)
    if p.fits or not mixed_recompute or config.recompute != "none":
        return [p]
    mixed = choose_recompute(tables, config)
    return [p] if mixed is None else [p, price_config(graph, cluster, mixed, global_batch, tables, stage_cuts)]


def search_report(candidates: int, priced: int, best: Priced, next_bound_s: float | None) -> dict:
    """The plan's ``search`` field: how much of the space was priced; with ``--time-limit`` cut short,
    the optimality gap (best − the lowest bound left) / best; else optimal on the cost model."""
    gap = 0.0 if next_bound_s is None else max(0.0, 1 - next_bound_s / best.predicted.step_time_s)
    return {"candidates": candidates, "priced": priced, "optimal": next_bound_s is None, "gap": gap}


def mesh_rivals(configs: list[Decisions], unpriced: list[int], priced_meshes: set[Mesh]) -> list[int]:
    """For review only: the lowest-bound configuration of each mesh the search never had to price
    (up to MESH_RIVALS meshes, in bound order), so ``inspect`` can say why those meshes lost."""
    seen: dict[Mesh, int] = {}
    for i in unpriced:
        if len(seen) == MESH_RIVALS:
            break
        if configs[i].mesh not in priced_meshes:
            seen.setdefault(configs[i].mesh, i)
    return list(seen.values())


def lower_bound_s(tables: CostTables, config: Decisions) -> float:
    """(m + (p − 1)/v) · Σ_units c(u) / (tp · p): no configuration of this mesh and micro-batch is faster
    (module doc; p = pp, v virtual stages; without pipelining the factor is m); with host offload plus AdamW's
    step on the CPU over the Ψ/(tp·N) parameters a rank holds at least."""
    units = tables.config_units(cp_equivalent(config))  # cp: the ring only adds to a rank's b/cp share
    compute = units.compute_s
    p = config.mesh.pp
    if p > 1 and tables.cluster.groups:  # node groups: each unit at the fastest group's time, a bound on any cuts
        each = [
            tables.group_tables(g).config_units(cp_equivalent(config)).compute_s
            for g in range(len(tables.cluster.groups))
        ]
        compute = tuple(min(times) for times in zip(*each))
    slots = config.num_microbatches + (p - 1) / config.virtual_stages
    if p > 1 and shared_cores(tables.cluster, config.mesh) is not None:
        slots = config.num_microbatches  # idle ranks lend their cores: only the work itself bounds it
    if config.schedule in ZERO_BUBBLE_SCHEDULES:
        slots = config.num_microbatches  # weight gradients fill the fill and the drain
    bound_s = slots * sum(compute) / (config.mesh.tp * p)
    if config.offloaded:  # AdamW on the CPU over at least Ψ/(tp·N) parameters (``cost.offload``)
        bound_s += cpu_optimizer_s(tables.cluster, tables.graph.param_count / (config.mesh.tp * config.dp_shard))
    return bound_s


def price_config(
    graph: OpGraph,
    cluster: Cluster,
    config: Decisions,
    global_batch: int,
    tables: CostTables | None = None,
    stage_cuts: StageCutsPin = None,
) -> Priced:
    """``config`` priced on ``tables``: its TP layout, DDP bucket and stage cuts (pinned ones as given,
    fit or not; else the fastest, or the fastest that fits)."""
    tables = tables or CostTables(graph, cluster)
    choice = hand_tp_layout(tables, config)
    bucket_mb = choose_bucket_cap_mb(graph, cluster, cp_equivalent(config), tables)  # DDP spans the dp·cp ranks
    config = replace(config, ddp_bucket_cap_mb=bucket_mb)
    if config.mesh.pp == 1:
        return _priced(tables, config, global_batch, (), choice)
    pinned = pinned_cuts(stage_cuts, config, len(graph.blocks))
    if pinned is not None:
        return _priced(tables, config, global_batch, pinned, choice)
    rank = cp_equivalent(config)  # cp: the stages cut by a cp rank's units, its b/cp share (the ring aside)
    fastest = _priced(tables, config, global_batch, time_cuts(tables, rank), choice)
    if fastest.fits:
        return fastest
    cuts = memory_cuts(tables, rank)
    return _priced(tables, config, global_batch, cuts, choice) if cuts is not None else fastest


def _priced(
    tables: CostTables, config: Decisions, global_batch: int, cuts: tuple[int, ...], choice: TPChoice | None
) -> Priced:
    predicted = price(tables.graph, tables.cluster, config, global_batch, tables, cuts or None)
    fits = fits_memory(tables, config, predicted)
    fits = fits and host_fits(tables.cluster, predicted.host_memory_bytes_per_node)  # offload: the host's too
    return Priced(config, predicted, fits, cuts, choice)


def fits_memory(tables: CostTables, config: Decisions, predicted: Predicted) -> bool:
    """Whether each rank's peak fits its device: on node groups each pp rank's against its own group's device
    (an SPMD step's against the smallest, ``topology.slowest_device``)."""
    if tables.cluster.groups and config.mesh.pp > 1 and predicted.pp_rank_memory:
        return all(
            memory.peak_bytes <= tables.for_pp_rank(config, r).cluster.device.memory_bytes
            for r, memory in enumerate(predicted.pp_rank_memory)
        )
    return predicted.memory_peak_bytes_per_rank <= tables.cluster.device.memory_bytes


# ---------------------------------------------------------------------------- stage cuts


def time_cuts(tables: CostTables, config: Decisions) -> tuple[int, ...]:
    """Cuts minimising the slowest stage, memory aside (cached per stage count, whether a split backward reruns full
    recompute and the point's ``CostTables.point_key``: what the units ``partition_problem`` reads are computed
    from, ``pipeline_units``)."""
    split = config.schedule in ZERO_BUBBLE_SCHEDULES and config.recompute == "full"
    key = ("time_cuts", config.num_stages, split, tables.point_key(config))
    if tables.cluster.groups:  # which node group runs each stage: the mesh's and the schedule's
        key += (config.mesh, config.schedule, config.virtual_stages)
    cuts = tables.memo(key, lambda: best_cuts(partition_problem(tables, config, with_memory=False), config.num_stages))
    assert cuts is not None, f"{config.num_stages} stages need at least as many blocks"
    return cuts


def memory_cuts(tables: CostTables, config: Decisions) -> tuple[int, ...] | None:
    """Cuts minimising the slowest stage with every stage under C / ((1 + slack)·v); None if none fit."""
    return best_cuts(partition_problem(tables, config, with_memory=True), config.num_stages)


def partition_problem(tables: CostTables, config: Decisions, with_memory: bool) -> PartitionProblem:
    """The stage-cut problem of ``config`` (``passes.planning.stage_cuts``): unit times in ps, and per stage
    state bytes per parameter × parameters + in-flight micro-batches × saved activations."""
    units, tp_comm = pipeline_units(tables, config)
    scale = PS_PER_S * _time_scale(units.compute_s, tp_comm)
    ps = [round((t + c) * scale) for t, c in zip(units.compute_s, tp_comm)]
    forbidden = tables.memo(("cut_refusals",), lambda: frozenset(cut_refusals(tables.graph)))
    problem = PartitionProblem(tuple(ps[1:-1]), ps[0], ps[-1], forbidden_starts=forbidden)
    v = config.virtual_stages
    if tables.cluster.groups:
        problem = replace(problem, **_group_stage_figures(tables, config, scale, v))
    if not with_memory:
        return problem
    per_param = state_bytes_per_param(tables.precision, config)
    fixed = [per_param * n for n in units.params]
    acts = [s + w for s, w in zip(units.saved_bytes, units.workspace_bytes)]
    flights = stage_in_flight(config)
    cap = tables.cluster.device.memory_bytes / (1 + ALLOCATOR_SLACK) / v
    return replace(
        problem,
        block_fixed_bytes=tuple(fixed[1:-1]),
        prefix_fixed_bytes=fixed[0],
        suffix_fixed_bytes=fixed[-1],
        block_act_bytes=tuple(acts[1:-1]),
        prefix_act_bytes=acts[0],
        suffix_act_bytes=acts[-1],
        in_flight=flights,
        cap_bytes=cap,
    )


def _group_stage_figures(tables: CostTables, config: Decisions, scale: float, v: int) -> dict:
    """Each stage's unit times and memory cap on the node group its pp rank is in (``stage_cuts``, "Node
    groups"): the group's tables' units, at one common scale (the slowest device's, ``scale``), and its device's
    memory over (1 + slack)·v."""
    owner = stage_owners(config.schedule, config.mesh.pp, v)
    times, caps = [], []
    for s in range(config.num_stages):
        group = tables.for_pp_rank(config, owner[s])
        units, tp_comm = pipeline_units(group, config)
        ps = [round((t + c) * scale) for t, c in zip(units.compute_s, tp_comm)]
        times.append((tuple(ps[1:-1]), ps[0], ps[-1]))
        caps.append(group.cluster.device.memory_bytes / (1 + ALLOCATOR_SLACK) / v)
    return {"stage_times": tuple(times), "stage_caps": tuple(caps)}


MAX_TOTAL_PS = 2**52  # the stage-cut tables sum unit times in int64: a step above ~75 minutes is scaled down


def _time_scale(compute_s, tp_comm) -> float:
    """1, or what brings the units' total time under MAX_TOTAL_PS picoseconds: only the cuts' order
    matters (they minimise the slowest stage), and int64 sums overflow beyond ~106 days of compute
    (slow devices, huge micro-batches). Plans of ordinary steps are unchanged."""
    total = sum(compute_s) + sum(tp_comm)
    return 1.0 if total * PS_PER_S <= MAX_TOTAL_PS else MAX_TOTAL_PS / (total * PS_PER_S)


# ---------------------------------------------------------------------------- alternatives


def alternatives(best: Priced, priced: list[Priced], cluster: Cluster) -> tuple[Alternative, ...]:
    """The best runner-up of each mesh, schedule, ZeRO stage and recompute mode, then the next fastest."""
    others = sorted((p for p in priced if p is not best), key=_rank)
    chosen: list[Priced] = []
    keys = [("mesh", m) for m in dict.fromkeys(p.config.mesh for p in others)]
    keys += [("schedule", s) for s in SCHEDULES] + [("zero", z) for z in range(4)]
    keys += [("recompute", r) for r in RECOMPUTE_MODES]
    for name, value in keys:
        match = next((p for p in others if _attr(p, name) == value and p not in chosen), None)
        if match is not None:
            chosen.append(match)
    chosen += [p for p in others if p not in chosen][: max(0, MAX_ALTERNATIVES - len(chosen))]
    chosen = sorted(chosen[:MAX_ALTERNATIVES], key=_rank)
    return tuple(_alternative(p, best, cluster) for p in chosen)


def tightest_memory(p: Priced, cluster: Cluster) -> tuple[int, int]:
    """(peak bytes, device bytes) of the rank with the least room: on node groups each pipeline rank against its
    own group's device (``fits_memory``), else the peak against the cluster's device."""
    by_rank, mesh = p.predicted.pp_rank_memory, p.config.mesh
    if not cluster.groups or mesh.pp == 1 or not by_rank:
        return p.predicted.memory_peak_bytes_per_rank, cluster.device.memory_bytes
    per_stage = mesh.world_size // mesh.pp
    pairs = [
        (m.peak_bytes, cluster.groups[cluster.rank_group(r * per_stage)].device.memory_bytes)
        for r, m in enumerate(by_rank)
    ]
    return min(pairs, key=lambda pair: (pair[1] - pair[0], pair))


def why_not(p: Priced, best: Priced, cluster: Cluster) -> str:
    if not host_fits(cluster, p.predicted.host_memory_bytes_per_node):
        host = p.predicted.host_memory_bytes_per_node
        return (
            f"offloaded state does not fit the host: {host / GIB:.1f} GiB per node over "
            f"{HOST_USABLE:.0%} of its {cluster.device.host_memory_bytes / GIB:.0f} GiB"
        )
    if not p.fits:
        peak, device = tightest_memory(p, cluster)
        return f"does not fit: {(peak - device) / GIB:.2f} GiB over the {device / GIB:.1f} GiB per device"
    slower = p.predicted.step_time_s / best.predicted.step_time_s - 1.0
    if slower > 1e-9:
        part = _largest_gap(p.predicted, best.predicted)
        return f"{slower:.1%} slower ({part})"
    return "tie on time; the chosen plan needs less memory or is simpler"


def explain_infeasible(graph: OpGraph, cluster: Cluster, priced: list[Priced]) -> str:
    """Name the binding constraint, by how much it is missed, and what to change."""
    least = min(priced, key=lambda p: p.predicted.memory_peak_bytes_per_rank)
    need, have = tightest_memory(least, cluster)
    c = least.config
    if need <= have:  # it fits the device with its state offloaded, not the host
        host = least.predicted.host_memory_bytes_per_node
        return (
            f"no plan fits in memory: the leanest ({c.mesh}, ZeRO-{c.zero_stage}, offload {c.offload}) fits the "
            f"devices, but its offloaded state needs {host / GIB:.1f} GiB of host memory per node, over "
            f"{HOST_USABLE:.0%} of the {cluster.device.host_memory_bytes / GIB:.0f} GiB a node has; try more nodes "
            f"(--nodes), or a cluster file whose device gives the hosts' host_memory_bytes"
        )
    hints = _mesh_hints(graph, cluster, priced)
    tried = {(p.config.zero_stage, p.config.recompute) for p in priced}  # pins may have ruled some out
    if (
        c.zero_stage < 3 and c.mesh.pp == 1 and c.mesh.dp > 1 and 3 not in {z for z, _ in tried}
    ):  # dp 1: nothing to shard
        hints.append("allow --zero 3")
    if c.recompute != "full" and "full" not in {r for _, r in tried}:
        hints.append("allow --recompute full")
    if not any(p.config.offloaded for p in priced) and offload_refusal(c.mesh, 3, c.ep, cluster.backend) is None:
        hints.append("allow --offload cpu")
    if c.microbatch_size > 1:
        hints.append("a smaller --microbatch-size")
    devices_needed = _devices_needed(graph, cluster, least)
    if devices_needed <= MAX_DEVICES:
        hints.append(f"about {devices_needed} devices (--nodes {-(-devices_needed // cluster.devices_per_node)})")
    else:  # clamped: no cluster autoshard plans for is that big
        hints.append(
            f"devices with more memory (it would take about {devices_needed:,} of these, more than the "
            f"{MAX_DEVICES:,} autoshard plans for)"
        )
    return (
        f"no plan fits in memory: the leanest ({c.mesh}, ZeRO-{c.zero_stage}, micro-batch {c.microbatch_size}, "
        f"recompute {c.recompute}) needs {_bytes_text(need)} per rank but devices have {_bytes_text(have)} "
        f"({_bytes_text(need - have)} short); try {', '.join(hints)}"
    )


def _bytes_text(n: int) -> str:
    """ "172.27 GiB", "5.23 MiB", "1000 bytes": the unit that shows the figure."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"


def _mesh_hints(graph: OpGraph, cluster: Cluster, priced: list[Priced]) -> list[str]:
    """--tp / --pp degrees the search did not try (pinned away) that would split the model further."""
    tried_tp = max(p.config.mesh.tp for p in priced)
    tried_pp = max(p.config.mesh.pp for p in priced)
    hints = []
    tp = max(legal_tp_degrees(graph, cluster), default=1)
    if tp > tried_tp:
        hints.append(f"--tp {tp} (tensor parallelism inside a node)")
    pp = max(pipeline_degrees(graph, cluster.world_size), default=1)
    if pp > tried_pp:
        hints.append(f"--pp {pp} (pipeline stages)")
    return hints


def _devices_needed(graph: OpGraph, cluster: Cluster, least: Priced) -> int:
    """Devices at which the leanest plan would fit. Pure DP: ZeRO-3 shards of the full model state
    next to the unshardable rest; with tp or pp (or no room left), every byte divides over the devices."""
    need, have = least.predicted.memory_peak_bytes_per_rank, cluster.device.memory_bytes
    mem = least.predicted.memory
    precision = precision_for_backend(cluster.backend)
    full_state = graph.param_count * (precision.param_bytes + precision.grad_bytes + precision.optimizer_bytes)
    room = have - max(0, need - (mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes))
    proportional = -(-cluster.world_size * need // have)
    if least.config.mesh.tp == least.config.mesh.pp == 1 and room > 0:
        return max(cluster.world_size + 1, -(-full_state // room))
    return max(cluster.world_size + 1, proportional)


def _alternative(p: Priced, best: Priced, cluster: Cluster) -> Alternative:
    c = p.config
    return Alternative(
        mesh=c.mesh,
        zero_stage=c.zero_stage,
        microbatch_size=c.microbatch_size,
        recompute=c.recompute,
        schedule=c.schedule,
        predicted=p.predicted and replace(p.predicted, pp_rank_memory=()),  # the plan keeps its own
        why_not=why_not(p, best, cluster),
        float8=c.float8,
        offload=c.offload,
    )


def _largest_gap(worse: Predicted, best: Predicted) -> str:
    gaps = {
        "compute": worse.compute_s - best.compute_s,
        "exposed communication": worse.comm_exposed_s - best.comm_exposed_s,
        "pipeline bubble": worse.bubble_s - best.bubble_s,
    }
    name, gap = max(gaps.items(), key=lambda kv: kv[1])
    return f"+{gap * 1e3:.3g} ms {name}"


def _rank(p: Priced) -> tuple:
    c = p.config
    return (
        not p.fits,
        round(p.predicted.step_time_s, 12),
        p.predicted.memory_peak_bytes_per_rank,
        c.zero_stage,
        c.offloaded,  # ties: the state on the device
        -c.microbatch_size,
        RECOMPUTE_ORDER.index(c.recompute),
        c.mesh.tp,
        c.mesh.pp,
        SCHEDULES.index(c.schedule),
        c.virtual_stages,
    )


def _attr(p: Priced, key: str):
    return {
        "mesh": p.config.mesh,
        "schedule": p.config.schedule,
        "zero": p.config.zero_stage,
        "recompute": p.config.recompute,
    }[key]
