"""Lowering: a plan -> the ordered apply steps that parallelize its model (``ir.steps``).

The one place that orders the decisions. ``runtime.parallel.apply_steps`` executes the list and
``passes.lowering.codegen`` prints it, so the Python API and every emitted program do the same calls in
the same order. The order, and why:

    SPMD plans (pp = 1)                      pipeline plans (pp > 1)
    0 cast_params     bf16-pure on fp32 parameters only: the meta model in bf16, first, both kinds
      use_cp_attention  cp plans: transformers attention that builds no mask (head-tail tokens), both kinds
      apply_float8    float8 plans: the linears of layout.float8_linears made torchao Float8Linear
    1 apply_tp        tensor parallelism     1 apply_tp        local shards, before the split
                      (float8 tensorwise: torchao's float8 styles)
    2 apply_ep        expert shards          2 apply_ep        expert shards, before the split
    3 apply_ac        recompute per block    3 split_pipeline  this rank's stages
      apply_compile   each block compiled      apply_float8    float8 plans: each stage's linears (after the split)
    4 sync_batch_norm over dp                4 apply_ac        recompute inside the stages
    5 apply_fsdp | apply_replicate           5 apply_fsdp | apply_replicate   on each stage module (dp·cp > 1)
      (ir.decisions.DP_RUNTIMES; offload: CPUOffloadPolicy on every unit)
    6 init_weights    this rank's shards     6 init_weights    this rank's shards
      (offload: FSDP2's shards made in host memory, buffers on the device)
    7 apply_ddp       (DP_RUNTIMES)          7 build_optimizer one per stage
    8 build_optimizer                        8 build_schedule
      (float8 tensorwise under FSDP2: the weights' float8 scales computed after each optimizer step)

float8 conversion comes before everything that wraps the linears (torchtitan converts the model before it
parallelizes it; a pipeline's split traces the bf16 model, so there each stage's linears are converted right after
the split, ``runtime.float8``): FSDP2 then gathers the float8 weights' tensor subclass, and each block compiled or checkpointed
holds Float8Linear modules. TP comes first among the parallel steps because it replaces parameters with DTensors (or local shards) that everything
after wraps; recompute wraps whole blocks, so it goes before FSDP wraps the same blocks as units
(torchtitan's order: TP, activation checkpointing, compile, FSDP: each block is compiled with its
recompute inside, and FSDP's hooks stay outside the compiled code); the optimizer is built last, over the
parameters the wrappers leave. In a pipeline the stages are traced from the sharded model, and
recompute and FSDP act on the traced stage modules, so they follow the split. Expert parallelism
keeps each rank's experts before anything wraps them (FSDP2 must see the local shards, and a
pipeline's trace must see the dispatch as one op), and the dp wrapper then syncs the expert shards
over the dp / ep ranks holding the same ones only. Every step before ``init_weights`` acts on the
meta device (the program builds the model there, ``runtime.build_meta_model``): only the shards
each rank keeps are ever made, by ``init_weights``; DDP broadcasts values and optimizers
hold them, so they follow it.

``layout`` lowers what the training loop reads rather than what it applies to the model (``ir.steps.Layout``):
the mesh (pp, dp, tp, and cp between dp and tp when the plan splits sequences, with dp x cp flattened into
the "dp_cp" the dp wrapper and the logged loss reduce over), the axis whose ranks take different samples
(dp), the axis whose ranks take different tokens of each sample (cp, or none) and the sequence length the
plan was made for.
"""

from __future__ import annotations

from autoshard.ir.decisions import FLOAT8_OFF, cp_load_balanced, precision_policy
from autoshard.ir.plan import Plan
from autoshard.ir.plan_format import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES
from autoshard.ir.steps import MESH_ORDER, WHOLE_MESH, Layout, Step


def lower(plan: Plan) -> tuple[Step, ...]:
    """The plan's apply steps, in the order the module docstring gives."""
    if plan.mesh.pp > 1:
        return tuple(_pipeline_steps(plan))
    return tuple(_spmd_steps(plan))


