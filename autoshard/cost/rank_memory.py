"""Memory per rank at its peak: model state by ZeRO stage, activations in flight, transients.

``memory_spmd``: model state by ZeRO stage over dp (``memory.model_state_bytes``; FSDP2's
``rank_state_bytes``; none on the device under host offload, ``cost.offload``) of the rank's parameters (TP:
sharded modules' weights / tp), one micro-batch's
activations, and the largest of the step's moments (``spmd_moments``). With TP each op keeps what
``cost.saved`` says on the rank's shards' shapes (``CostTables.activation_units``).

``memory_pipeline``: each pp rank's own peak, the largest of its moments (``pipeline_moments``): its
stages' state as the stage's dp wrapper holds it, the micro-batches each of its stages holds as one of
its backwards begins, counted on the schedule's order (``schedule.backward_held``), the receive buffers
torch's stages keep, the last stage's loss; the plan's figure is the worst rank's, and each rank's is
written beside it (``Predicted.pp_rank_memory``, which ``autoshard dryrun`` compares with).
``in_flight`` (GPipe m; 1F1B min(m, p − r) on rank r; interleaved min(m, p − r + (p−1)/v),
Korthikanti et al.) prices the stage-cut search's memory constraint (``passes.planning.search``), with
``state_bytes_per_param``. The caching allocator's fragmentation adds ALLOCATOR_SLACK.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from autoshard.cost.context_parallel import with_ring_bytes
from autoshard.cost.experts import dispatch_memory
from autoshard.cost.memory import DTYPE_BYTES, Precision, model_state_bytes
from autoshard.cost.schedule import backward_held
from autoshard.cost.tables import CAPTURED_ELEM_BYTES, CostTables
from autoshard.ir.decisions import MIXED, PRECISIONS, Decisions
from autoshard.ir.plan import Memory

ALLOCATOR_SLACK = 0.05  # caching-allocator fragmentation, a few % in practice (torch.cuda.memory_stats)
# How far a predicted peak has been from a measured one: one H200 measured −0.1 to +7.7 % on five of six plans
# (benchmarks/reports/gpu-h200-2026-11-26; the sixth +26 %, over), the dry-run table within 5 % of its rows
# ("Dry run"). A plan with less room than this on its device is worth a dry run before a cluster job.
MEASURED_MEMORY_ERROR = 0.08


def in_flight(schedule: str, m: int, pp: int, v: int, pp_rank: int) -> float:
    """Micro-batches whose activations rank ``pp_rank`` holds at its peak (module doc)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved-1f1b":
        return min(float(m), pp - pp_rank + (pp - 1) / v)
    return float(min(m, pp - pp_rank))


def memory_spmd(
    tables: CostTables, config: Decisions, local_params: int, expert_params: int = 0, rings: tuple | None = None
) -> Memory:
    """``local_params`` sharded by ZeRO over dp (HSDP: a node's shard), ``expert_params`` (ep > 1: the
    rank's expert shards) over the dp / ep ranks holding the same ones; the largest of the step's
    moments (``spmd_moments``); ``rings``: a cp ring's cost per unit, whose buffers its backwards hold
    (``cost.context_parallel``, "Ring memory")."""
    p, g, o = rank_state_bytes(tables.precision, config, local_params, config.dp_shard)  # HSDP: a node's shard
    if config.offloaded:  # FSDP2's CPUOffloadPolicy: the shards live in host memory (``cost.offload``)
        p = g = o = 0
    pe = ge = oe = 0
    if expert_params:
        pe, ge, oe = rank_state_bytes(tables.precision, config, expert_params, config.expert_dp)
    moments = spmd_moments(tables, config, local_params, (p + pe, g + ge, o + oe), expert_params, ge, rings)
    worst = max(moments.values(), key=lambda parts: sum(parts.values()))
    return Memory.from_parts(ALLOCATOR_SLACK, **{key: int(value) for key, value in worst.items()})


