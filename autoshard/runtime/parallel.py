"""Apply a plan's data-parallel, ZeRO and recompute decisions with PyTorch's own parts.

    ZeRO-0   DistributedDataParallel (bucketed all-reduce overlapped with backward)
    ZeRO-1   DDP + ZeroRedundancyOptimizer (optimizer state sharded over dp)
    ZeRO-2   FSDP2 fully_shard(reshard_after_forward=False) per block, then the root
    ZeRO-3   FSDP2 fully_shard(reshard_after_forward=True) per block, then the root
    recompute  checkpoint_wrapper per block: "full" recomputes the block in backward,
               "selective" keeps matmul/attention outputs and recomputes the rest (op-level SAC)
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autoshard.runtime.model import get_block, sync_batch_norm

# Outputs that selective recompute keeps: the ops that cost FLOPs, not bytes (torchtitan's op-level SAC).
SAVE_IN_SELECTIVE = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default, torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def apply_recompute(model: nn.Module, blocks: list[str], mode: str | dict[str, str]) -> nn.Module:
    """Wrap each block in ``checkpoint_wrapper`` (in place); ``mode`` is none, selective or full, or a
    mode per block path (a mixed plan's ``recompute_blocks``)."""
    modes = mode if isinstance(mode, dict) else {path: mode for path in blocks}
    for path in blocks:
        if modes.get(path, "none") == "none":
            continue
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        wrapped = checkpoint_wrapper(get_block(model, path), checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                     **_selective_kwargs(modes[path]))
        parent.register_module(child, wrapped)
    return model


def apply_ddp(model: nn.Module, device: torch.device, bucket_cap_mb: float, group=None) -> nn.Module:
    device_ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True,
               process_group=group)


def apply_fsdp(model: nn.Module, mesh, blocks: list[str], reshard_after_forward: bool) -> nn.Module:
    """FSDP2 with each block a unit, then the root (embeddings, head); bf16 compute on GPUs."""
    policy = _mixed_precision(mesh.device_type)
    for path in blocks:
        fully_shard(get_block(model, path), mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return model


def build_optimizer(model: nn.Module, zero_stage: int, lr: float, group=None) -> torch.optim.Optimizer:
    """AdamW; ZeRO-1 shards its state with ZeroRedundancyOptimizer (FSDP shards it for 2 and 3)."""
    if zero_stage == 1:
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr,
                                       process_group=group)
    return torch.optim.AdamW(model.parameters(), lr=lr)


def grad_sync(model: nn.Module, enabled: bool):
    """DDP: skip the all-reduce on all but the last micro-batch. FSDP2 reduce-scatters every
    micro-batch so gradients stay sharded (ZeRO-2/3 memory), so nothing to skip."""
    if isinstance(model, DDP) and not enabled:
        return model.no_sync()
    return contextlib.nullcontext()


def apply_plan(model: nn.Module, plan, mesh, device: torch.device, lr: float):
    """The Python-API path: the same steps an emitted program takes, chosen from ``plan``."""
    from autoshard.runtime.tensor_parallel import apply_tensor_parallel

    blocks = list(plan.blocks)
    apply_tensor_parallel(model, mesh["tp"], dict(plan.tensor_parallel))
    apply_recompute(model, blocks, plan.recompute_blocks or plan.recompute)
    dp_mesh = mesh["dp"]
    if plan.mesh.dp == 1:
        return model, torch.optim.AdamW(model.parameters(), lr=lr)
    model = sync_batch_norm(model, dp_mesh.get_group())  # BatchNorm over all dp ranks' samples
    if plan.zero_stage >= 2:
        model = apply_fsdp(model, dp_mesh, blocks, reshard_after_forward=plan.zero_stage == 3)
    else:
        model = apply_ddp(model, device, plan.ddp_bucket_cap_mb, group=dp_mesh.get_group())
    return model, build_optimizer(model, plan.zero_stage, lr, group=dp_mesh.get_group())


def _selective_kwargs(mode: str) -> dict:
    if mode == "selective":
        return {"context_fn": partial(create_selective_checkpoint_contexts, _selective_policy)}
    return {}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE_IN_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def _mixed_precision(device_type: str) -> MixedPrecisionPolicy:
    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()