def layout(plan: Plan) -> Layout:
    """The plan's mesh and batch shares (module doc). A dim of one rank is kept (every step and the loop name
    pp, dp and tp), except cp, which exists only where the plan splits sequences. A pipeline's loop reads the
    mesh and the data axis only: its schedule averages the loss over the global batch itself, and its
    split_pipeline step carries the sequence axis (the stages cut the tokens themselves)."""
    mesh = plan.mesh
    sizes = {"pp": mesh.pp, "dp": mesh.dp, "cp": mesh.cp, "tp": mesh.tp}
    dims = tuple((name, sizes[name]) for name in MESH_ORDER if name != "cp" or mesh.cp > 1)
    flatten = (("dp_cp", ("dp", "cp")),) if mesh.cp > 1 else ()
    return Layout(
        mesh=dims,
        flatten=flatten,
        data_axis="dp",
        sequence_axis="cp" if mesh.cp > 1 else None,
        loss_axis=dp_axis(plan),
        tokens_per_sample=plan.model.get("tokens_per_sample", 1),
        seq_len=plan.model.get("seq_len"),
        loss_parallel=plan.decisions.loss_parallel,
    )


def recompute_modes(plan: Plan) -> dict[str, str]:
    """Each block's recompute mode; {} when no block recomputes. A mixed plan lists every block, those
    keeping their activations as "none"."""
    if plan.recompute == "mixed":
        return dict(plan.recompute_blocks)
    if plan.recompute == "none":
        return {}
    return {path: plan.recompute for path in plan.blocks}


def _cast_steps(plan: Plan) -> list[Step]:
    """bf16-pure on fp32 parameters: the meta model cast first (``init_weights`` then rounds one process's fp32
    initial weights into each shard)."""
    dtype = precision_policy(plan.precision).cast_dtype
    if dtype is None:
        return []
    return [
        Step(
            "cast_params",
            None,
            (("precision", plan.precision),),
            f"--precision {plan.precision}: parameters, gradients and optimizer state in {dtype}; each rank's "
            f"shards are one process's fp32 initial weights rounded to {dtype}",
        )
    ]


def _cp_attention_steps(plan: Plan) -> list[Step]:
    """cp plans: a transformers model's attention under a key that builds no mask (``runtime.context_parallel``)."""
    if plan.mesh.cp == 1:
        return []
    tokens = plan.model.get("tokens_per_sample", 1)
    how = (
        f"each cp rank holds a head-tail pair of chunks of every sample ({tokens} tokens in {2 * plan.mesh.cp} "
        f"chunks: rank r chunks r and {2 * plan.mesh.cp - 1} - r), so that causal attention's work is even"
        if cp_load_balanced(tokens, plan.mesh.cp)
        else f"each cp rank holds one contiguous chunk of every sample ({tokens} tokens are not a multiple of "
        f"{2 * plan.mesh.cp}, which head-tail chunks need)"
    )
    return [
        Step(
            "use_cp_attention",
            None,
            (),
            f"context parallel: {how}; a transformers model attends through SDPA without building a mask (its "
            "positions would read as packed sequences), a padding mask refused; no change to a model calling "
            "SDPA itself",
        )
    ]


def _float8_steps(plan: Plan) -> list[Step]:
    recipe = plan.decisions.float8
    if recipe == FLOAT8_OFF:
        return []
    gather = plan.decisions.float8_all_gather
    how = (
        "each stage's linear ops made torchao float8 matmuls after the split"
        if plan.mesh.pp > 1
        else "torchao's convert_to_float8_training"
    )
    return [
        Step(
            "apply_float8",
            None,
            (("float8", recipe), ("linears", tuple(plan.float8_linears)), ("fsdp_float8_all_gather", gather)),
            f"float8 training ({recipe} scaling, {how}) of the "
            f"{len(plan.float8_linears)} linears whose dims are divisible by 16, not the output projection: their "
            "matmuls in float8, each operand scaled and cast first"
            + ("; FSDP2 gathers their weights in float8" if gather else ""),
        )
    ]


def _spmd_steps(plan: Plan) -> list[Step]:
    steps = [
        *_cast_steps(plan),
        *_cp_attention_steps(plan),
        *_float8_steps(plan),
        *_tp_steps(plan, before_split=False),
        *_ep_steps(plan),
        *_recompute_steps(plan),
        *_compile_steps(plan),
    ]
    dp_step = _dp_step(plan, plan.blocks) if plan.mesh.dp_cp > 1 else None
    if dp_step is not None:
        steps.append(
            Step(
                "sync_batch_norm",
                dp_axis(plan),
                (),
                "BatchNorm statistics over every dp rank's samples, "
                "as one process sees them (no change without BatchNorm)",
            )
        )
    if dp_step is not None and dp_step.op != "apply_ddp":
        steps.append(dp_step)
    steps.append(_init_step())
    if dp_step is not None and dp_step.op == "apply_ddp":
        steps.append(dp_step)
    steps.append(_optimizer_step(plan))
    return steps


