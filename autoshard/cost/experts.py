"""Expert parallelism's cost: the all-to-alls, the most-loaded rank's expert work, the expert state.

Notation: ep ranks share each expert group (``ir.graph.ExpertGroup``: E experts, k per token,
hidden H); a micro-batch gives each rank T tokens, so n = T·k token-expert pairs leave it; F_e the
group's grouped-matmul FLOPs on those n pairs (forward); Ψ_e its parameters; a = bytes per
activation element; dp ranks in all, the ep ranks adjacent among them (``runtime.expert_parallel``).

**Load.** Every rank waits for the slowest in each all-to-all, so the expert work of a rank is
that of the rank receiving the most pairs: λ·n with λ = ``moe.rank_load_factor`` (the expected
maximum over ep ranks of balls-into-bins loads, not the mean; λ = 1 at ep = 1).

**Time per micro-batch, per group** (``unit_expert_costs``)::

    forward   += (λ − 1)·t(F_e)                  the most-loaded rank's extra rows
    backward  += (λ − 1)·2·t(F_e)
    recompute += λ·t(F_e)                        the dispatch op recomputes its experts in backward
    all-to-all = 5 · A2A(λ·n·H·a over ep ranks)  forward: dispatch + combine; backward: the dispatch
                 + 2 · A2A(0)                    again, the output gradient out, the input gradient back;
                                                 and the per-expert counts exchanged before each dispatch
                 (``comm.all_to_all_s``; the receivers' share scaled by λ: ``moe.moe_layer_a2a_s``),
                 exposed: each sits between dependent computations

with t(F) = F / (peak · matmul efficiency). **Host** (``HostOverheads``, measured by calibrate; the
device's own time on CPU ranks): the dispatch op runs ``DISPATCH_OPS`` ops of its own around the
module's n_e ops (routing, counts, the exchanges' bookkeeping, the un-sorting) in the forward, and in
the backward the same again plus the module's n_e ops recomputed (``ExpertUnitCost.host_s``)::

    host += (2·DISPATCH_OPS + n_e)·h_fwd        h_fwd the measured host time per forward op

and each expert group is a unit of its own for the dp wrapper (FSDP2's per-unit host time).

**Expert state.** Each rank holds Ψ_e / ep of every group; its gradients are reduced over the
dp / ep ranks holding the same shard, so ZeRO shards it dp / ep ways (``expert_state_params``),
while the rest of the model is sharded dp ways as before.

**Memory of the dispatch** (``dispatch_memory``, per block; S = T·k pairs of the micro-batch, P = S·H·a).
The captured graph runs each group's module on the rank (its gathers, grouped GEMMs, activation, un-sort),
and ``cost.saved`` prices what those ops keep for backward, X (the largest part: the gate/up GEMM's output
and the activation, 4·I·a per pair), and the largest op of its backward, D. Under ep > 1 the module is one
op (``runtime.expert_parallel.expert_ffn``) that keeps only its inputs, which the block keeps anyway, and
whose output P the routing weights' product keeps; its backward routes again and recomputes the module on
the pairs it receives. So, on the most loaded rank (λ, ``moe.rank_load_factor``)::

    kept      X − P                       the block keeps this much less (its saved activations without
                                          recompute, its recompute workspace with it)
    backward  2·P + λ·(2·P + X + D)       the op's backward, beside the block's activations: the output
                                          gradient sorted and the tokens gathered (sent), the tokens and
                                          the gradient received, the module's recomputed activations and
                                          its backward's largest op

and each group's shard is an FSDP2 unit of its own, unsharded into the gathered dtype while it runs (over
one rank too: FSDP2 casts it into its all-gather buffer), ``params`` = Ψ_e / ep per block.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from autoshard.cost import comm, moe
from autoshard.cost.memory import module_bytes
from autoshard.cost.tables import CostTables
from autoshard.ir.decisions import Decisions, Mesh
from autoshard.ir.graph import OpGraph
from autoshard.ir.topology import Cluster, LinkSpec

A2A_PER_MICROBATCH = 5  # forward dispatch + combine; backward re-dispatch, gradient out, gradient back
COUNT_EXCHANGES_PER_MICROBATCH = 2  # the per-expert counts before the forward's and the backward's dispatch
# Ops the dispatch runs besides the experts module's own, counted from runtime/expert_parallel.py: forward 22
# (flatten, argsort, bincount, the counts' exchange and sums to lists, the received ids (arange, repeat,
# repeat_interleave), each pair's token, the gather, the token exchange and its buffers, the weight-1 ids,
# the exchange back, the un-sort), backward 20 (the routing and gather again, the gradient's gather and
# two exchanges, index_add, the parameters' scaling); their mean each way.
DISPATCH_OPS = 21


@dataclass(frozen=True)
class ExpertUnitCost:
    """One unit's expert-parallel additions per micro-batch (seconds) and its expert parameters."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    recompute_s: float = 0.0
    all_to_all_s: float = 0.0
    host_s: float = 0.0  # the dispatch's own ops and the module's recomputed ones (module doc)
    params: int = 0  # the unit's expert parameters, all E experts (a rank holds 1/ep of them)


def _module_op_counts(graph: OpGraph) -> dict[str, int]:
    """Ops of each expert group's module in the graph (n_e); once per graph."""
    return graph.derived("expert-module-ops", lambda: _count_module_ops(graph))