def rank_state_bytes(precision: Precision, config: Decisions, params: int, shards: int) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes of ``params`` on a rank after the optimizer step, sharded
    over ``shards`` ranks: ``memory.model_state_bytes`` by ZeRO stage, but FSDP2's ``fully_shard`` (ZeRO-1
    beside tp or pp, ZeRO-2, ZeRO-3) holds every parameter as its dp shard at every stage (p·Ψ/N_d: what
    ZeRO-1 and 2 keep gathered between forward and backward is the bf16 copy, ``spmd_moments``' K), and
    its ZeRO-1 reduce-scatters the summed gradients once, on the last micro-batch: g·Ψ/N_d after it."""
    p, g, o = model_state_bytes(params, config.zero_stage, shards, precision)
    if shards > 1 and config.dp_runtime.wrapper == "fully_shard":
        p, g = params * precision.param_bytes // shards, params * precision.grad_bytes // shards
    return p, g, o


def accumulated_grad_bytes(precision: Precision, config: Decisions, params: int, grads_bytes: int) -> int:
    """G_a: the gradients a rank holds between micro-batches: the synchronised ones (``grads_bytes``), or
    summed whole where the runtime reduces them only on the last micro-batch (DDP, replicate and FSDP2's
    ZeRO-1, which sums them in its reduce dtype, fp32: ``ir.decisions.PRECISIONS``); none with one
    micro-batch."""
    if config.num_microbatches == 1:
        return 0
    if config.mesh.dp > 1 and not config.dp_runtime.sync_every_microbatch:
        return params * max(precision.grad_bytes, REDUCE_BYTES if config.dp_runtime.fsdp2 else 0)
    return grads_bytes


def spmd_moments(
    tables: CostTables,
    config: Decisions,
    local_params: int,
    state: tuple[int, int, int],
    expert_params: int = 0,
    expert_grads_bytes: int = 0,
    rings: tuple | None = None,
) -> dict[str, dict[str, float]]:
    """A rank's memory by part at each moment of an SPMD step that can be its peak (without pipelining
    one micro-batch is in flight; the last micro-batch's moments are the largest). With W, G, O the
    state after the step (``rank_state_bytes``), S_u unit u's saved activations, L the loss's backward
    workspace, R_k block k's recompute workspace and T_k its backward's activation gradients (with a cp ring's
    buffers: ``context_parallel.with_ring_bytes``), all on one TP rank's shapes (``CostTables.activation_units``), p_c the
    bytes of a gathered parameter (the policy's param dtype: bf16 under FSDP2's mixed precision), Ψ_u a
    unit's parameters on the rank, G_a the gradients summed over the earlier micro-batches
    (``accumulated_grad_bytes``) and K = p_c·Ψ the weights FSDP2 keeps gathered from forward to backward (ZeRO-1 beside tp,
    ZeRO-2, replicate; 0 under ZeRO-3, whose units, the root too, reshard after forward)::

        loss       W + K + G_a + O + Σ_u S_u + L                  the loss's two fp32 gradients
        backward   W + K + G_a + O + Σ_{u ≤ L} S_u + max_k (R_k) + max_k (T_k)    a block's backward (the
                   last block's, with a recompute workspace as large as any block's); ZeRO-3 adds
                   + p_c·(Ψ_root + 2·Ψ_block) gathered            (the root, the block, the next prefetched)
                   + p_c·(Ψ_head + Ψ_block) unsharded gradients   (the head's, the block's: bf16 until reduced)
        reduce     W + K + G + O + p_c·Ψ_root (ZeRO-3) + p_c·Ψ_root + 4·Ψ_root    the root's gradients
                   reduced last: unsharded, and their fp32 copy that FSDP2 reduce-scatters
        optimizer  W + G + O + 4·Ψ_opt                            foreach AdamW's sqrt(v) (eager kernels)

    Expert shards (ep > 1: ``expert_params`` of the rank's, whole where ep = dp) stay outside the FSDP units
    (``runtime.parallel``'s experts apart): units of their own over the ranks holding them, a block's gathered
    beside it (Ψ_block: the dense ones, ``fsdp_unit_params``, and its expert shards where dp / ep > 1: over one
    rank FSDP2 gathers nothing), and
    with one micro-batch a block's backward holds the expert shards' gradients G_E (``expert_grads_bytes``),
    made whole as each layer's backward ends, in place of G_a: less the last block's, made after its largest
    moment. Each block's expert groups run as the dispatch op (``cost.experts.dispatch_memory``): what the
    captured module keeps leaves the block's saved activations or recompute workspace, the op's backward (the
    module recomputed, the exchanged tokens and gradients) is a candidate for T_k, and over one rank FSDP2
    still casts the running block's expert unit into its all-gather buffer (weights).

    Parts: weights = W + the gathered ones, grads = G_a (or G) + the unsharded gradients, activations =
    the saved ones and a recomputed block's, transient = the loss's workspace, the activation gradients
    and the reduce-scatter copy (``autoshard.dryrun`` maps the tracker's parts alike)."""
    p, g, o = state
    units = with_ring_bytes(tables.activation_units(config), rings)  # a TP rank's shapes (cost.saved.RankShare)
    dispatch = dispatch_memory(tables, config, CAPTURED_ELEM_BYTES) if expert_params else ()
    if dispatch:
        units = _with_dispatch(units, config, dispatch)
    saved = units.saved_bytes[0] + sum(units.saved_bytes[1:-1])
    gathered = gathered_param_bytes(tables)
    sharded_experts = expert_params if config.expert_dp > 1 else 0  # gathered with its block, below
    kept = gathered * (local_params + sharded_experts) if keeps_gathered(config) else 0
    held = accumulated_grad_bytes(tables.precision, config, local_params + expert_params, g)
    fsdp = config.mesh.dp > 1 and config.dp_runtime.fsdp2
    block = fsdp_unit_params(tables, config) if units.blocks else 0
    if sharded_experts and units.blocks:  # a block's expert shards: a unit of their own, gathered with it
        block += max(block_expert_params(tables.graph, b.path) for b in tables.graph.blocks) // config.ep
    root = max(0, local_params + sharded_experts - block * units.blocks)
    head = root * units.params[-1] / max(1, units.params[0] + units.params[-1])
    z3 = fsdp and config.zero_stage == 3
    # over one rank FSDP2 still unshards an expert unit into its all-gather buffer, cast: the running block's
    running_experts = gathered * max((d.params for d in dispatch), default=0) if fsdp and not sharded_experts else 0
    # the last block's expert gradients are made as its dispatch's backward ends, after its largest moment
    block_expert_grads = (
        expert_grads_bytes * dispatch[0].params // max(1, sum(d.params for d in dispatch)) if dispatch else 0
    )
    moments = {
        "loss": dict(
            params_bytes=p + kept,
            grads_bytes=held,
            optimizer_bytes=o,
            activations_bytes=saved + units.saved_bytes[-1],
            transient_bytes=units.workspace_bytes[-1],
        ),
        "optimizer": dict(
            params_bytes=p,
            grads_bytes=g,
            optimizer_bytes=o + optimizer_step_bytes(tables, config, o),
            activations_bytes=0,
            transient_bytes=0,
        ),
    }
    if units.blocks:
        moments["backward"] = dict(
            params_bytes=p + kept + (gathered * (root + 2 * block) if z3 else 0) + running_experts,
            grads_bytes=(held or expert_grads_bytes - block_expert_grads) + (gathered * (head + block) if fsdp else 0),
            optimizer_bytes=o,
            activations_bytes=saved + max(units.workspace_bytes[1:-1]),
            transient_bytes=max(units.backward_bytes[1:-1]) if units.backward_bytes else 0,
        )
    if fsdp:
        moments["reduce"] = dict(
            params_bytes=p + kept + (gathered * root if z3 else 0),
            grads_bytes=g + gathered * root,
            optimizer_bytes=o,
            activations_bytes=units.saved_bytes[0],
            transient_bytes=REDUCE_BYTES * root,
        )
    return moments


def _with_dispatch(units, config: Decisions, dispatch: tuple) -> object:
    """``units`` with each block's expert groups as the dispatch op runs them (``cost.experts.dispatch_memory``):
    what the captured module keeps, less its output, leaves the block's saved activations (no recompute) or its
    recompute workspace (the op keeps none of it in either); the op's backward, beside the block's input
    gradient, is a candidate for the block's largest backward moment."""
    modes = config.recompute_blocks if config.recompute == MIXED else (config.recompute,) * len(dispatch)
    saved, workspace = list(units.saved_bytes), list(units.workspace_bytes)
    backward = list(units.backward_bytes) if units.backward_bytes else [0] * len(saved)
    for k, (d, mode) in enumerate(zip(dispatch, modes), start=1):
        if mode == "none":
            saved[k] = max(0, saved[k] - d.kept)
        else:
            workspace[k] = max(0, workspace[k] - d.kept)
        backward[k] = max(backward[k], units.boundary_bytes[k - 1] + d.backward)
    return replace(units, saved_bytes=tuple(saved), workspace_bytes=tuple(workspace), backward_bytes=tuple(backward))


REDUCE_BYTES = 4  # FSDP2 reduce-scatters gradients in the policy's reduce dtype, fp32 (ir.decisions.PRECISIONS)


def gathered_param_bytes(tables: CostTables) -> int:
    """Bytes of a parameter as FSDP2 gathers it: the mixed-precision policy's param dtype (bf16 under
    "bf16-autocast"), else the parameter's own."""
    policy = PRECISIONS.get(tables.precision.name)  # the precision the tables price (a search's own)
    return DTYPE_BYTES[policy.param_dtype] if policy and policy.param_dtype else tables.precision.param_bytes


def keeps_gathered(config: Decisions) -> bool:
    """FSDP2 wrappers that keep every unit's weights gathered from forward to its backward: those that do
    not reshard after forward (ZeRO-1 beside tp, ZeRO-2, replicate), over more than one rank."""
    runtime = config.dp_runtime
    return config.mesh.dp > 1 and runtime.fsdp2 and not runtime.reshard_after_forward


def optimizer_step_bytes(tables: CostTables, config: Decisions, optimizer_bytes: int) -> int:
    """torch's foreach AdamW (eager kernels) makes sqrt(v) for every parameter it steps: one fp32 per
    element, half of m and v's bytes."""
    return optimizer_bytes // 2 if tables.runtime.kernels == "eager" else 0


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
    """Largest FSDP unit (a block) per rank: its weights, TP-sharded where the plan shards them; with ep > 1
    less its expert groups, which the runtime keeps out of the units (``runtime.parallel``)."""
    graph = tables.graph
    if config.mesh.tp > 1:
        return tables.layout_cost(config).largest_block_params
    if config.ep > 1:
        return max((b.param_count - block_expert_params(graph, b.path) for b in graph.blocks), default=0)
    return max((b.param_count for b in graph.blocks), default=graph.param_count)


def block_expert_params(graph, block_path: str) -> int:
    """Parameters of the expert groups inside the block at ``block_path`` (all experts)."""
    return sum(g.param_count for g in graph.experts if g.path.startswith(block_path + "."))


@dataclass(frozen=True)
class StageLoad:
    """What one pipeline stage puts on its rank, for ``pipeline_moments`` (bytes; parameters on one TP rank)."""

    index: int
    params: int  # its dense parameters, which the stage's dp wrapper shards
    expert_params: int = 0  # its expert shards (ep = dp: no other rank holds them; left out of the dp wrapper)
    saved_bytes: int = 0  # one micro-batch's saved activations and the output the schedule keeps for backward
    workspace_bytes: int = 0  # a recomputed block's workspace (the largest of its blocks')
    backward_bytes: int = 0  # a block's backward's activation gradients (the largest)
    loss_bytes: int = 0  # the loss's backward workspace (the last stage)
    buffer_bytes: int = 0  # its receive buffers of one micro-batch: inputs (but the first) and output gradients
    weight_grad_bytes: int = 0  # a split backward's: one micro-batch's gradients kept from its I to its W


def memory_pipeline(tables: CostTables, config: Decisions, pp_rank: int, stages: list[StageLoad]) -> Memory:
    """The largest of ``pipeline_moments`` of pp rank ``pp_rank`` holding ``stages``."""
    moments = (parts for _, parts in _pipeline_moments(tables, config, pp_rank, stages))
    worst = max(moments, key=lambda parts: sum(parts.values()))
    return Memory.from_parts(ALLOCATOR_SLACK, **{key: int(value) for key, value in worst.items()})


def pipeline_moments(
    tables: CostTables, config: Decisions, pp_rank: int, stages: list[StageLoad]
) -> dict[str, dict[str, float]]:
    """A pipeline rank's memory by part at each moment of its step that can be its peak: a backward of each of
    its stages, with the micro-batches the schedule holds then (``schedule.backward_held``), and the
    optimizer step. With W, G, O the state of its stages after the step (``rank_state_bytes`` of the dense
    parameters over dp, the expert shards whole), K the bf16 weights FSDP2 keeps gathered (``keeps_gathered``),
    G_a the gradients summed whole over micro-batches (``pipeline_accumulated_grad_bytes``), h_s(t) the
    micro-batches stage s holds, A_s one's saved activations and kept output, w_s(t) the micro-batches whose
    backward stage s has split and whose weight pass is still to run, D_s one's gradients kept for it
    (``cost.saved.weight_grad_inputs``; a backward of s is its B, I or W), B the receive buffers, m per
    stage boundary (torch's stages make one per micro-batch, in the traced dtype, and keep them)::

        backward of s    W + K + O + G_a + Σ_s' (h_s'(t)·A_s' + w_s'(t)·D_s') + B + R_s + max(T_s, L_s)
                         (ZeRO-3: + p_c·Ψ_s, the stage gathered for its backward)
        optimizer        W + G + O + 4·Ψ_opt + B        foreach AdamW's sqrt(v) (eager kernels)

    R_s, T_s a block's recompute workspace and activation gradients, L_s the loss's two fp32 gradients (the
    last stage). Parts as ``spmd_moments``' (``autoshard.dryrun`` maps the tracker's alike; the tracker files
    G_a, which FSDP2 sums in fp32 outside the parameters' .grad, under temporaries)."""
    return {
        moment if isinstance(moment, str) else f"backward {moment[0]} {moment[1]}": parts
        for moment, parts in _pipeline_moments(tables, config, pp_rank, stages)
    }


def _pipeline_moments(
    tables: CostTables, config: Decisions, pp_rank: int, stages: list[StageLoad]
) -> Iterator[tuple[str | tuple[int, tuple[int, ...]], dict[str, float]]]:
    """``pipeline_moments`` in order, each named "optimizer" or by (stage, held counts): the search takes only the
    largest, so it formats no names."""
    precision, dp = tables.precision, config.dp_shard
    dense = sum(s.params for s in stages)
    experts = sum(s.expert_params for s in stages)
    p, g, o = rank_state_bytes(precision, config, dense, dp)
    if experts:
        pe, ge, oe = rank_state_bytes(precision, config, experts, config.expert_dp)
        p, g, o = p + pe, g + ge, o + oe
    gathered = gathered_param_bytes(tables)
    kept = gathered * dense if keeps_gathered(config) else 0
    z3 = config.mesh.dp > 1 and config.dp_runtime.fsdp2 and config.dp_runtime.reshard_after_forward
    held = pipeline_accumulated_grad_bytes(precision, config, dense, experts)
    m = config.num_microbatches
    buffers = m * sum(s.buffer_bytes for s in stages)
    order, held_at = backward_held(config.schedule, config.mesh.pp, m, config.virtual_stages, pp_rank)
    by_index = {s.index: s for s in stages}
    yield (
        "optimizer",
        dict(
            params_bytes=p,
            grads_bytes=g,
            optimizer_bytes=o + optimizer_step_bytes(tables, config, o),
            activations_bytes=buffers,
            transient_bytes=0,
        ),
    )
    for stage in stages:
        for counts in held_at.get(stage.index, ()):
            held_counts, pending_counts = counts[: len(order)], counts[len(order) :]
            acts = sum(c * by_index[s].saved_bytes for s, c in zip(order, held_counts) if s in by_index)
            acts += sum(c * by_index[s].weight_grad_bytes for s, c in zip(order, pending_counts) if s in by_index)
            yield (
                (stage.index, counts),
                dict(
                    params_bytes=p + kept + (gathered * stage.params if z3 else 0),
                    grads_bytes=held,
                    optimizer_bytes=o,
                    activations_bytes=acts + buffers + stage.workspace_bytes,
                    transient_bytes=max(stage.backward_bytes, stage.loss_bytes),
                ),
            )


def pipeline_accumulated_grad_bytes(precision: Precision, config: Decisions, dense: int, experts: int) -> int:
    """G_a on a pipeline rank: the schedule sums each stage's gradients whole until the last micro-batch whatever
    the dp wrapper (``ir.decisions.DPRuntime``); FSDP2 sums the dense ones in its reduce dtype (fp32), the
    expert shards (outside the wrapper) and a plain module's in their own; none with one micro-batch."""
    if config.num_microbatches == 1:
        return 0
    wrapped = config.mesh.dp > 1 and config.dp_runtime.fsdp2
    return dense * max(precision.grad_bytes, REDUCE_BYTES if wrapped else 0) + experts * precision.grad_bytes


def pipeline_transient_per_param(precision: Precision, config: Decisions) -> float:
    """FSDP on a stage keeps the gradients (and ZeRO-3's gathered weights) unsharded all step; ZeRO-1's
    state is ZeRO-2's there (the same program: ``ir.decisions.DPRuntime``), so both are priced as ZeRO-2."""
    dp = config.mesh.dp
    if dp == 1 or config.zero_stage < 1:
        return 0.0
    spread = 1 - 1 / dp
    return precision.grad_bytes * spread + (precision.param_bytes * spread if config.zero_stage == 3 else 0.0)


def megatron_pipeline_memory(
    precision: Precision, config: Decisions, params: int, activations: float, expert_params: int = 0
) -> Memory:
    """A pipeline rank as Megatron-LM runs it (``Runtime.named("megatron-lm")``, the published rows it is priced
    against): its own mixed-precision state (``memory.MEGATRON_MIXED``, p + g + o bytes per parameter, its
    optimizer, no FSDP2 holding a gathered copy or fp32 sums), and ``activations``: the in-flight micro-batches'
    saved bytes plus a block's workspace (its receive buffers are freed as the stage consumes them). Not the
    moments of ``pipeline_moments``, which are what torch's pipelining stages and FSDP2 hold in autoshard's
    programs (measured by ``autoshard dryrun``)."""
    p, g, o = model_state_bytes(params, pipeline_zero(config), config.mesh.dp, precision)
    p, g, o = (
        p + expert_params * precision.param_bytes,
        g + expert_params * precision.grad_bytes,
        o + expert_params * precision.optimizer_bytes,
    )
    return Memory.from_parts(
        ALLOCATOR_SLACK,
        params_bytes=p,
        grads_bytes=g,
        optimizer_bytes=o,
        activations_bytes=int(activations),
        transient_bytes=0,
    )


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