def _init_step() -> Step:
    return Step(
        "init_weights",
        WHOLE_MESH,
        (),
        "this rank's shards made on its device and filled with the initial "
        "weights one process draws from the same seed (the model file's initialisation replayed, "
        "runtime.init_replay); nothing whole is made",
    )


def _pipeline_steps(plan: Plan) -> list[Step]:
    stages = plan.mesh.pp * plan.virtual_stages
    placement = (("placement", "v"),) if plan.schedule in V_SCHEDULES else ()
    spec = layout(plan)
    sequence = (
        (("sequence_axis", spec.sequence_axis), ("tokens_per_sample", spec.tokens_per_sample))
        if spec.sequence_axis
        else ()
    )
    steps = [
        *_cast_steps(plan),
        *_cp_attention_steps(plan),
        *_tp_steps(plan, before_split=True),
        *_ep_steps(plan),
        Step(
            "split_pipeline",
            "*",
            (
                ("split_points", tuple(plan.split_points)),
                ("virtual_stages", plan.virtual_stages),
                ("tp_styles", dict(sorted(plan.tensor_parallel.items()))),
                *placement,
                *sequence,
            ),
            f"{stages} stages cut at the split points by tracing one micro-batch; {_stages_held(plan)} "
            f"and drops the rest of the model" + _SEQUENCE_WHY * bool(sequence),
        ),
        *_float8_steps(plan),
        *_recompute_steps(plan),
        *_compile_steps(plan),
    ]
    if plan.mesh.dp_cp > 1:
        steps.append(_dp_step(plan, ()))
    steps.append(_init_step())
    steps.append(_optimizer_step(plan))
    steps.append(
        Step(
            "build_schedule",
            None,
            (("schedule", plan.schedule), ("num_microbatches", plan.num_microbatches)),
            f"schedule {plan.schedule} over {plan.num_microbatches} micro-batches; gradients are their mean"
            + _SPLIT_BACKWARD_WHY * (plan.schedule in ZERO_BUBBLE_SCHEDULES),
        )
    )
    return steps


_SEQUENCE_WHY = (
    "; context parallel: traced on this cp rank's tokens of each sample (use_cp_attention says which), which every stage boundary "
    "carries, and each step runs the schedule with attention as a ring over the cp ranks"
)

_SPLIT_BACKWARD_WHY = (
    "; each backward is split into the inputs' gradient, sent on at once, and the weights', "
    "run later in slots the pipeline would idle"
)


def _stages_held(plan: Plan) -> str:
    """Which stages each pp rank keeps: r, r + pp, ... (looped), or r and 2·pp − 1 − r (a V)."""
    pp = plan.mesh.pp
    if plan.schedule in V_SCHEDULES:
        return (
            f"in a V, rank r keeps stages r and {2 * pp - 1} - r (rank 0 the first and the last, "
            f"rank {pp - 1} stages {pp - 1} and {pp})"
        )
    if plan.virtual_stages > 1:
        return f"rank r keeps stages r, r + {pp}, ... ({plan.virtual_stages} each)"
    return "rank r keeps stage r"


def _tp_steps(plan: Plan, before_split: bool) -> list[Step]:
    if not plan.tensor_parallel or plan.mesh.tp == 1:
        return []
    why = (
        f"tensor parallel over {plan.mesh.tp} ranks: column-parallel then row-parallel, styles chosen and "
        f"proven on the op graph"
    )
    if before_split:
        why += "; each rank keeps its shard and the collectives are custom ops, so the split traces them"
    float8 = () if before_split or plan.decisions.float8 != "tensorwise" else (("float8", plan.decisions.float8),)
    if float8:
        why += "; torchao's float8 styles on the float8 linears: inputs cast before they are gathered"
    return [
        Step(
            "apply_tp",
            "tp",
            (("styles", dict(sorted(plan.tensor_parallel.items()))), ("before_split", before_split), *float8),
            why,
        )
    ]


def _ep_steps(plan: Plan) -> list[Step]:
    if plan.ep == 1:
        return []
    where = "; local shards and the dispatch as one op, so the split traces it" if plan.mesh.pp > 1 else ""
    before_split = (("before_split", True),) if plan.mesh.pp > 1 else ()
    return [
        Step(
            "apply_ep",
            "dp",
            (("experts", tuple(plan.experts)), ("ep", plan.ep), *before_split),
            f"expert parallel over {plan.ep} adjacent dp ranks: each keeps 1/{plan.ep} of every expert group's "
            f"experts and sends each token to its experts' rank by all-to-all, and back{where}",
        )
    ]


