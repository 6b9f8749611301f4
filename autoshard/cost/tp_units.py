"""One TP rank's share of the work: the units and the compute of a micro-batch under the layout handed in.

Without TP every rank runs every unit whole. With tp = t > 1 and the layout's shares
(``cost.tp``: f(u) over all of unit u's ops, over its light ops for selective recompute), per
unit u: forward, backward and recompute × their shares left per rank, parameters × local(u)/params(u)
(sharded weights / t), the saved activations, workspace and activation gradients of one TP rank
(``CostTables.activation_units``: ``cost.saved``'s per-op rules on its shards' shapes), the activation entering
each block on the rank (1/t of the tokens where sequence parallelism shards it: ``boundary_shares``), and the unit's
own TP collectives (a block's are its segment's; those of the ops outside blocks are split evenly
over prefix and suffix). DTensor's host time adds ``tp_module_us`` per module that shards a weight and
``sequence_module_us`` per module of another tensor-parallel style, per micro-batch, in the unit that runs it (the
model's own figures where ``calibrate --model`` measured them: ``module_host_s``).
"""

from __future__ import annotations

import functools
from dataclasses import replace

from autoshard.cost.async_tp import exposed_tp_comm_s, fused_collectives, matmul_s
from autoshard.cost.compute import ComputeTime
from autoshard.cost.float8 import float8_tp_comm_factor
from autoshard.cost.tables import CostTables, layout_key
from autoshard.cost.tp import (
    TPCost,
    block_input_shares,
    local_params_by_block,
    splits_param,
    styles_key,
    tp_comm_factor,
)
from autoshard.cost.units import Units, node_units, unit_param_names
from autoshard.ir.decisions import SHARDING_STYLES, ZERO_BUBBLE_SCHEDULES, Decisions
from autoshard.ir.graph import OpGraph


def spmd_microbatch(tables: CostTables, config: Decisions) -> tuple[ComputeTime, float, int]:
    """(compute of one micro-batch per rank, its TP communication, parameters per rank)."""
    units = tables.config_units(config)
    if config.mesh.tp == 1:
        ones = (1.0,) * len(units.forward_s)
        return _compute_time(units, ones, ones), 0.0, tables.graph.param_count
    tp = tables.layout_cost(config)
    modes = config.block_modes(len(tables.graph.blocks))
    compute = _compute_time(units, *_fractions(tp, modes))
    float8 = float8_tp_comm_factor(config, tables.precision.activation_bytes)
    comm = tp.comm_s * tp_comm_factor(modes, config.sequence_parallel) * float8
    if config.async_tp:
        comm = _async_tp_comm_s(tables, config, tp, compute, comm, tp_comm_factor(modes, config.sequence_parallel))
    return compute, comm, tp.local_params


def _async_tp_comm_s(
    tables: CostTables, config: Decisions, tp: TPCost, compute: ComputeTime, comm_s: float, factor: float
) -> float:
    """The TP collectives left exposed under async TP (``cost.async_tp``): M the micro-batch's compute on the
    rank × its blocks' share in 2-D matmuls (the units' forward-weighted mean of ``TPCost.matmul_fraction``)."""
    units = tables.config_units(config)
    weights = [f * x for f, x in zip(tp.unit_fraction, units.forward_s)]
    fraction = sum(w * m for w, m in zip(weights, tp.matmul_fraction)) / sum(weights) if sum(weights) else 0.0
    blocks = tuple(b.path for b in tables.graph.blocks)
    collectives = fused_collectives(tp.choice.styles, blocks, factor)
    return exposed_tp_comm_s(comm_s, matmul_s(compute, fraction), collectives, config.mesh.tp)


