"""What emitted programs import at run time: thin glue around torch.distributed.

Each function does one step of a plan with PyTorch's own parts (init_process_group,
DeviceMesh, DDP, ZeroRedundancyOptimizer, FSDP2 ``fully_shard``, ``checkpoint_wrapper``);
the emitted program calls them in order, with the plan's decisions written inline.
"""

from autoshard.runtime.distributed import DistContext, init_distributed, mean_over, shutdown
from autoshard.runtime.data import global_batch, split_microbatches, take_shard
from autoshard.runtime.model import build_model, load_model_file, model_fingerprint, strip_wrapper_names
from autoshard.runtime.parallel import (apply_ddp, apply_fsdp, apply_recompute, build_optimizer, grad_sync,
                                        apply_plan)
from autoshard.runtime.report import StepLog, finish, finish_with_state
from autoshard.runtime import faults  # emitted programs run main under runtime.faults.guard
from autoshard.runtime import tensor_parallel  # emitted programs name runtime.tensor_parallel.Conv1D*Parallel

__all__ = [
    "DistContext", "init_distributed", "mean_over", "shutdown", "global_batch", "split_microbatches", "take_shard",
    "build_model", "load_model_file", "model_fingerprint", "strip_wrapper_names", "apply_ddp", "apply_fsdp",
    "apply_recompute", "build_optimizer", "grad_sync", "apply_plan", "StepLog", "finish", "finish_with_state", "tensor_parallel", "faults",
]
