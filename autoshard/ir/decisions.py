"""The parallel decisions' vocabulary: one row per tensor-parallel style, one per precision policy.

Every layer reads these tables and none restates them: the planner (which styles shard a weight,
which leave their output sharded), the plan's schema (the names a plan may hold), the lowering
and the code generator (each style's torch constructor, as source), and the runtime (the same
constructor, built). Pure data: no torch here, so plans stay torch-free.

    style                      constructor                                      weight dims sharded   output
    colwise                    ColwiseParallel()                                weight 0, bias 0      local shard
    colwise-gather             ColwiseParallel(output_layouts=Replicate())      weight 0, bias 0      replicated
    colwise-loss-parallel      ColwiseParallel(output_layouts=Shard(-1),        weight 0, bias 0      vocab shard
                                 use_local_output=False)
    rowwise                    RowwiseParallel()                                weight 1              all-reduced
    vocab-parallel-embedding   RowwiseParallel(input_layouts=Replicate())       weight 0              all-reduced
    conv1d-colwise             Conv1DColwiseParallel()   (transformers Conv1D)  weight 1, bias 0      local shard
    conv1d-rowwise             Conv1DRowwiseParallel()                          weight 0              all-reduced
    sharded-input-dim{d}       SequenceParallel(sequence_dim=d,                 none                  local shard
                                 use_local_output=True)
    replicate                  (nothing)                                        none                  replicated

Sequence parallelism (Megatron-LM's, Korthikanti et al. 2022): the residual stream between the
parallel linears is sharded over tp along the sequence dim d ("Q" in ``passes.layouts.sequence``);
the reduce-scatter and all-gather that replace each all-reduce sit in these styles' hooks:

    colwise-seq-input-dim{d}          ColwiseParallel(input_layouts=Shard(d))        weight 0, bias 0   local shard
                                        (all-gathers its input; backward reduce-scatters the input gradient)
    colwise-gather-seq-input-dim{d}   ColwiseParallel(input_layouts=Shard(d),       weight 0, bias 0   replicated
                                        output_layouts=Replicate())
    rowwise-seq-output-dim{d}         RowwiseParallel(output_layouts=Shard(d))       weight 1           seq shard
                                        (reduce-scatters its partial output; backward all-gathers)
    vocab-parallel-embedding-         RowwiseParallel(input_layouts=Replicate(),     weight 0           seq shard
      seq-output-dim{d}                 output_layouts=Shard(d))
    conv1d-colwise-seq-input-dim{d}   Conv1DColwiseParallel(input_layouts=Shard(d))  weight 1, bias 0   local shard
    conv1d-rowwise-seq-output-dim{d}  Conv1DRowwiseParallel(output_layouts=Shard(d)) weight 0           seq shard
    gather-seq-input-dim{d}           PrepareModuleInput(input_layouts=Shard(d),     none               replicated
                                        desired_input_layouts=Replicate(), use_local_output=True)
                                        (a replicated linear reading the sequence shard: all-gather)
    scatter-seq-output-dim{d}         PrepareModuleOutput(output_layouts=Replicate(),  none             seq shard
                                        desired_output_layouts=Shard(d), use_local_output=True)
                                        (a replicated linear's output sliced; backward all-gathers)
    gather-seq-module-input-dim{d}    GatherSequenceInput(sequence_dim=d)            none               (its input)
                                        (a module holding colwise linears, e.g. attention: its first tensor
                                        argument all-gathered once into a replicated DTensor, which its code
                                        reads whole; the linears' partial input gradients reduce-scattered once)
    scatter-seq-input-dim{d}          ScatterSequenceInput(sequence_dim=d)           none               seq shard
                                        (a block: its first positional input sliced, backward all-gathered)

d < MAX_SEQ_DIM. The norms between them take ``sharded-input-dim{d}`` (torch's SequenceParallel).

Loss parallelism (Megatron-LM's vocab-parallel cross-entropy; torch's ``loss_parallel``): the output projection
leaves its logits a DTensor sharded on the vocabulary, and the loss runs on the shards under
``torch.distributed.tensor.parallel.loss_parallel()`` (``runtime.train_step``), so the whole logits never exist
on a rank. With sequence parallelism its input is the sequence shard:

    colwise-loss-parallel-seq-input-dim{d}   ColwiseParallel(input_layouts=Shard(d),    weight 0, bias 0   vocab shard
                                               output_layouts=Shard(-1), use_local_output=False)
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from autoshard.errors import AutoshardError

# The names the decisions take (``plan.json`` holds them; ``ir.plan_format`` re-exports them).
ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE_MODES = ("none", "selective", "full")  # the modes the search chooses among (and per block, mixed)
# alternate: torchtitan's op-level selective AC (its "op" option): attention kept and every other weight matmul's
# output, the rest recomputed; priced and emitted where pinned (``--recompute alternate``), SPMD plans only
ALTERNATE = "alternate"
PIN_RECOMPUTE = (*RECOMPUTE_MODES, ALTERNATE)
PLAN_RECOMPUTE = (*PIN_RECOMPUTE, "mixed")  # mixed: each block's own mode (Decisions.recompute_blocks)
SCHEDULES = ("none", "gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
ZERO_BUBBLE_SCHEDULES = ("interleaved-zb", "zbv", "dualpipev")  # backward split into input and weight gradients
V_SCHEDULES = ("zbv", "dualpipev")  # 2 stages per rank in a V: rank r holds stages r and 2·pp − 1 − r
# (schedule, virtual stages): torch's GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble (ZB1P), ZBV, DualPipeV
PIPELINE_SCHEDULES = (
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved-1f1b", 2),
    ("interleaved-zb", 2),
    ("zbv", 2),
    ("dualpipev", 2),
)

REPLICATE = "replicate"
LOSS_PARALLEL = "colwise-loss-parallel"  # the output projection's style under loss parallelism (module doc)
SHARDED_INPUT = "sharded-input-dim"
MAX_SHARDED_INPUT_DIM = 8  # sharded-input-dim0 .. 7
MAX_SEQ_DIM = 3  # the sequence-parallel styles exist for sequence dims 0 .. 2 (a token dim is 0 or 1)


def cp_load_balanced(tokens_per_sample: int, cp: int) -> bool:
    """Whether a cp plan's ranks hold head-tail pairs of chunks (load-balanced causal ring) rather than one
    contiguous chunk: rank r of cp holds chunks r and 2cp − 1 − r of size s/(2cp), so that each rank's causal
    attention work is the same c²/2 at every ring step (torch's ``_HeadTailLoadBalancer``, the layout
    torchtitan's cp runs train on). It needs s divisible by 2cp; otherwise the chunks stay contiguous. The one
    rule the runtime's sharding (``runtime.context_parallel``), the emitted program and the cost
    (``cost.context_parallel``) all read."""
    return cp > 1 and tokens_per_sample % (2 * cp) == 0


@dataclass(frozen=True)
class Mesh:
    """Parallel degrees; ``dp * cp * tp * pp`` ranks in all, laid out (pp, dp, cp, tp): TP innermost
    (inside a node first), then the context-parallel ranks that split each sequence (ring attention)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallelism: each sample's sequence split over cp ranks

    WRITTEN_UNLESS = {"cp": 1}  # plan keys written only when they differ (dense plans read and write as before)

    def __post_init__(self):
        for axis in ("dp", "tp", "pp", "cp"):
            if not isinstance(getattr(self, axis), int) or getattr(self, axis) < 1:
                raise AutoshardError(f"mesh {axis}={getattr(self, axis)!r} must be a positive integer")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_cp(self) -> int:
        """The ranks that reduce gradients together: dp replicas x the cp ranks of each (torchtitan's dp_shard_cp)."""
        return self.dp * self.cp

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def __str__(self) -> str:
        return f"dp={self.dp} tp={self.tp} pp={self.pp}" + (f" cp={self.cp}" if self.cp > 1 else "")


@dataclass(frozen=True)
class TPStyle:
    """One tensor-parallel style: its name in plans, its torch constructor as data, what it shards."""

    name: str
    constructor: str  # a class of torch.distributed.tensor.parallel, or of autoshard.runtime.tensor_parallel
    arguments: tuple[tuple[str, str], ...]  # keyword -> Python source of the value
    shard_dims: tuple[tuple[str, int], ...]  # parameter -> the dim split over tp
    output: str  # "shard" (this rank's slice of the features), "seq-shard" (of the tokens), "replicated", "all-reduced"
    from_runtime: bool = False  # constructor is autoshard.runtime.tensor_parallel's, not torch's

    @property
    def source(self) -> str:
        """The constructor call as Python source, as an emitted program writes it."""
        args = ", ".join(f"{k}={v}" for k, v in self.arguments)
        prefix = "runtime.tensor_parallel." if self.from_runtime else ""
        return f"{prefix}{self.constructor}({args})"

    @property
    def shards_weight(self) -> bool:
        """Its op runs on 1/tp of the weight."""
        return bool(self.shard_dims)

    @property
    def leaves_shard(self) -> bool:
        """Its output is this rank's slice of the features."""
        return self.output == "shard"

    @property
    def leaves_seq_shard(self) -> bool:
        """Its output is this rank's slice of the tokens (sequence parallelism)."""
        return self.output == "seq-shard"

    @property
    def loss_parallel(self) -> bool:
        """The output projection's style under loss parallelism: its logits a DTensor sharded on the vocabulary."""
        return self.name.startswith(LOSS_PARALLEL)

    @property
    def sequence_parallel(self) -> bool:
        """One of the sequence-parallel styles (module doc, second table)."""
        return self.name.endswith(
            tuple(f"seq-input-dim{d}" for d in range(MAX_SEQ_DIM))
            + tuple(f"seq-output-dim{d}" for d in range(MAX_SEQ_DIM))
        )

    @property
    def param_shard_dims(self) -> dict[str, int]:
        return dict(self.shard_dims)


_COL, _ROW = "ColwiseParallel", "RowwiseParallel"
# the logits left a DTensor sharded on the vocabulary (the last dim) for the loss (module doc, loss parallelism)
_VOCAB_SHARD_OUTPUT = (("output_layouts", "Shard(-1)"), ("use_local_output", "False"))


def _sequence_parallel_rows(d: int) -> tuple[TPStyle, ...]:
    """The sequence-parallel styles for sequence dim d (module doc table): output "seq-shard" is this rank's
    slice of the tokens, "shard" its slice of the features."""
    shard, rep = f"Shard({d})", "Replicate()"
    col_weight, conv_col_weight = (("weight", 0), ("bias", 0)), (("weight", 1), ("bias", 0))
    return (
        TPStyle(f"colwise-seq-input-dim{d}", _COL, (("input_layouts", shard),), col_weight, "shard"),
        TPStyle(
            f"colwise-gather-seq-input-dim{d}",
            _COL,
            (("input_layouts", shard), ("output_layouts", rep)),
            col_weight,
            "replicated",
        ),
        TPStyle(
            f"{LOSS_PARALLEL}-seq-input-dim{d}",
            _COL,
            (("input_layouts", shard), *_VOCAB_SHARD_OUTPUT),
            col_weight,
            "shard",
        ),
        TPStyle(f"rowwise-seq-output-dim{d}", _ROW, (("output_layouts", shard),), (("weight", 1),), "seq-shard"),
        TPStyle(
            f"vocab-parallel-embedding-seq-output-dim{d}",
            _ROW,
            (("input_layouts", rep), ("output_layouts", shard)),
            (("weight", 0),),
            "seq-shard",
        ),
        TPStyle(
            f"conv1d-colwise-seq-input-dim{d}",
            "Conv1DColwiseParallel",
            (("input_layouts", shard),),
            conv_col_weight,
            "shard",
            from_runtime=True,
        ),
        TPStyle(
            f"conv1d-rowwise-seq-output-dim{d}",
            "Conv1DRowwiseParallel",
            (("output_layouts", shard),),
            (("weight", 0),),
            "seq-shard",
            from_runtime=True,
        ),
        TPStyle(
            f"gather-seq-input-dim{d}",
            "PrepareModuleInput",
            (("input_layouts", shard), ("desired_input_layouts", rep), ("use_local_output", "True")),
            (),
            "replicated",
        ),
        TPStyle(
            f"scatter-seq-output-dim{d}",
            "PrepareModuleOutput",
            (("output_layouts", rep), ("desired_output_layouts", shard), ("use_local_output", "True")),
            (),
            "seq-shard",
        ),
        TPStyle(
            f"gather-seq-module-input-dim{d}",
            "GatherSequenceInput",
            (("sequence_dim", str(d)),),
            (),
            "replicated",
            from_runtime=True,
        ),
        TPStyle(
            f"scatter-seq-input-dim{d}",
            "ScatterSequenceInput",
            (("sequence_dim", str(d)),),
            (),
            "seq-shard",
            from_runtime=True,
        ),
    )


_ROWS = (
    TPStyle("colwise", _COL, (), (("weight", 0), ("bias", 0)), "shard"),
    TPStyle("colwise-gather", _COL, (("output_layouts", "Replicate()"),), (("weight", 0), ("bias", 0)), "replicated"),
    TPStyle(LOSS_PARALLEL, _COL, _VOCAB_SHARD_OUTPUT, (("weight", 0), ("bias", 0)), "shard"),
    TPStyle("rowwise", _ROW, (), (("weight", 1),), "all-reduced"),
    TPStyle("vocab-parallel-embedding", _ROW, (("input_layouts", "Replicate()"),), (("weight", 0),), "all-reduced"),
    # transformers' Conv1D (GPT-2): weight (in, out), y = x @ W + b, the transpose of nn.Linear
    TPStyle("conv1d-colwise", "Conv1DColwiseParallel", (), (("weight", 1), ("bias", 0)), "shard", from_runtime=True),
    TPStyle("conv1d-rowwise", "Conv1DRowwiseParallel", (), (("weight", 0),), "all-reduced", from_runtime=True),
    # replicated parameters on an input sharded on dim d (a per-head norm): DTensor sums their gradients
    *(
        TPStyle(
            f"{SHARDED_INPUT}{d}",
            "SequenceParallel",
            (("sequence_dim", str(d)), ("use_local_output", "True")),
            (),
            "shard",
        )
        for d in range(MAX_SHARDED_INPUT_DIM)
    ),
    *(row for d in range(MAX_SEQ_DIM) for row in _sequence_parallel_rows(d)),
)
TP_STYLES: dict[str, TPStyle] = {row.name: row for row in _ROWS}
SHARDING_STYLES = frozenset(name for name, row in TP_STYLES.items() if row.shards_weight)
SHARD_OUTPUT_STYLES = frozenset(name for name in SHARDING_STYLES if TP_STYLES[name].leaves_shard)


def tp_style(name: str) -> TPStyle:
    """The row of a style name; one line naming the choices for an unknown one."""
    row = TP_STYLES.get(name)
    if row is None:
        raise AutoshardError(
            f"unknown tensor-parallel style {name!r}; use one of {', '.join(list(TP_STYLES)[:6])}, "
            f"{SHARDED_INPUT}N (N < {MAX_SHARDED_INPUT_DIM}) or {REPLICATE}"
        )
    return row


@dataclass(frozen=True)
class PrecisionPolicy:
    """How a plan's precision is run: FSDP2's MixedPrecisionPolicy dtypes and the autocast dtype."""

    name: str
    param_dtype: str | None  # FSDP2 gathers weights in this dtype (None: as stored)
    reduce_dtype: str | None  # gradients are reduced in this dtype (None: as computed)
    autocast_dtype: str | None  # forward runs under torch.autocast in this dtype (None: no autocast)
    cast_dtype: str | None = None  # the model's parameters cast to this dtype before anything (None: as built)
    grad_scaler: bool = False  # the loss scaled for backward and the step skipped on inf gradients (fp16)


PRECISIONS: dict[str, PrecisionPolicy] = {
    "fp32": PrecisionPolicy("fp32", None, None, None),  # gloo (CPUs): exactly one process's numerics
    # fp32 parameters on GPUs: bf16 compute (FSDP2 gathers bf16 weights; autocast elsewhere), fp32 reductions
    "bf16-autocast": PrecisionPolicy("bf16-autocast", "bfloat16", "float32", "bfloat16"),
    # 16-bit (or fp64) parameters train in their own dtype (cost.memory.precision_for_backend)
    **{f"{short}-params": PrecisionPolicy(f"{short}-params", None, None, None) for short in ("bf16", "fp16", "fp64")},
    # --precision bf16-pure on fp32 parameters: the model cast to bf16 first (on the meta device, so each shard
    # is the fp32 initial weight rounded to bf16); weights, gradients, optimizer state and compute in bf16
    "bf16-pure": PrecisionPolicy("bf16-pure", None, None, None, cast_dtype="bfloat16"),
    # --precision fp16: fp32 master weights, fp16 compute, fp32 reductions, the loss scaled (GradScaler)
    "fp16-autocast": PrecisionPolicy("fp16-autocast", "float16", "float32", "float16", grad_scaler=True),
}

# --precision's choices -> the plan's precision (``PRECISIONS``; the plan format keeps its older names, so old plans
# read as before): fp32 -> "fp32"; bf16 -> "bf16-autocast"; bf16-pure -> "bf16-params" on a model whose parameters
# are bf16 already, else "bf16-pure" (cast); fp16 -> "fp16-autocast". ``cost.memory.pinned_precision`` maps them.
PIN_PRECISIONS = ("fp32", "bf16", "bf16-pure", "fp16")
# the plan's precision -> the --precision that gives it (the inverse of the map above; "fp16-params" and
# "fp64-params" come only unpinned, from the parameters' dtype)
PIN_OF_PRECISION = {
    "fp32": "fp32",
    "bf16-autocast": "bf16",
    "bf16-pure": "bf16-pure",
    "bf16-params": "bf16-pure",
    "fp16-autocast": "fp16",
}


def precision_policy(name: str) -> PrecisionPolicy:
    policy = PRECISIONS.get(name)
    if policy is None:
        raise AutoshardError(f"unknown precision {name!r}; use one of {', '.join(PRECISIONS)}")
    return policy


@dataclass
class SegmentCost:
    """The chosen layouts' predicted cost for one segment (a representative block or the rest)."""

    path: str  # representative block path, or "" for the ops outside blocks
    repeats: int
    compute_s: float
    comm_s: float
    comm_bytes: int  # Σ sizes S of the collectives (all-reduce buffers, all-gather outputs)


@dataclass
class TPChoice:
    """A tensor-parallel layout of a graph over tp ranks: each module's style and what it costs
    (solved by ``passes.layouts.styles``, priced by ``cost.tp``)."""

    tp: int
    styles: dict[str, str]  # module path -> a TP_STYLES name (colwise, rowwise-seq-output-dim1, ...) or replicate
    reasons: dict[str, str]  # module path -> why it stays replicated (or, colwise-gather, which op keeps heads whole)
    segments: list[SegmentCost] = field(default_factory=list)
    # True when at least one value runs sharded over the sequence (layout Q of passes.layouts.sequence): asked
    # for with ``choose_tp_styles(..., sequence_parallel=True)`` and possible for the model.
    sequence_parallel: bool = False
    # Per-rank bytes of the blocks' activations over the same activations unsharded (None: no blocks, or tp=1),
    # from the chosen layouts: every block op's output (views and aliases left out) counts 1/tp when sharded (S:
    # features / heads, Q: tokens) and whole when replicated or partial, plus the whole input that each module
    # gathering a sequence shard (colwise-seq-input, gather-seq-input: one all-gather per module) keeps for its
    # backward. Korthikanti et al. 2022 count a Megatron block's saved activations as s·b·h·(10 + 24/t) without
    # sequence parallelism and 34·s·b·h/t with it; DTensor's per-module gathers keep each gathered input, so
    # this fraction lies above 1/t (``cost.tp.tp_activation_fraction`` is the formula without it).
    block_activation_fraction: float | None = None

    @property
    def comm_bytes(self) -> int:
        return sum(s.comm_bytes * s.repeats for s in self.segments)

    @property
    def comm_s(self) -> float:
        return sum(s.comm_s * s.repeats for s in self.segments)

    @property
    def compute_s(self) -> float:
        return sum(s.compute_s * s.repeats for s in self.segments)

    @property
    def loss_parallel(self) -> bool:
        """The output projection's logits left sharded on the vocabulary for the loss (``LOSS_PARALLEL``)."""
        return any(style.startswith(LOSS_PARALLEL) for style in self.styles.values())

    @property
    def sharded(self) -> dict[str, str]:
        """The styles that do something (not "replicate"): what ``apply_tensor_parallel`` needs."""
        return {m: s for m, s in self.styles.items() if s != REPLICATE}


MIXED = "mixed"  # decisions whose blocks recompute in different modes (``Decisions.recompute_blocks``)


@dataclass(frozen=True)
class DPRuntime:
    """How a ZeRO stage runs on the dp axis: the torch part, and what it keeps whole or shards.

        name                 ZeRO  mesh             torch part                                   per step
        ddp                  0     dp only          DistributedDataParallel                      bucketed all-reduce, last micro-batch
        ddp-zero-optimizer   1     dp only          DDP + ZeroRedundancyOptimizer                that, then a broadcast per tensor
        replicate            0     with tp or pp    FSDP2's replicate (DTensor-aware DDP)       all-reduce per unit, last micro-batch
        fsdp-accumulate      1     with tp or pp    fully_shard, weights kept gathered and       all-gather + reduce-scatter per unit,
                                                    gradients summed whole until the last        once (Megatron's distributed optimizer)
                                                    micro-batch
        fsdp                 2     any              fully_shard(reshard_after_forward=False)     reduce-scatter every micro-batch
        fsdp-reshard         3     any              fully_shard(reshard_after_forward=True)      all-gather twice, reduce-scatter, every
                                                                                                 micro-batch

    With tp or pp the parameters are DTensors or pipeline stages: DDP's bucket views and
    ZeroRedundancyOptimizer's per-tensor broadcasts take neither, so ZeRO-0 and ZeRO-1 run on FSDP2's
    machinery (``torch.distributed._composable.replicate_with_fsdp.replicate``, which
    ``torch.distributed.pipelining``'s stages drive as they drive ``fully_shard``). In a pipeline the
    schedule sums each stage's gradients whole until the last micro-batch whatever the wrapper, so
    ZeRO-2 would run as ZeRO-1 there: pipelines offer ZeRO-0, 1 and 3.
    """

    name: str
    zero_stage: int
    wrapper: str  # DistributedDataParallel | replicate | fully_shard
    reshard_after_forward: bool = False
    sync_every_microbatch: bool = True  # False: gradients summed unsharded, reduced on the last micro-batch

    @property
    def fsdp2(self) -> bool:
        """Runs on FSDP2's machinery (per-unit collectives, DTensor parameters)."""
        return self.wrapper != "DistributedDataParallel"


DP_RUNTIMES: dict[str, DPRuntime] = {
    row.name: row
    for row in (
        DPRuntime("ddp", 0, "DistributedDataParallel"),
        DPRuntime("ddp-zero-optimizer", 1, "DistributedDataParallel"),
        DPRuntime("replicate", 0, "replicate", sync_every_microbatch=False),
        DPRuntime("fsdp-accumulate", 1, "fully_shard", sync_every_microbatch=False),
        DPRuntime("fsdp", 2, "fully_shard"),
        DPRuntime("fsdp-reshard", 3, "fully_shard", reshard_after_forward=True),
    )
}


def dp_runtime(zero_stage: int, mesh: Mesh, ep: int = 1) -> DPRuntime:
    """The row that runs ``zero_stage`` on ``mesh`` (``DPRuntime``); expert shards (ep > 1) are
    synchronised over their own ranks, which only FSDP2's wrappers take (as with tp or pp)."""
    plain = mesh.tp == 1 and mesh.pp == 1 and ep == 1
    if zero_stage == 0:
        return DP_RUNTIMES["ddp" if plain else "replicate"]
    if zero_stage == 1:
        return DP_RUNTIMES["ddp-zero-optimizer" if plain else "fsdp-accumulate"]
    return DP_RUNTIMES["fsdp" if zero_stage == 2 else "fsdp-reshard"]


def in_plan(rule: str, choices: tuple = (), required: bool = False) -> dict[str, Any]:
    """A ``Decisions`` field's metadata: how ``plan.json``'s decisions section holds it, which ``ir.plan_schema``
    checks and ``ir.plan`` reads. ``rule``: "count" (an integer >= 1), "choice" (one of ``choices``), "positive"
    (a number > 0), "flag" (true or false), or "mesh" / "recompute_blocks" (their own checks). A field with a default may be absent
    from older plans (it reads as the default) unless ``required``; a field without the metadata is not
    written (it is recorded elsewhere in the plan)."""
    return {"plan": rule, "choices": choices, "required": required}


def compile_runs(
    mesh: Mesh, ep: int = 1, sequence_parallel: bool = False, recompute: str = "none", schedule: str = "none"
) -> bool:
    """Where compiled blocks are emitted and verified (``runtime.compiled``): without expert parallelism (its
    all-to-all dispatch is not traced). SPMD, beside tensor parallelism with or without sequence parallelism,
    under every recompute mode (a TP block recomputed in full is compiled inside its checkpoint). Beside context
    parallelism (the ring eager between compiled graphs) and inside pipeline stages (each stage's blocks
    compiled), the recompute stays eager around the compiled block, so none or full (selective's policy is a
    dispatch mode, under which dynamo compiles nothing); beside cp without tensor parallelism; in stages with or
    without it (TP's local shards and their traced collectives, custom ops inductor calls as they are) and beside
    cp there too (the stage's traced attention runs the ring eager between compiled graphs; its positions are the
    mode's, traced into the compiled code), not with a schedule that splits the backward (its weight pass would rerun a compiled block's whole
    backward). ``sequence_parallel`` no longer narrows it; callers still pass it."""
    del sequence_parallel
    if ep > 1:
        return False
    if mesh.pp > 1 or mesh.cp > 1:
        return (
            (mesh.tp == 1 or mesh.pp > 1)
            and recompute in COMPILED_RECOMPUTE_OUTSIDE
            and (mesh.pp == 1 or schedule not in ZERO_BUBBLE_SCHEDULES)
        )
    return True


def async_tp_refusal(mesh: Mesh, compiled: bool, sequence_parallel: bool, backend: str) -> str:
    """Why async TP (inductor's micro-pipelined TP: each sequence-parallel all-gather fused with the matmul
    reading it, each matmul with the reduce-scatter of its output, over symmetric memory) cannot run ("" when it
    can): it is an inductor pass, so compiled blocks; it rewrites sequence parallelism's all-gathers and
    reduce-scatters, so tp > 1 with sequence parallelism; symmetric memory is CUDA's, so NCCL ranks, not gloo.
    Not inside pipeline stages: there TP's collectives are autoshard's own custom ops
    (``runtime.tensor_parallel_stages``), which the pass cannot match (it matches ``_c10d_functional``'s
    all-gather and reduce-scatter, each followed by its ``wait_tensor``) and would leave unfused."""
    if mesh.tp == 1:
        return "it overlaps tensor parallelism's collectives, and the plan has tp 1"
    if mesh.pp > 1:
        return (
            "inside pipeline stages TP's collectives are traced custom ops that inductor's micro-pipeline pass does "
            "not match, so nothing would overlap; pin --pp 1"
        )
    if not compiled:
        return "it is an inductor pass over compiled blocks; pin --compile on"
    if not sequence_parallel:
        return (
            "it fuses sequence parallelism's all-gathers and reduce-scatters with their matmuls; pin "
            "--sequence-parallel on"
        )
    if backend == "gloo":
        return "it needs symmetric memory (CUDA ranks on NCCL), and this cluster's ranks are CPUs on gloo"
    return ""


def compile_loss_refusal(mesh: Mesh, loss_parallel: bool = False) -> str:
    """Why the compiled loss cannot run ("" when it can): a pipeline's schedule calls the loss inside its last
    stage (``runtime.pipeline_parallel``), where it stays eager; under loss parallelism torch 2.13's compiled
    ``loss_parallel`` cross-entropy hands the logits' DTensor backward a plain tensor gradient (2 CPU ranks: the
    backward raises in DTensor's redistribute), so it stays eager there too. SPMD plans compile it beside tp, cp
    and ep."""
    if mesh.pp > 1:
        return "a pipeline's schedule calls the loss inside its last stage, where it runs eager"
    if loss_parallel:
        return (
            "under loss parallelism torch's compiled cross-entropy hands the logits' DTensor backward a plain "
            "tensor; pin --loss-parallel off to compile it"
        )
    return ""


COMPILED_RECOMPUTE_OUTSIDE = ("none", "full")  # compile_runs beside cp and in stages: recompute eager, around


@dataclass(frozen=True)
class Float8Recipe:
    """One float8 training recipe of torchao (``torchao.float8.Float8LinearConfig.from_recipe_name``): how each
    operand of a converted linear's three matmuls (input, weight, output gradient) is scaled into float8.

    ``casts``: the float8 copies made of each operand per use, each one amax pass (a reduction reading the
    bf16 tensor) and one cast (reading it, writing the float8 copy): tensorwise takes one scale per tensor, so
    one copy serves a matmul and, transposed, the next (``transposed_copy``); rowwise takes one scale per row,
    and the gradient matmuls reduce over the other axis, so each operand is scaled twice, once per axis.
    ``fsdp_float8_all_gather``: FSDP2 may gather the converted weights in float8 (torchao allows it for
    tensorwise scaling only)."""

    name: str  # torchao's Float8LinearRecipeName value
    casts: int
    transposed_copy: bool
    fsdp_float8_all_gather: bool


FLOAT8_RECIPES: dict[str, Float8Recipe] = {
    "tensorwise": Float8Recipe("tensorwise", casts=1, transposed_copy=True, fsdp_float8_all_gather=True),
    "rowwise": Float8Recipe("rowwise", casts=2, transposed_copy=False, fsdp_float8_all_gather=False),
}
FLOAT8_OFF = "off"
FLOAT8_CHOICES = (FLOAT8_OFF, *FLOAT8_RECIPES)  # --float8 and decisions.float8
# torch._scaled_mm (float8 matmul) needs both of a weight's dims divisible by 16: torchao converts only such linears
FLOAT8_DIM_MULTIPLE = 16


def float8_runs(mesh: Mesh, ep: int = 1) -> bool:
    """Where float8 linears are emitted: without expert parallelism (expert shards are not converted). Tensor
    parallelism takes torchao's float8 TP styles for tensorwise (``runtime.tensor_parallel``); pipeline stages,
    traced from the bf16 model, have their linears converted after the split (``runtime.float8``); context
    parallelism leaves the linears alone."""
    del mesh  # every mesh: the argument stays for the callers that ask per mesh
    return ep == 1


# Offload of the model state to host memory (``offload_runs``): none; cpu, FSDP2's ``CPUOffloadPolicy``
# (parameters, gradients and optimizer state on the host, the optimizer step on the CPU); nvme is priced and refused
# (no maintained library offloads FSDP2's state to NVMe), so a plan holds none or cpu.
OFFLOAD_NONE = "none"
OFFLOAD_CPU = "cpu"
OFFLOAD_NVME = "nvme"
OFFLOAD_CHOICES = (OFFLOAD_NONE, OFFLOAD_CPU)  # decisions.offload
PIN_OFFLOAD = (*OFFLOAD_CHOICES, OFFLOAD_NVME)  # --offload


def offload_refusal(
    mesh: Mesh, zero_stage: int, ep: int = 1, backend: str = "nccl", float8: str = FLOAT8_OFF
) -> str | None:
    """Why host offload (FSDP2's ``CPUOffloadPolicy``) is not emitted for this point, or None where it is: ZeRO-3
    over more than one dp rank (the policy is FSDP2's, and keeps the sharded state on the host: ZeRO-3's shards),
    without pipeline stages (the stages' schedule steps the FSDP2 units itself; not verified with the policy), expert
    parallelism (its expert shards are units over other ranks) or context parallelism, on GPUs (CPU ranks have no
    device memory to offload from), nor beside float8 linears (torchao's precomputed scales through FSDP2's host
    copies are not run anywhere yet)."""
    if backend == "gloo":
        return "CPU ranks (gloo) keep their state in host memory already: there is nothing to offload"
    if zero_stage != 3 or mesh.dp == 1:
        return "FSDP2's CPUOffloadPolicy offloads ZeRO-3's shards: it needs ZeRO-3 over dp > 1"
    if mesh.pp > 1:
        return "pipeline stages are not offloaded yet (the schedule drives the FSDP2 units)"
    if ep > 1 or mesh.cp > 1:
        return "expert and context parallelism are not offloaded yet"
    if float8 != FLOAT8_OFF:
        return "float8 linears are not offloaded yet (their scales through FSDP2's host copies are untested)"
    return None


@dataclass(frozen=True)
class Decisions:
    """The decisions of one point of the search space: mesh, ZeRO stage, micro-batching, pipeline schedule,
    recompute, DDP bucket size, precision, HSDP replicas, expert and sequence parallelism, compiled blocks, float8
    linears, host offload, async TP. A plan's
    decisions are this record (``Plan.decisions``, ``plan.json``'s decisions section: the fields in this
    order, each as its ``in_plan`` metadata says); ``Pins`` is the same fields, each optional, that the
    user fixes by hand."""

    mesh: Mesh = field(metadata=in_plan("mesh"))
    zero_stage: int = field(metadata=in_plan("choice", ZERO_STAGES))
    microbatch_size: int = field(metadata=in_plan("count"))
    num_microbatches: int = field(metadata=in_plan("count"))
    _: KW_ONLY
    schedule: str = field(default="none", metadata=in_plan("choice", SCHEDULES, required=True))
    virtual_stages: int = field(default=1, metadata=in_plan("count"))  # pipeline stages per pp rank
    recompute: str = field(
        default="none",  # none | selective | full | mixed (then ``recompute_blocks``)
        metadata=in_plan("choice", PLAN_RECOMPUTE, required=True),
    )
    # mixed: each block's mode, in block order (passes.planning.recompute); plan.json keys them by block path
    recompute_blocks: tuple[str, ...] = field(default=(), metadata=in_plan("recompute_blocks"))
    ddp_bucket_cap_mb: float = field(default=25.0, metadata=in_plan("positive"))
    # a plan's (PRECISIONS); the search prices the cluster's (cost.tables.Runtime)
    precision: str = field(default="fp32", metadata=in_plan("choice", tuple(PRECISIONS)))
    # HSDP: dp = dp_replicate x dp_shard; FSDP2 shards over dp_shard (inside a node)
    dp_replicate: int = field(default=1, metadata=in_plan("count"))
    # Expert parallelism: each expert group's E experts split over ep ranks borrowed from dp (ep | dp,
    # adjacent dp ranks); tokens reach their experts by all-to-all, expert shards sync over dp / ep ranks.
    ep: int = field(default=1, metadata=in_plan("count"))
    # torch.compile of each block (inductor): its elementwise chains fused between the matmuls and attention
    # (``runtime.compiled``, priced by ``cost.compiled``); SPMD plans without cp or ep (``compile_runs``)
    compile: bool = field(default=False, metadata=in_plan("flag"))
    # float8 training (torchao's Float8Linear) of the linears ``layout.float8_linears`` names: off, or a recipe of
    # FLOAT8_RECIPES; searched (tensorwise) on devices with float8 matmuls (``DeviceSpec.float8_tflops``)
    float8: str = field(default=FLOAT8_OFF, metadata=in_plan("choice", FLOAT8_CHOICES))
    # Host offload: none, or cpu (FSDP2's CPUOffloadPolicy: ZeRO-3's parameter, gradient and optimizer-state shards
    # on the host, the optimizer step on the CPU; ``offload_refusal`` says where it runs, ``cost.offload`` prices it)
    offload: str = field(default=OFFLOAD_NONE, metadata=in_plan("choice", OFFLOAD_CHOICES))
    # Async TP (torchtitan's enable_async_tensor_parallel): inductor's micro-pipeline TP pass over the compiled
    # blocks, each sequence-parallel collective overlapped with its matmul in chunks over symmetric memory
    # (``async_tp_refusal`` says where it runs, ``cost.async_tp`` prices it, ``runtime.compiled`` applies it)
    async_tp: bool = field(default=False, metadata=in_plan("flag"))
    # torch.compile of the loss the step calls (torchtitan's build_cross_entropy_loss under --training.compile, since
    # its commit bbb1b616e of 2025-04-02): inductor fuses the fp32 upcast, log-softmax and nll into a few kernels that
    # keep no fp32 copy of the logits (``compile_loss_refusal`` says where it runs, ``cost.units`` prices it,
    # ``runtime.compiled`` ``compiled_loss`` applies it)
    compile_loss: bool = field(default=False, metadata=in_plan("flag"))
    # Sequence parallelism (tp > 1, with or without pipeline stages): the TP layout is solved with the regions
    # between the parallel linears on 1/tp of the tokens (``passes.layouts.sequence``, layout Q), where the model
    # allows.
    # Not written: a plan records it in its TP styles (``layout.tensor_parallel``).
    sequence_parallel: bool = False
    # Loss parallelism (tp > 1, no pipeline, no cp): the output projection's logits stay sharded on the vocabulary
    # and the cross-entropy runs on the shards (``LOSS_PARALLEL``'s style; where ``passes.capturing.tp_proof``
    # ``prove_loss_parallel`` showed the loss is the default cross-entropy on them). Not written: a plan records it
    # in its TP styles (``layout.tensor_parallel``), as sequence parallelism.
    loss_parallel: bool = False

    # plan keys written only when they differ (plans without them read and write as before)
    WRITTEN_UNLESS = {
        "ep": 1,
        "compile": False,
        "float8": FLOAT8_OFF,
        "offload": OFFLOAD_NONE,
        "async_tp": False,
        "compile_loss": False,
    }

    @property
    def num_stages(self) -> int:
        return self.mesh.pp * self.virtual_stages

    @property
    def dp_runtime(self) -> DPRuntime:
        return dp_runtime(self.zero_stage, self.mesh, self.ep)

    @property
    def expert_dp(self) -> int:
        """The dp ranks holding the same expert shard, over which its gradients are reduced: dp / ep."""
        return self.mesh.dp // self.ep

    @property
    def float8_all_gather(self) -> bool:
        """FSDP2 gathers the float8 weights in float8 (torchao's ``enable_fsdp_float8_all_gather``): where the
        recipe allows it (tensorwise) and FSDP2's fully_shard is the dp wrapper over more than one rank, outside
        pipeline stages (a stage's linears are float8 matmuls on its plain weights: FSDP2 gathers them in bf16)."""
        recipe = FLOAT8_RECIPES.get(self.float8)
        if recipe is None or not recipe.fsdp_float8_all_gather or self.mesh.dp_cp == 1 or self.mesh.pp > 1:
            return False
        return self.dp_runtime.wrapper not in ("DistributedDataParallel", "replicate")

    @property
    def offloaded(self) -> bool:
        """ZeRO-3's shards live on the host (FSDP2's CPUOffloadPolicy)."""
        return self.offload == OFFLOAD_CPU

    @property
    def dp_shard(self) -> int:
        """The ranks each FSDP2 shard group spans: dp, or dp / dp_replicate under HSDP."""
        return self.mesh.dp // self.dp_replicate

    def block_modes(self, blocks: int) -> tuple[str, ...]:
        """Each block's recompute mode."""
        return self.recompute_blocks if self.recompute == MIXED else (self.recompute,) * blocks
