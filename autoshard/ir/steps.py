"""Apply steps: a plan lowered to the ordered calls that parallelize a model (``passes.lower``).

A step names one function of the runtime's applier (``runtime.parallel``), the mesh dimension it
runs over, its arguments (plain data: names, numbers, dicts of module paths) and why. The applier
executes the list (``runtime.parallel.apply_steps``); the code generator prints the same list as
calls (``passes.codegen``). Both take their order from the lowering alone.

    op                  SPMD plans                          pipeline plans
    apply_tp            DTensor styles per module           local shards + traceable collectives, before the split
    apply_ep            each rank keeps its experts; tokens reach them by all-to-all (one op the split traces)
    split_pipeline      -                                   this rank's stages (torch.distributed.pipelining)
    apply_ac            checkpoint_wrapper per block        the block's region of its stage graph, outlined
    sync_batch_norm     SyncBatchNorm over dp               -
    apply_fsdp          FSDP2 per block, then the root      FSDP2 per stage module
    apply_replicate     FSDP2's replicate per block, root   replicate per stage module (ZeRO-0 with tp or pp)
    apply_ddp           DDP with the plan's bucket size     -
    build_optimizer     AdamW / ZeroRedundancyOptimizer     one AdamW per stage
    build_schedule      -                                   torch's schedule (GPipe, 1F1B, interleaved, zero bubble)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OPS = ("apply_tp", "apply_ep", "split_pipeline", "apply_ac", "sync_batch_norm", "apply_fsdp", "apply_replicate", "apply_ddp",
       "build_optimizer", "build_schedule")
# What each op needs besides the plan's data: values of the run (the applier's keyword inputs, the
# emitted function's parameters of the same names).
RUN_INPUTS = {"split_pipeline": ("example_microbatch", "device"), "apply_ddp": ("device",),
              "build_optimizer": ("lr",), "build_schedule": ("loss_fn",)}
# What each op returns; the others return the (wrapped) model, or the stages after split_pipeline.
RESULTS = {"build_optimizer": "optimizer", "build_schedule": "schedule"}
WHOLE_MESH = "*"


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