def _ep_argument(plan: Plan) -> tuple:
    """The dp wrapper's ``ep`` argument: expert shards synchronised over the dp / ep ranks holding them."""
    return (("ep", plan.ep),) if plan.ep > 1 else ()


def _ep_why(plan: Plan) -> str:
    if plan.ep == 1:
        return ""
    return f"; each expert shard over the {plan.mesh.dp // plan.ep} dp rank(s) holding it"


_RECOMPUTE_WHY = {
    "full": "keep only each block's input; recompute the block in backward",
    "selective": "keep matmul and attention outputs; recompute the cheap ops",
    "alternate": "keep attention and every other weight matmul's output (torchtitan's op-level policy); recompute "
    "the rest",
    "mixed": "each block its own mode, the least recompute that fits (full: keep only the input; "
    "selective: keep matmul and attention outputs)",
}


def _recompute_steps(plan: Plan) -> list[Step]:
    modes = recompute_modes(plan)
    if not modes:
        return []
    where = " inside the pipeline stages" if plan.mesh.pp > 1 else ""
    return [
        Step(
            "apply_ac",
            None,
            (("modes", modes),),
            f"recompute ({plan.recompute}){where}: {_RECOMPUTE_WHY[plan.recompute]}",
        )
    ]


def _compile_steps(plan: Plan) -> list[Step]:
    if not plan.decisions.compile:
        return []
    outside = plan.mesh.pp > 1 or plan.mesh.cp > 1
    inside = "" if outside else " (with its recompute)"
    what = f"each block{inside}" if plan.blocks else "the model (it has no blocks)"
    recompute_outside = (("recompute_outside", True),) if plan.mesh.pp == 1 and plan.mesh.cp > 1 else ()
    async_tp = [
        Step(
            "apply_async_tp",
            "tp",
            (),
            "async TP: symmetric memory for the TP group and inductor's micro-pipeline TP pass, each sequence-"
            "parallel all-gather and reduce-scatter overlapped with its matmul in chunks",
        )
    ]
    return async_tp * plan.decisions.async_tp + [
        Step(
            "apply_compile",
            None,
            (("blocks", tuple(plan.blocks)), *recompute_outside),
            f"torch.compile {what}: inductor fuses the elementwise ops between the matmuls and attention into a "
            "few kernels; repeated blocks share one compiled graph"
            + _COMPILE_WHERE[(plan.mesh.pp > 1, plan.mesh.cp > 1)],
        )
    ]


_COMPILE_WHERE = {  # (pipeline stages, context parallelism): where the compiled code ends (runtime.compiled)
    (False, False): "",
    (False, True): "; the ring runs eager between compiled graphs, and a block's recompute eager around it",
    (True, False): "; each stage compiles the blocks it holds, its graph and a block's recompute eager around them",
    (True, True): "; each stage compiles the blocks it holds, its graph, a block's recompute and the ring eager "
    "around and between them",
}


def dp_axis(plan: Plan) -> str:
    """The mesh axis the dp wrapper and the optimizer reduce over: "dp", or with context parallelism the
    flattened "dp_cp" (each cp rank holds the same parameters and a share of the tokens: torchtitan's
    dp_shard_cp), which ``layout`` joins (``runtime.build_mesh`` flattens it)."""
    return "dp_cp" if plan.mesh.cp > 1 else "dp"


def dp_ranks(plan: Plan) -> str:
    """The ranks the dp wrapper reduces over, in words."""
    mesh = plan.mesh
    return f"{mesh.dp} dp ranks" if mesh.cp == 1 else f"{mesh.dp_cp} dp x cp ranks"


def _dp_step(plan: Plan, blocks: tuple[str, ...]) -> Step:
    """The dp axis's wrapper, by how the plan's ZeRO stage runs on its mesh (``ir.decisions.DP_RUNTIMES``)."""
    runtime = plan.decisions.dp_runtime
    if runtime.wrapper == "DistributedDataParallel":
        return _ddp_step(plan)
    if runtime.wrapper == "replicate":
        return _replicate_step(plan, blocks)
    return _fsdp_step(plan, blocks)


def _units(blocks: tuple[str, ...]) -> str:
    return "each block a unit, then the root" if blocks else "each stage module a unit"


