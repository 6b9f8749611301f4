"""Apply steps: a plan lowered to the ordered calls that parallelize a model (``passes.lowering.lower``).

A step names one function of the runtime's applier (``runtime.parallel``), the mesh dimension it
runs over, its arguments (plain data: names, numbers, dicts of module paths) and why. The applier
executes the list (``runtime.parallel.apply_steps``); the code generator prints the same list as
calls (``passes.lowering.codegen``). Both take their order from the lowering alone.

Beside the steps, a ``Layout`` (``passes.lowering.lower.layout``) says where each rank sits and what share of
each global batch it trains on: the device mesh's dims, the dims joined into one, the axis that splits
the samples, the axis that splits each sample's tokens (context parallelism), the axis the logged loss
is averaged over, and the sequence length handed to the model file. The emitted program prints its
fields as constants and hands them to the runtime (``runtime.build_mesh``, ``runtime.take_samples``,
``runtime.take_sequence_shard``, ``runtime.context_parallel``); ``autoshard.parallelize`` reads the same
record.

    op                  SPMD plans                          pipeline plans
    cast_params         the meta model's parameters in bf16 (--precision bf16-pure on fp32 parameters), first
    use_cp_attention    cp plans: a transformers model's attention made the ring's (no mask built: head-tail
                        positions are not read as packed sequences; runtime.context_parallel), both kinds
    apply_float8        the plan's float8 linears made torchao  each stage's linear ops made float8 matmuls,
                        Float8Linear (--float8), first      right after split_pipeline (runtime.float8)
    apply_tp            DTensor styles per module           local shards + traceable collectives, before the split
                        (float8 tensorwise: torchao's float8 styles)
    apply_ep            each rank keeps its experts; tokens reach them by all-to-all (one op the split traces)
    split_pipeline      -                                   this rank's stages (torch.distributed.pipelining)
    apply_ac            checkpoint_wrapper per block        the block's region of its stage graph, outlined
    apply_async_tp      symmetric memory for tp, inductor's micro-pipeline TP pass (--async-tp on)   -
    apply_compile       torch.compile of each block's forward   each stage's block modules' (--compile on; inductor)
    sync_batch_norm     SyncBatchNorm over dp               -
    apply_fsdp          FSDP2 per block, then the root      FSDP2 per stage module
                        (--offload cpu: with CPUOffloadPolicy, the shards in host memory)
    apply_replicate     FSDP2's replicate per block, root   replicate per stage module (ZeRO-0 with tp or pp)
    init_weights        this rank's shards made on its device and filled with one process's initial weights
                        (the model so far is on the meta device; ``runtime.init_replay``)
    apply_ddp           DDP with the plan's bucket size     -
    build_optimizer     the recipe's optimizer (runtime.recipe), ZeroRedundancyOptimizer for ZeRO-1 over DDP;
                        pipeline plans: one per stage; float8 under FSDP2 (tensorwise): the weights' float8
                        scales computed after each step (torchao's precompute_float8_dynamic_scale_for_fsdp)
    build_schedule      -                                   torch's schedule (GPipe, 1F1B, interleaved, zero bubble)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OPS = (
    "cast_params",
    "use_cp_attention",
    "apply_float8",
    "apply_tp",
    "apply_ep",
    "split_pipeline",
    "apply_ac",
    "apply_async_tp",
    "apply_compile",
    "sync_batch_norm",
    "apply_fsdp",
    "apply_replicate",
    "init_weights",
    "apply_ddp",
    "build_optimizer",
    "build_schedule",
)
# What each op needs besides the plan's data: values of the run (the applier's keyword inputs, the
# emitted function's parameters of the same names).
RUN_INPUTS = {
    "split_pipeline": ("example_microbatch", "device"),
    "init_weights": ("device",),
    "apply_ddp": ("device",),
    "build_optimizer": ("recipe",),
    "build_schedule": ("loss_fn",),
}
# What each op returns; the others return the (wrapped) model, or the stages after split_pipeline.
RESULTS = {"build_optimizer": "optimizer", "build_schedule": "schedule"}
WHOLE_MESH = "*"
MESH_ORDER = ("pp", "dp", "cp", "tp")  # the mesh's dims outermost first: tp innermost (inside a node)


@dataclass(frozen=True)
class Step:
    """One call of the applier: ``op(model, mesh[mesh_dim], **arguments, **run inputs)``."""

    op: str
    mesh_dim: str | None  # "dp", "tp", "pp"; "*" the whole mesh; None: the call takes no mesh
    arguments: tuple[tuple[str, Any], ...]  # keyword -> value, in the order the call prints them
    why: str

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"unknown apply step {self.op!r}; one of {', '.join(OPS)}")

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.arguments)


@dataclass(frozen=True)
class Layout:
    """The mesh and the shares of each global batch, as data (``passes.lowering.lower.layout``; module doc)."""

    mesh: tuple[tuple[str, int], ...]  # (dim, ranks along it), outermost first (MESH_ORDER)
    flatten: tuple[tuple[str, tuple[str, ...]], ...]  # (name, the dims joined into it)
    data_axis: str  # the ranks along it train on different samples of the global batch
    sequence_axis: str | None  # the ranks along it train on different tokens of the same samples; None: whole samples
    loss_axis: str  # the step's logged loss is the mean over the ranks along it
    tokens_per_sample: int
    seq_len: int | None  # handed to the model file's example_batch (--seq-len); None: the file's own
    # the loss and its backward on the logits' vocabulary shards over tp (``runtime.train_step``, loss parallelism)
    loss_parallel: bool = False

    def __post_init__(self):
        dims = [name for name, _ in self.mesh]
        if tuple(d for d in MESH_ORDER if d in dims) != tuple(dims):
            raise ValueError(f"mesh dims {dims} are not in the order {MESH_ORDER}")
        known = set(dims) | {name for name, _ in self.flatten}
        for axis in (self.data_axis, self.sequence_axis, self.loss_axis):
            if axis is not None and axis not in known:
                raise ValueError(f"axis {axis!r} is neither a mesh dim nor a flattened one ({sorted(known)})")

    @property
    def world_size(self) -> int:
        size = 1
        for _, ranks in self.mesh:
            size *= ranks
        return size
