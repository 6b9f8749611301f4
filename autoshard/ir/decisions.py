"""The parallel decisions' vocabulary: one row per tensor-parallel style, one per precision policy.

Every layer reads these tables and none restates them: the planner (which styles shard a weight,
which leave their output sharded), the plan's schema (the names a plan may hold), the lowering
and the code generator (each style's torch constructor, as source), and the runtime (the same
constructor, built). Pure data: no torch here, so plans stay torch-free.

    style                      constructor                                      weight dims sharded   output
    colwise                    ColwiseParallel()                                weight 0, bias 0      local shard
    colwise-gather             ColwiseParallel(output_layouts=Replicate())      weight 0, bias 0      replicated
    rowwise                    RowwiseParallel()                                weight 1              all-reduced
    vocab-parallel-embedding   RowwiseParallel(input_layouts=Replicate())       weight 0              all-reduced
    conv1d-colwise             Conv1DColwiseParallel()   (transformers Conv1D)  weight 1, bias 0      local shard
    conv1d-rowwise             Conv1DRowwiseParallel()                          weight 0              all-reduced
    sharded-input-dim{d}       SequenceParallel(sequence_dim=d,                 none                  local shard
                                 use_local_output=True)
    replicate                  (nothing)                                        none                  replicated
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.errors import AutoshardError

REPLICATE = "replicate"
SHARDED_INPUT = "sharded-input-dim"
MAX_SHARDED_INPUT_DIM = 8  # sharded-input-dim0 .. 7


@dataclass(frozen=True)
class TPStyle:
    """One tensor-parallel style: its name in plans, its torch constructor as data, what it shards."""

    name: str
    constructor: str  # a class of torch.distributed.tensor.parallel, or of autoshard.runtime.tensor_parallel
    arguments: tuple[tuple[str, str], ...]  # keyword -> Python source of the value
    shard_dims: tuple[tuple[str, int], ...]  # parameter -> the dim split over tp
    output: str  # "shard" (this rank's slice), "replicated" or "all-reduced"
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
    def param_shard_dims(self) -> dict[str, int]:
        return dict(self.shard_dims)


_COL, _ROW = "ColwiseParallel", "RowwiseParallel"
_ROWS = (
    TPStyle("colwise", _COL, (), (("weight", 0), ("bias", 0)), "shard"),
    TPStyle("colwise-gather", _COL, (("output_layouts", "Replicate()"),), (("weight", 0), ("bias", 0)),
            "replicated"),
    TPStyle("rowwise", _ROW, (), (("weight", 1),), "all-reduced"),
    TPStyle("vocab-parallel-embedding", _ROW, (("input_layouts", "Replicate()"),), (("weight", 0),),
            "all-reduced"),
    # transformers' Conv1D (GPT-2): weight (in, out), y = x @ W + b, the transpose of nn.Linear
    TPStyle("conv1d-colwise", "Conv1DColwiseParallel", (), (("weight", 1), ("bias", 0)), "shard",
            from_runtime=True),
    TPStyle("conv1d-rowwise", "Conv1DRowwiseParallel", (), (("weight", 0),), "all-reduced", from_runtime=True),
    # replicated parameters on an input sharded on dim d (a per-head norm): DTensor sums their gradients
    *(TPStyle(f"{SHARDED_INPUT}{d}", "SequenceParallel", (("sequence_dim", str(d)), ("use_local_output", "True")),
              (), "shard") for d in range(MAX_SHARDED_INPUT_DIM)),
)
TP_STYLES: dict[str, TPStyle] = {row.name: row for row in _ROWS}
SHARDING_STYLES = frozenset(name for name, row in TP_STYLES.items() if row.shards_weight)
SHARD_OUTPUT_STYLES = frozenset(name for name in SHARDING_STYLES if TP_STYLES[name].leaves_shard)


def tp_style(name: str) -> TPStyle:
    """The row of a style name; one line naming the choices for an unknown one."""
    row = TP_STYLES.get(name)
    if row is None:
        raise AutoshardError(f"unknown tensor-parallel style {name!r}; use one of {', '.join(list(TP_STYLES)[:6])}, "
                             f"{SHARDED_INPUT}N (N < {MAX_SHARDED_INPUT_DIM}) or {REPLICATE}")
    return row


@dataclass(frozen=True)
class PrecisionPolicy:
    """How a plan's precision is run: FSDP2's MixedPrecisionPolicy dtypes and the autocast dtype."""

    name: str
    param_dtype: str | None  # FSDP2 gathers weights in this dtype (None: as stored)
    reduce_dtype: str | None  # gradients are reduced in this dtype (None: as computed)
    autocast_dtype: str | None  # forward runs under torch.autocast in this dtype (None: no autocast)


PRECISIONS: dict[str, PrecisionPolicy] = {
    "fp32": PrecisionPolicy("fp32", None, None, None),  # gloo (CPUs): exactly one process's numerics
    # fp32 parameters on GPUs: bf16 compute (FSDP2 gathers bf16 weights; autocast elsewhere), fp32 reductions
    "bf16-autocast": PrecisionPolicy("bf16-autocast", "bfloat16", "float32", "bfloat16"),
    # 16-bit (or fp64) parameters train in their own dtype (cost.memory.precision_for_backend)
    **{f"{short}-params": PrecisionPolicy(f"{short}-params", None, None, None) for short in ("bf16", "fp16", "fp64")},
}


def precision_policy(name: str) -> PrecisionPolicy:
    policy = PRECISIONS.get(name)
    if policy is None:
        raise AutoshardError(f"unknown precision {name!r}; use one of {', '.join(PRECISIONS)}")
    return policy
