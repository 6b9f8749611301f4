"""Recompute per block: which blocks to recompute, and how, so that a configuration fits.

Recomputing every block (Megatron-LM's full recompute) buys memory with a whole extra forward;
often only some blocks need it. For a configuration c without pipelining whose blocks all keep
their activations and that does not fit, this chooses a mode r_k ∈ {none, selective, full} for
each block k. Blocks with one ``signature`` are interchangeable, so the variables are counts
per signature group g (repeated blocks share them)::

    n[g,r] ∈ {0 … |g|},  Σ_r n[g,r] = |g|           u[g,r] ∈ {0, 1},  n[g,r] ≤ |g|·u[g,r]
    W ≥ w[g,r]·u[g,r]                                (the largest recompute workspace in use)

    minimise    Σ_{g,r} n[g,r]·t[g,r]                recompute time of one micro-batch, ps
    subject to  Σ_{g,r} n[g,r]·a[g,r] + W ≤ A        (``add_memory_constraint``)

with, from the cost model (``cost.rank_memory.memory_spmd``, ``cost.units``) at c's micro-batch: t the
recompute time of one block of g in mode r (device and host), a its saved activation bytes and w
its workspace, both on one TP rank's shapes (``CostTables.activation_units``), and A the memory
left for block activations: C / (1 + slack) − weights, gradients, optimizer
state, transients and the prefix's and suffix's activations. The model is solved to optimality
by CP-SAT (one worker, so the answer is deterministic); a group's blocks take their modes in
block order (full first, then selective, then none: for one stage the order changes nothing).

Pipelines (pp > 1) take one mode for every block (``passes.planning.strategies``; the stages run it through
``runtime.stage_recompute``), never a mix: pp rank r keeps in_flight(r) micro-batches of its own
stages' blocks, so a mix would need one memory constraint per rank over the blocks the stage cuts
give it, while the cuts are chosen after the modes; and the pipeline pricing takes one recompute
mode per configuration (its per-unit tables are keyed by it). ``choose_recompute`` returns None there.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from autoshard.cost.context_parallel import cp_equivalent, unit_ring_costs
from autoshard.cost.memory import model_state_bytes
from autoshard.cost.rank_memory import ALLOCATOR_SLACK, spmd_moments
from autoshard.cost.tables import CostTables
from autoshard.cost.tp import recompute_tp_comm
from autoshard.cost.tp_units import forward_share, modules_host_s, spmd_microbatch
from autoshard.ir.decisions import MIXED, Decisions, compile_runs
from autoshard.ir.plan import RECOMPUTE_MODES

PS_PER_S = 10**12


def choose_recompute(tables: CostTables, config: Decisions) -> Decisions | None:
    """``config`` with the per-block modes that fit at the least recompute time (module doc); None
    when no assignment fits, or when the best one is uniform (a candidate of its own)."""
    from ortools.sat.python import cp_model

    if config.mesh.pp > 1 or not tables.graph.blocks:
        return None
    decided, config = (
        config,
        cp_equivalent(config),
    )  # a cp rank's blocks are a dp rank's at b/cp (cost.context_parallel)
    rings = unit_ring_costs(tables, decided) if decided.mesh.cp > 1 else None  # their buffers, in each backward
    groups = signature_groups(tables)
    modes_run = block_modes_run(decided)
    by_mode = {r: tables.activation_units(config, r) for r in modes_run}  # a TP rank's bytes
    model = cp_model.CpModel()
    count = {(g, r): model.NewIntVar(0, len(blocks), f"n_{g}_{r}") for g, blocks in groups.items() for r in modes_run}
    used = {key: model.NewBoolVar(f"u_{key[0]}_{key[1]}") for key in count}
    for g, blocks in groups.items():
        model.Add(sum(count[g, r] for r in modes_run) == len(blocks))
        for r in modes_run:
            model.Add(count[g, r] <= len(blocks) * used[g, r])
    add_memory_constraint(model, tables, config, groups, by_mode, count, used, rings)
    model.Minimize(
        sum(count[g, r] * _ps(block_recompute_s(tables, config, by_mode[r], r, groups[g][0])) for g, r in count)
    )
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    if solver.Solve(model) != cp_model.OPTIMAL:
        return None
    modes = assign(groups, {key: solver.Value(var) for key, var in count.items()}, len(tables.graph.blocks))
    if len(set(modes)) == 1:
        return None
    return replace(decided, recompute=MIXED, recompute_blocks=modes)  # every other decision kept (HSDP, ep, cp, ...)


def block_modes_run(config: Decisions) -> tuple[str, ...]:
    """The recompute modes a block of ``config`` may take: all, but beside compiled blocks those they run under
    (``ir.decisions.compile_runs``: beside cp none or full, since selective's policy is a dispatch mode under which
    dynamo compiles nothing)."""
    if not config.compile:
        return RECOMPUTE_MODES
    mesh, ep, sp, schedule = config.mesh, config.ep, config.sequence_parallel, config.schedule
    return tuple(r for r in RECOMPUTE_MODES if compile_runs(mesh, ep, sp, r, schedule))


def block_recompute_s(tables: CostTables, config: Decisions, units, mode: str, k: int) -> float:
    """t[g, r] of the module doc for block k: its recompute on one TP rank (a selective block reruns
    its light ops' share), its host time, and its share of the forward TP collectives the mode repeats
    (``cost.tp.recompute_tp_comm``), and under either mode the forward's share of its DTensor modules'
    host time (``cost.tp_units.tp_host_per_unit_s``)."""
    u = k + 1
    host = units.host_recompute_s[u] if units.host_recompute_s else 0.0
    if config.mesh.tp == 1:
        return units.recompute_s[u] + host
    tp = tables.layout_cost(config)
    share = tp.light_fraction[u] if mode == "selective" else tp.unit_fraction[u]
    repeated = (recompute_tp_comm(mode, config.sequence_parallel) - 1.0) * tp.comm_s / len(tables.graph.blocks)
    dtensor = forward_share(tables) * modules_host_s(tables, config)[u] if mode != "none" else 0.0
    return units.recompute_s[u] * share + host + repeated + dtensor


def signature_groups(tables: CostTables) -> dict[int, list[int]]:
    """Block indices by block signature, groups in order of their first block."""
    by_signature: dict[str, list[int]] = defaultdict(list)
    for k, block in enumerate(tables.graph.blocks):
        by_signature[block.signature].append(k)
    return dict(enumerate(by_signature.values()))


def add_memory_constraint(
    model, tables: CostTables, config: Decisions, groups, by_mode, count, used, rings=None
) -> None:
    """Σ n·a + W ≤ A (module doc), in bytes, at each moment whose activations the modes change
    (``cost.rank_memory.spmd_moments``: the loss's, without W, and the last block's backward, whose activation
    gradients hold a cp ring's buffers where ``rings``, as the step prices them)."""
    _, _, local = spmd_microbatch(tables, config)
    state = model_state_bytes(local, config.zero_stage, config.dp_shard, tables.precision)
    none = replace(config, recompute="none", recompute_blocks=())
    moments = spmd_moments(tables, none, local, state, rings=rings)
    blocks_none = sum(by_mode["none"].saved_bytes[1:-1])
    capacity = tables.cluster.device.memory_bytes / (1 + ALLOCATOR_SLACK)
    room = {
        name: int(capacity - sum(moments[name].values()) + blocks_none)
        for name in ("loss", "backward")
        if name in moments
    }
    largest = max(by_mode[r].workspace_bytes[k + 1] for r in by_mode for blocks in groups.values() for k in blocks)
    workspace = model.NewIntVar(0, int(largest) + 1, "workspace")
    for (gi, r), var in used.items():
        model.Add(workspace >= int(by_mode[r].workspace_bytes[groups[gi][0] + 1]) * var)
    saved = sum(count[gi, r] * int(by_mode[r].saved_bytes[groups[gi][0] + 1]) for (gi, r) in count)
    model.Add(saved <= room["loss"])
    if "backward" in room:
        model.Add(saved + workspace <= room["backward"])


def assign(groups: dict[int, list[int]], counts: dict[tuple[int, str], int], blocks: int) -> tuple[str, ...]:
    """Each block's mode: in each group, the first blocks full, then selective, then none."""
    modes = ["none"] * blocks
    for g, members in groups.items():
        order = [r for r in ("full", "selective", "none") for _ in range(counts[g, r])]
        for k, mode in zip(members, order):
            modes[k] = mode
    return tuple(modes)


def _ps(seconds: float) -> int:
    return round(seconds * PS_PER_S)
