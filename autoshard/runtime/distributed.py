"""Process-group start-up: NCCL on GPUs, gloo on CPUs, one device per rank."""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self):
        """bf16 autocast on GPUs; fp32 (no autocast) on CPUs, so CPU runs match one process exactly."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


def init_distributed(expected_world_size: int | None = None, timeout_s: int = DEFAULT_TIMEOUT_S) -> DistContext:
    """Join the job torchrun started; check its size against the plan's."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if expected_world_size is not None and world_size != expected_world_size:
        raise SystemExit(f"error: this program was planned for {expected_world_size} ranks but was launched with "
                         f"{world_size}; launch it with torchrun --nproc-per-node {expected_world_size} (or re-plan)")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": device} if backend == "nccl" else {}))
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device)


def mean_over(value: torch.Tensor, group) -> float:
    """The mean of ``value`` over a process group (equal shards: the global mean)."""
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value.item() / dist.get_world_size(group)