def _dtypes(plan: Plan) -> str:
    policy = precision_policy(plan.precision)
    return f"; {policy.param_dtype} compute, {policy.reduce_dtype} gradient reduction" if policy.param_dtype else ""


def _fsdp_step(plan: Plan, blocks: tuple[str, ...]) -> Step:
    runtime = plan.decisions.dp_runtime
    reshard = runtime.reshard_after_forward
    what = (
        "weights, gradients and optimizer state; each unit gathered just before use"
        if reshard
        else "gradients and optimizer state; weights stay gathered from forward to backward"
    )
    arguments: tuple = (("blocks", tuple(blocks)), ("reshard_after_forward", reshard), ("precision", plan.precision))
    over = dp_ranks(plan)
    if plan.dp_replicate > 1:
        arguments += (("replicas", plan.dp_replicate),)
        over = (
            f"the {plan.mesh.dp // plan.dp_replicate} dp ranks of a node (HSDP: all-reduced across "
            f"{plan.dp_replicate} replicas)"
        )
    if plan.mesh.pp == 1 and not runtime.sync_every_microbatch:
        arguments += (("sync_every_microbatch", False),)
        what += (
            "; gradients summed whole over the micro-batches and reduce-scattered once, on the last "
            "(Megatron's distributed optimizer)"
        )
    elif plan.mesh.pp > 1:
        what += "; the schedule sums gradients whole and reduce-scatters them after the last micro-batch"
    if plan.decisions.offloaded:
        arguments += (("offload", True),)
        what += (
            "; the shards kept in host memory (CPUOffloadPolicy): copied to the device before each all-gather, "
            "gradients copied back after each reduce-scatter"
        )
    return Step(
        "apply_fsdp",
        dp_axis(plan),
        arguments + _ep_argument(plan),
        f"ZeRO-{plan.zero_stage}: FSDP2 over {over} shards {what} ({_units(blocks)}){_ep_why(plan)}{_dtypes(plan)}",
    )


def _replicate_step(plan: Plan, blocks: tuple[str, ...]) -> Step:
    return Step(
        "apply_replicate",
        dp_axis(plan),
        (("blocks", tuple(blocks)), ("precision", plan.precision), *_ep_argument(plan)),
        f"ZeRO-0: FSDP2's replicate (DDP on DTensor parameters and pipeline stages) all-reduces each "
        f"unit's gradients over {dp_ranks(plan)} after the last micro-batch's backward "
        f"({_units(blocks)}){_ep_why(plan)}{_dtypes(plan)}",
    )


def _ddp_step(plan: Plan) -> Step:
    unread = tuple(plan.layout.unread_params)
    return Step(
        "apply_ddp",
        dp_axis(plan),
        (("bucket_cap_mb", plan.ddp_bucket_cap_mb), *((("unread", unread),) if unread else ())),
        f"DDP all-reduces gradients in {plan.ddp_bucket_cap_mb:g} MiB buckets (the cost model's choice), "
        f"overlapped with backward"
        + (
            f"; what the forward never reads ({', '.join(unread[:3])}{', ...' if len(unread) > 3 else ''}) is left "
            f"out of its buckets: its gradients never come"
            if unread
            else ""
        ),
    )


def _optimizer_step(plan: Plan) -> Step:
    if plan.mesh.pp > 1:
        why = "the recipe's optimizer, one per stage module (each stage's state dict maps through its own module)"
    elif plan.mesh.dp_cp > 1 and plan.decisions.dp_runtime.name == "ddp-zero-optimizer":
        why = f"ZeRO-1: ZeroRedundancyOptimizer shards the recipe's optimizer state over {plan.mesh.dp_cp} ranks"
    elif plan.zero_stage >= 1 and plan.mesh.dp_cp > 1:
        why = "the recipe's optimizer over the FSDP2-sharded parameters (its state is sharded with them)"
    elif plan.mesh.dp > 1 and plan.mesh.tp > 1:
        why = "the recipe's optimizer over the replicated DTensor parameters, whole on every dp rank"
    else:
        why = "the recipe's optimizer, whole on every rank"
    if plan.decisions.offloaded:
        why += "; the shards on the host, so its state is made there and it steps on the CPU"
    if plan.decisions.float8_all_gather:
        why += "; after each step, the float8 weights' scales for the next all-gather (one amax all-reduce)"
        return Step("build_optimizer", dp_axis(plan), (("zero_stage", plan.zero_stage), ("float8_scales", True)), why)
    return Step("build_optimizer", dp_axis(plan), (("zero_stage", plan.zero_stage),), why)