def _count_module_ops(graph: OpGraph) -> dict[str, int]:
    paths = {g.path for g in graph.experts}
    counts: dict[str, int] = {}
    for node in graph.nodes:
        parts = node.module_path.split(".")
        owner = next((p for p in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if p in paths), None)
        if owner is not None:
            counts[owner] = counts.get(owner, 0) + 1
    return counts


def expert_params(graph: OpGraph) -> int:
    """Ψ_E: the parameters of every expert group."""
    return sum(g.param_count for g in graph.experts)


def unit_expert_costs(tables: CostTables, config: Decisions) -> tuple[ExpertUnitCost, ...]:
    """Per unit, what ep > 1 adds to one micro-batch (module doc); nothing at ep = 1."""
    graph = tables.graph
    units = len(graph.blocks) + 2
    if config.ep == 1 or not graph.experts:
        return tables.memo(("expert-units", 1), lambda: (ExpertUnitCost(),) * units)
    return tables.memo(
        ("expert-units", config.ep, config.microbatch_size, config.mesh),
        lambda: _unit_expert_costs(tables, config, units),
    )


def _unit_expert_costs(tables: CostTables, config: Decisions, units: int) -> tuple[ExpertUnitCost, ...]:
    graph, device = tables.graph, tables.cluster.device
    scale = config.microbatch_size / graph.batch_size
    flops_per_s = device.peak_tflops * 1e12 * device.matmul_efficiency
    elem_bytes = tables.precision.activation_bytes
    link = ep_link(tables.cluster, config.mesh, config.ep)
    index = {b.path: i + 1 for i, b in enumerate(graph.blocks)}
    module_ops = _module_op_counts(graph)
    host_op_s = tables.cluster.host.op_forward_us * 1e-6
    parts = [[0.0, 0.0, 0.0, 0.0, 0.0, 0] for _ in range(units)]
    for g in graph.experts:
        tokens = g.pairs * scale / g.top_k
        load = moe.rank_load_factor(tokens, g.top_k, g.experts, config.ep)
        fwd_s = g.flops_fwd * scale / flops_per_s
        a2a_s = moe.moe_layer_a2a_s(round(tokens), g.hidden, g.top_k, elem_bytes, config.ep, g.experts, link)
        row = parts[index.get(g.block, units - 1 if g.block else 0)]
        row[0] += (load - 1) * fwd_s
        row[1] += (load - 1) * 2 * fwd_s
        row[2] += load * fwd_s
        row[3] += a2a_s / 2 * A2A_PER_MICROBATCH + COUNT_EXCHANGES_PER_MICROBATCH * comm.all_to_all_s(
            0, config.ep, link
        )
        row[4] += (2 * DISPATCH_OPS + module_ops.get(g.path, 0)) * host_op_s
        row[5] += g.param_count
    return tuple(ExpertUnitCost(*row) for row in parts)


@functools.lru_cache(maxsize=256)
def ep_link(cluster: Cluster, mesh: Mesh, ep: int) -> LinkSpec:
    """The link of rank 0's ep group: ep adjacent dp ranks, ranks 0, tp, .., (ep − 1)·tp."""
    return cluster.group_link([d * mesh.tp for d in range(ep)])


def expert_state_params(params_on_rank: int, experts_on_rank: int, config: Decisions) -> tuple[int, int]:
    """(dense parameters, expert parameters) a rank holds, from its parameters with every expert whole:
    the expert groups' share is cut to 1/ep (module doc)."""
    dense = params_on_rank - experts_on_rank
    return dense, experts_on_rank // config.ep


@dataclass(frozen=True)
class DispatchMemory:
    """One block's expert groups under ep > 1, one micro-batch (bytes; module doc, "Memory of the dispatch")."""

    kept: int = 0  # what the captured module keeps for backward that the dispatch op does not (X − P)
    backward: int = 0  # what the op's backward holds at once (2·P + λ·(2·P + X + D))
    params: int = 0  # the block's expert parameters on the rank (Ψ_e / ep)


def dispatch_memory(tables: CostTables, config: Decisions, captured_bytes: int = 4) -> tuple[DispatchMemory, ...]:
    """Per block (``graph.blocks`` order), what the dispatch op changes in its memory (module doc); all zero at
    ep = 1, where the module runs as captured."""
    graph = tables.graph
    if config.ep == 1 or not graph.experts:
        return (DispatchMemory(),) * len(graph.blocks)
    scale = config.microbatch_size / graph.batch_size
    ratio = tables.precision.activation_bytes / captured_bytes
    share = tables.rank_share(config)
    out = []
    for block in graph.blocks:
        kept = backward = params = 0
        for g in (g for g in graph.experts if g.block == block.path):
            saved, grads = (int(b * scale) for b in module_bytes(graph, g.path, ratio, share))
            pairs = int(g.pairs * scale * g.hidden * tables.precision.activation_bytes)
            load = moe.rank_load_factor(g.pairs * scale / g.top_k, g.top_k, g.experts, config.ep)
            kept += max(0, saved - pairs)
            backward = max(backward, int(2 * pairs + load * (2 * pairs + saved + grads)))
            params += g.param_count // config.ep
        out.append(DispatchMemory(kept, backward, params))
    return tuple(out)


def a2a_microbatch_s(costs: tuple[ExpertUnitCost, ...], units: list[int] | None = None) -> float:
    """The all-to-all seconds of one micro-batch over ``units`` (all by default)."""
    chosen = range(len(costs)) if units is None else units
    return sum(costs[u].all_to_all_s for u in chosen)
