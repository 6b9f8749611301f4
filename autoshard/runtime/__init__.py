"""What emitted programs import at run time: thin glue around torch.distributed.

Each apply function does one step of a plan with PyTorch's own parts (``runtime.parallel``: DTensor
TP, ``checkpoint_wrapper``, FSDP2 ``fully_shard``, DDP, ZeroRedundancyOptimizer, pipelining); the
emitted program calls them in the order ``passes.lowering.lower`` gives, with the plan's decisions as constants.

Importing this package imports torch and torch.distributed only; the names of the modules that bring
more of torch (DTensor, FSDP2, DCP, pipelining: seconds of CPU per process) are imported on first use
(``__getattr__``): ``runtime.apply_fsdp``, ``runtime.finish``, ``runtime.tensor_parallel``, as a program
or ``from autoshard.runtime import ...`` names them.
"""

import importlib

from autoshard.runtime import faults  # emitted programs run main under runtime.faults.guard

# the function shadows its module's name here, so it is bound now, as the module is imported
from autoshard.runtime.context_parallel import context_parallel, take_sequence_shard
from autoshard.runtime.data import DataSource, RankBatches, global_batch, split_microbatches, take_samples, take_shard
from autoshard.runtime.distributed import DistContext, build_mesh, init_distributed, mean_over, shutdown
from autoshard.runtime.model import (
    build_meta_model,
    build_model,
    load_model_file,
    model_fingerprint,
    strip_wrapper_names,
)

_LAZY = {  # name: the module that defines it, imported on first use
    **dict.fromkeys(
        (
            "apply_ac",
            "apply_ddp",
            "apply_fsdp",
            "apply_recompute",
            "apply_steps",
            "apply_tp",
            "autocast",
            "build_optimizer",
            "cast_inputs",
            "cast_params",
            "grad_scaler",
            "build_schedule",
            "grad_sync",
            "split_pipeline",
            "sync_batch_norm",
        ),
        "autoshard.runtime.parallel",
    ),
    **dict.fromkeys(("StepLog", "finish", "read_weights"), "autoshard.runtime.report"),
    "forward_backward": "autoshard.runtime.train_step",
    "compiled_loss": "autoshard.runtime.compiled",
}
# emitted programs name runtime.tensor_parallel.Conv1D*Parallel; any submodule is imported as it is named
_SUBMODULES = (
    "checkpoint",
    "context_parallel",
    "data",
    "distributed",
    "expert_parallel",
    "faults",
    "model",
    "parallel",
    "parallelized",
    "pipeline_parallel",
    "pipeline_skips",
    "randomness",
    "recipe",
    "report",
    "safe_load",
    "selective",
    "stage_recompute",
    "tensor_parallel",
    "tensor_parallel_stages",
    "train_step",
)

__all__ = [
    "DistContext",
    "build_mesh",
    "init_distributed",
    "mean_over",
    "shutdown",
    "global_batch",
    "split_microbatches",
    "take_samples",
    "take_shard",
    "DataSource",
    "RankBatches",
    "context_parallel",
    "take_sequence_shard",
    "build_meta_model",
    "build_model",
    "load_model_file",
    "model_fingerprint",
    "strip_wrapper_names",
    "apply_ac",
    "apply_ddp",
    "apply_fsdp",
    "apply_recompute",
    "apply_steps",
    "apply_tp",
    "autocast",
    "build_optimizer",
    "build_schedule",
    "cast_inputs",
    "cast_params",
    "grad_scaler",
    "grad_sync",
    "split_pipeline",
    "sync_batch_norm",
    "StepLog",
    "finish",
    "read_weights",
    "tensor_parallel",
    "faults",
    "forward_backward",
    "compiled_loss",
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
