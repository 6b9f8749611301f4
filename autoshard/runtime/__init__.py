"""What emitted programs import at run time: thin glue around torch.distributed.

Each apply function does one step of a plan with PyTorch's own parts (``runtime.parallel``: DTensor
TP, ``checkpoint_wrapper``, FSDP2 ``fully_shard``, DDP, ZeroRedundancyOptimizer, pipelining); the
emitted program calls them in the order ``passes.lower`` gives, with the plan's decisions as constants.
"""

from autoshard.runtime.distributed import DistContext, init_distributed, mean_over, shutdown
from autoshard.runtime.data import global_batch, split_microbatches, take_shard
from autoshard.runtime.context_parallel import context_parallel, take_sequence_shard
from autoshard.runtime.model import build_model, load_model_file, model_fingerprint, strip_wrapper_names
from autoshard.runtime.parallel import (apply_ac, apply_ddp, apply_fsdp, apply_recompute, apply_steps, apply_tp,
                                        autocast, build_optimizer, build_schedule, grad_sync, split_pipeline,
                                        sync_batch_norm)
from autoshard.runtime.report import StepLog, finish, finish_with_state
from autoshard.runtime import faults  # emitted programs run main under runtime.faults.guard
from autoshard.runtime import tensor_parallel  # emitted programs name runtime.tensor_parallel.Conv1D*Parallel

__all__ = [
    "DistContext", "init_distributed", "mean_over", "shutdown", "global_batch", "split_microbatches", "take_shard",
    "context_parallel", "take_sequence_shard",
    "build_model", "load_model_file", "model_fingerprint", "strip_wrapper_names", "apply_ac", "apply_ddp",
    "apply_fsdp", "apply_recompute", "apply_steps", "apply_tp", "autocast", "build_optimizer", "build_schedule",
    "grad_sync", "split_pipeline", "sync_batch_norm", "StepLog", "finish", "finish_with_state", "tensor_parallel", "faults",
]