def _fractions(tp: TPCost, modes: tuple[str, ...]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(forward, recompute) share per unit left per TP rank: a selective block reruns its light ops."""
    rerun = [
        tp.light_fraction[u] if 0 < u <= len(modes) and modes[u - 1] == "selective" else tp.unit_fraction[u]
        for u in range(len(tp.unit_fraction))
    ]
    return tp.unit_fraction, tuple(rerun)


def _compute_time(units: Units, fraction: tuple[float, ...], recompute_fraction: tuple[float, ...]) -> ComputeTime:
    fwd = sum(f * x for f, x in zip(units.forward_s, fraction))
    bwd = sum(f * x for f, x in zip(units.backward_s, fraction))
    return ComputeTime(fwd, bwd, sum(f * x for f, x in zip(units.recompute_s, recompute_fraction)))


def pipeline_units(tables: CostTables, config: Decisions, first_stage: bool = False) -> tuple[Units, tuple[float, ...]]:
    """``tp_sharded_units``, once per (split backward, ``CostTables.point_key``) in a search; with a zero-bubble
    schedule's split backward, full recompute rerun as often as it runs (``split_backward_recomputes``) but on
    the ``first_stage``: torch runs the first stage's backward whole, in its weight step (its inputs need no
    gradient, so ``stage_backward_input`` would leave its parameter groups uncaptured: ``PipelineStage``'s
    ``backward_weight_one_chunk``), and its blocks rerun once."""
    split = config.schedule in ZERO_BUBBLE_SCHEDULES and config.recompute == "full" and not first_stage
    key = ("pipeline_units", split, tables.point_key(config))

    def compute() -> tuple[Units, tuple[float, ...]]:
        units, comm = tp_sharded_units(tables, config)
        return (split_backward_recomputes(tables.graph, units) if split else units), comm

    return tables.memo(key, compute)


def split_backward_recomputes(graph: OpGraph, units: Units) -> Units:
    """``units`` with each block's recompute run twice when a weight pass reaches it, once otherwise.

    torch's zero-bubble schedules split a stage's backward into the inputs' gradient (``stage_backward_input``)
    and the weights' (``stage_backward_weight``: one ``autograd`` call per parameter group, a group being the
    parameters one op reads). A block under non-reentrant activation checkpointing reruns its forward in the
    input pass, and in the weight pass once if any of its ops reads a parameter (g_b > 0): the emitted program
    runs the weight pass's calls under one ``GraphExecGroup`` (``runtime.pipeline_parallel``), which shares one
    rerun among them; without it a block reran 1 + g_b times (``benchmarks/experiments/split_backward_recompute.py``).
    Host time of the recompute is multiplied alike."""
    groups = [0] + [weight_groups(graph, b.node_names) for b in graph.blocks] + [0]
    if len(groups) != len(units.recompute_s):
        raise ValueError(f"{len(units.recompute_s)} units for {len(graph.blocks)} blocks")
    reruns = [1 + min(g, 1) for g in groups]
    return replace(
        units,
        recompute_s=tuple(t * n for t, n in zip(units.recompute_s, reruns)),
        host_recompute_s=tuple(t * n for t, n in zip(units.host_recompute_s, reruns)),
    )


def unit_weight_groups(graph: OpGraph) -> tuple[int, ...]:
    """``weight_groups`` of each unit (the prefix, each block, the suffix), once per graph."""

    def compute() -> tuple[int, ...]:
        counts = [0] * (len(graph.blocks) + 2)
        for node, u in zip(graph.nodes, node_units(graph)):
            counts[u] += any(not graph.param(p).is_buffer for p in node.param_inputs)
        return tuple(counts)

    return graph.derived("unit_weight_groups", compute)


def weight_groups(graph: OpGraph, node_names) -> int:
    """The ops among ``node_names`` that read a parameter, not only buffers (g_b of ``split_backward_recomputes``:
    the weight pass's ``autograd`` calls in the block)."""
    return sum(1 for name in node_names if any(not graph.param(p).is_buffer for p in graph.node(name).param_inputs))


def tp_sharded_units(tables: CostTables, config: Decisions) -> tuple[Units, tuple[float, ...]]:
    """The units of one micro-batch as one TP rank of a stage sees them, and each unit's TP comm.

    With tp = t > 1 (the layout choice of ``CostTables.tp_cost``): per unit u, forward and
    recompute × their shares left per rank (``unit_tp_fractions``; selective recompute: of the
    light ops), parameters × local(u)/params(u) (sharded weights / t), saved activations,
    workspace and activation gradients on the rank's shapes (``CostTables.activation_units``), the activation
    entering each block on the rank (``boundary_shares``: what a pipeline boundary there sends); TP
    collectives of a block are its segment's, those of the ops outside blocks are split evenly over
    prefix and suffix. They sit between dependent matmuls, so they count with the compute of the
    unit (exposed).
    """
    units = tables.activation_units(config, config.recompute)
    tp = config.mesh.tp
    if tp == 1:
        return units, (0.0,) * len(units.forward_s)
    cost = tables.layout_cost(config)
    f, f_recompute = _fractions(cost, config.block_modes(units.blocks))
    share = _unit_param_share(tables.graph, cost.choice.sharded, tp)
    sharded = replace(
        units,
        forward_s=tuple(x * k for x, k in zip(units.forward_s, f)),
        backward_s=tuple(x * k for x, k in zip(units.backward_s, f)),
        recompute_s=tuple(x * k for x, k in zip(units.recompute_s, f_recompute)),
        params=tuple(round(n * k) for n, k in zip(units.params, share)),
        boundary_bytes=tuple(int(n * k) for n, k in zip(units.boundary_bytes, boundary_shares(tables, config))),
    )
    factor = tp_comm_factor(config.block_modes(units.blocks), config.sequence_parallel)
    return sharded, _unit_tp_comm(tables.graph, cost, factor)


def boundary_shares(tables: CostTables, config: Decisions) -> tuple[float, ...]:
    """Per block, the part of the activation entering it that one TP rank holds (``cost.tp.block_input_shares``):
    1/tp where sequence parallelism leaves the residual stream sharded over the tokens, 1 elsewhere."""
    if config.mesh.tp == 1:
        return (1.0,) * len(tables.graph.blocks)
    choice = tables.layout_cost(config).choice
    key = ("block_input_shares", choice.tp, styles_key(choice))
    return tables.graph.derived(key, lambda: block_input_shares(tables.graph, tables.rank_share(config)))


def _unit_param_share(graph: OpGraph, sharded: dict[str, str], tp: int) -> tuple[float, ...]:
    """Per unit: parameters left per TP rank over all its parameters (each block; the prefix and the suffix
    each of their own parameters: an embedding left whole beside a split head differ)."""
    local = local_params_by_block(graph, sharded, tp)
    per_block = [local.get(b.path, 0) / max(1, b.param_count) for b in graph.blocks]
    ends = [_rest_share(graph, names, sharded, tp) for names in unit_param_names(graph)[:: len(graph.blocks) + 1]]
    return (ends[0], *per_block, ends[-1])


def _rest_share(graph: OpGraph, names: set[str], sharded: dict[str, str], tp: int) -> float:
    """Parameters per TP rank over all of ``names`` (a unit's outside the blocks); 1 without any."""
    params = [p for p in graph.params if p.name in names and not p.is_buffer]
    whole = sum(p.numel for p in params)
    local = sum(p.numel // tp if splits_param(sharded.get(p.module_path), p.name) else p.numel for p in params)
    return local / whole if whole else 1.0


def _unit_tp_comm(graph: OpGraph, cost: TPCost, factor: float) -> tuple[float, ...]:
    """Per unit: TP collectives of one micro-batch (``TPCost.comm_s`` is their sum over units)."""
    total = sum(s.comm_s * s.repeats for s in cost.choice.segments)
    scale = cost.comm_s * factor / total if total else 0.0
    by_path = {s.path: s.comm_s * scale for s in cost.choice.segments}
    rest = by_path.get("", 0.0) / 2
    return (rest, *(by_path.get(b.representative, 0.0) for b in graph.blocks), rest)


def forward_reruns(config: Decisions, blocks: int) -> tuple[float, ...]:
    """How many times recompute reruns each unit's forward per micro-batch: once in a block under any recompute
    mode, never outside the blocks (a zero-bubble split backward's are ``pipeline_step.stage_forward_reruns``)."""
    return _forward_reruns(config.block_modes(blocks))


@functools.lru_cache(maxsize=256)
def _forward_reruns(modes: tuple[str, ...]) -> tuple[float, ...]:
    """``forward_reruns`` of the blocks' ``modes``, once per distinct modes (the search reads it per stage of
    every priced plan)."""
    return (0.0, *(float(mode != "none") for mode in modes), 0.0)


def tp_host_per_unit_s(
    tables: CostTables, config: Decisions, reruns: tuple[float, ...] | None = None
) -> tuple[float, ...]:
    """DTensor's host time per micro-batch in each unit: its modules of a style that shards a weight ×
    tp_module_us, and those of a style that shards none (a norm on a sequence or head shard, a sequence gather or
    scatter) × sequence_module_us; a module counts in the unit of its first op. A forward that recompute reruns
    (``reruns``, per unit; ``forward_reruns`` by default) pays the forward's share s_f of it again (DTensor's op
    dispatch and the styles' hooks run again, also where selective recompute's policy serves an op's output, even
    a collective's, from its cache)::

        host(u) = Σ_{modules of u} us(style) · (1 + s_f · reruns(u))          s_f = ``forward_share``"""
    per_unit = modules_host_s(tables, config)
    reruns = forward_reruns(config, len(per_unit) - 2) if reruns is None else reruns
    if not any(per_unit):
        return per_unit  # t·(1 + s_f·n) of every t = 0.0 is 0.0
    share = forward_share(tables)
    key = ("tp_host_per_unit", layout_key(config), share, reruns)
    return tables.memo(key, lambda: tuple(t * (1 + share * n) for t, n in zip(per_unit, reruns)))


def modules_host_s(tables: CostTables, config: Decisions) -> tuple[float, ...]:
    """Per unit: its DTensor modules' host time of one micro-batch's forward and backward (``tp_host_per_unit_s``),
    once per TP layout (``layout_key``) in a search."""
    count = len(tables.graph.blocks) + 2
    tp_module_s, sequence_module_s = module_host_s(tables)
    if config.mesh.tp == 1 or not (tp_module_s or sequence_module_s):
        return (0.0,) * count

    def compute() -> tuple[float, ...]:
        sharded = tables.layout_cost(config).choice.sharded
        unit_of = {}
        for node, u in zip(tables.graph.nodes, node_units(tables.graph)):
            for depth in range(node.module_path.count(".") + 1):  # the module and every module holding it
                unit_of.setdefault(node.module_path.rsplit(".", depth)[0], u)
        per_unit = [0.0] * count
        for path, style in sharded.items():
            if path in unit_of:
                per_unit[unit_of[path]] += tp_module_s if style in SHARDING_STYLES else sequence_module_s
        return tuple(per_unit)

    return tables.memo(("tp_modules_host", layout_key(config)), compute)


def module_host_s(tables: CostTables) -> tuple[float, float]:
    """DTensor's host time per module, (of a style that shards a weight, of one that shards none): the model's,
    measured on its own tensor-parallel layouts by ``calibrate --model`` (``ModelProfile.tp_module_s``,
    ``sequence_module_s``), else the host probes' (``tp_module_us``, ``sequence_module_us``)."""
    profile, host = tables.profile, tables.cluster.host
    if profile is not None and profile.tp_module_s is not None:
        return profile.tp_module_s, profile.sequence_module_s or 0.0
    return host.tp_module_us * 1e-6, host.sequence_module_us * 1e-6


def forward_share(tables: CostTables) -> float:
    """The share of a module's DTensor host time that its forward takes, which a recomputed forward runs again: the
    model's, measured on its own sequence-parallel layout with full recompute (``ModelProfile.tp_forward_share``),
    else the host probes' (``HostOverheads.tp_forward_share``)."""
    profile = tables.profile
    if profile is not None and profile.tp_forward_share is not None:
        return profile.tp_forward_share
    return tables.cluster.host.tp_forward_share
