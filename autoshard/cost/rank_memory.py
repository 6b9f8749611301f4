"""Memory per rank at its peak: model state by ZeRO stage, activations in flight, transients.

``memory_spmd`` / ``memory_pipeline``: model state by ZeRO stage over dp
(``memory.model_state_bytes``) of the rank's parameters (TP: sharded modules' weights / tp;
PP: its stages'); activations of one micro-batch times the micro-batches in flight
(``in_flight``): 1 without pipelining; GPipe m; 1F1B min(m, p − r) on rank r; interleaved
min(m, p − r + (p−1)/v) (Korthikanti et al.: p·(1 + (p−1)/(p·v)) on the first rank). With TP
a block keeps (10 + 24/t)/34 of its unsharded activations (Korthikanti et al., TP without
sequence parallelism), about 1/t with it (``CostTables.activation_keep``); full recompute keeps the unsharded block inputs. FSDP adds transients:
without pipelining ZeRO-3 holds the unit in use and the prefetched one unsharded, and one
unit's gradients (ZeRO-2: those only); on a pipeline stage the gradients (and ZeRO-3's gathered
weights) stay unsharded all step. The caching allocator's fragmentation adds ALLOCATOR_SLACK.
"""

from __future__ import annotations

from autoshard.cost.memory import Precision, model_state_bytes
from autoshard.cost.tables import CostTables
from autoshard.ir.decisions import Decisions
from autoshard.ir.plan import Memory

ALLOCATOR_SLACK = 0.05  # caching-allocator fragmentation, a few % in practice (torch.cuda.memory_stats)


def in_flight(schedule: str, m: int, pp: int, v: int, pp_rank: int) -> float:
    """Micro-batches whose activations rank ``pp_rank`` holds at its peak (module doc)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved-1f1b":
        return min(float(m), pp - pp_rank + (pp - 1) / v)
    return float(min(m, pp - pp_rank))


def memory_spmd(tables: CostTables, config: Decisions, local_params: int, expert_params: int = 0) -> Memory:
    """``local_params`` sharded by ZeRO over dp (HSDP: a node's shard), ``expert_params`` (ep > 1: the
    rank's expert shards) over the dp / ep ranks holding the same ones."""
    precision = tables.precision
    p, g, o = model_state_bytes(local_params, config.zero_stage, config.dp_shard, precision)  # HSDP: a node's shard
    if expert_params:
        pe, ge, oe = model_state_bytes(expert_params, config.zero_stage, config.expert_dp, precision)
        p, g, o = p + pe, g + ge, o + oe
    units = tables.config_units(config)
    keep = tables.activation_keep(config)
    modes = config.block_modes(len(units.saved_bytes) - 2)
    blocks_kept = sum(saved * (1.0 if mode == "full" else keep) for saved, mode in zip(units.saved_bytes[1:-1], modes))
    acts = blocks_kept + units.saved_bytes[0] + units.saved_bytes[-1] + max(units.workspace_bytes) * keep
    return Memory.from_parts(ALLOCATOR_SLACK, params_bytes=p, grads_bytes=g, optimizer_bytes=o,
                             activations_bytes=int(acts), transient_bytes=transient_bytes(tables, config))


def transient_bytes(tables: CostTables, config: Decisions) -> int:
    """ZeRO-3: the unit being used and the one prefetched, unsharded, and one unit's gradients."""
    precision = tables.precision
    unit = fsdp_unit_params(tables, config) * precision.param_bytes
    if config.zero_stage == 3 and config.mesh.dp > 1:
        return 2 * unit + unit * precision.grad_bytes // precision.param_bytes
    if config.zero_stage == 2 and config.mesh.dp > 1:
        return unit * precision.grad_bytes // precision.param_bytes
    return 0


def fsdp_unit_params(tables: CostTables, config: Decisions) -> int:
    """Largest FSDP unit (a block) per rank: its weights, TP-sharded where the plan shards them."""
    graph = tables.graph
    if config.mesh.tp > 1:
        return tables.layout_cost(config).largest_block_params
    return max((b.param_count for b in graph.blocks), default=graph.param_count)


def memory_pipeline(precision: Precision, config: Decisions, params: int, activations: float,
                    expert_params: int = 0) -> Memory:
    """``params`` sharded by the stage's ZeRO over dp; ``expert_params`` (ep = dp: the rank's expert shards,
    which no other rank holds) whole."""
    p, g, o = model_state_bytes(params, pipeline_zero(config), config.mesh.dp, precision)
    p, g, o = p + expert_params * precision.param_bytes, g + expert_params * precision.grad_bytes, \
        o + expert_params * precision.optimizer_bytes
    return Memory.from_parts(ALLOCATOR_SLACK, params_bytes=p, grads_bytes=g, optimizer_bytes=o,
                             activations_bytes=int(activations),
                             transient_bytes=int(pipeline_transient_per_param(precision, config) * params))


def pipeline_transient_per_param(precision: Precision, config: Decisions) -> float:
    """FSDP on a stage keeps the gradients (and ZeRO-3's gathered weights) unsharded all step; ZeRO-1's
    state is ZeRO-2's there (the same program: ``ir.decisions.DPRuntime``), so both are priced as ZeRO-2."""
    dp = config.mesh.dp
    if dp == 1 or config.zero_stage < 1:
        return 0.0
    spread = 1 - 1 / dp
    return precision.grad_bytes * spread + (precision.param_bytes * spread if config.zero_stage == 3 else 0.0)


def pipeline_zero(config: Decisions) -> int:
    """The ZeRO stage whose state a pipeline stage holds: 1 holds 2's (FSDP2, sharded after the step)."""
    return 2 if config.zero_stage == 1 and config.mesh.dp > 1 else config.zero_stage


def state_bytes_per_param(precision: Precision, config: Decisions) -> float:
    """Weights, gradients, optimizer state and FSDP transients per parameter of a stage."""
    dp = config.mesh.dp
    p, g, o = precision.param_bytes, precision.grad_bytes, precision.optimizer_bytes
    z = pipeline_zero(config)
    state = p / (dp if z >= 3 else 1) + g / (dp if z >= 2 else 1) + o / (dp if z >= 1 else 1)
    return state + pipeline_transient_per_param(precision, config)
