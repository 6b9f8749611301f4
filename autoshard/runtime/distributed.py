"""Process-group start-up: NCCL on GPUs, gloo on CPUs, one device per rank."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import os
import signal
import sys
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


def init_distributed(
    expected_world_size: int | None = None, timeout_s: int = DEFAULT_TIMEOUT_S, host_collectives: bool = False
) -> DistContext:
    """Join the job torchrun started; check its size against the plan's. ``host_collectives`` (host offload): on
    GPUs the group gets gloo for CPU tensors beside NCCL ("cuda:nccl,cpu:gloo", torchtitan's way), since the
    offloaded gradients' norm is taken on the host (``runtime.recipe.clip_grad_norm``)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if expected_world_size is not None and world_size != expected_world_size:
        print(
            f"error: this program was planned for {expected_world_size} ranks but was launched with {world_size}; "
            f"launch it with torchrun --nproc-per-node {expected_world_size} (or re-plan)",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2)  # a user error, as in the CLI
    faulthandler.enable()  # a rank killed by a signal (SIGSEGV, SIGABRT) prints its Python stacks
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        die_with_parent(signal.SIGKILL)  # torchrun gone (killed outright): no orphan rank keeps training
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo" if host_collectives else "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend,
            timeout=timeout,
            **_attempt_store(world_size, timeout),
            **({"device_id": device} if device.type == "cuda" else {}),
        )
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int, parent_pid: str | int | None = None) -> None:
    """Have the kernel send this process ``sig`` when its parent ends (Linux ``prctl(PR_SET_PDEATHSIG)``;
    elsewhere nothing). ``parent_pid``: the parent it should have; if it is gone already (or, without it,
    this process was handed to init), ``sig`` comes now."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    parent = os.getppid()
    if (parent_pid is not None and parent != int(parent_pid)) or (parent_pid is None and parent == 1):
        os.kill(os.getpid(), sig)


def _attempt_store(world_size: int, timeout: datetime.timedelta) -> dict:
    """Under torchrun, a store whose keys belong to this attempt only (``TORCHELASTIC_RESTART_COUNT``).

    torch's ``env://`` reuses torchrun's agent store across restarts with no per-attempt prefix,
    so a restarted gloo group can read the dead attempt's addresses and fail to connect
    ("Connection refused", seen on every restart after a SIGKILL). A ``PrefixStore`` per attempt
    over the same TCP store keeps the attempts apart. Outside torchrun: torch's default.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return {}
    rank = int(os.environ["RANK"])
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=not agent_hosts and rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )
    return {"store": dist.PrefixStore(f"autoshard/attempt-{attempt}", base), "rank": rank, "world_size": world_size}


def build_mesh(device_type: str, dims: dict[str, int], flatten: dict[str, tuple[str, ...]]):
    """The device mesh: ``dims`` (name -> ranks along it, outermost first), then each of ``flatten``
    (name -> the dims it joins) flattened into one dim of that name (``DeviceMesh._flatten``), which
    ``mesh[name]`` and ``mesh.get_group(name)`` then give."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    for name, joined in flatten.items():
        mesh[tuple(joined)]._flatten(name)
    return mesh


def shutdown() -> None:
    """End this rank once its work is done: destroy the process groups, flush, exit 0.

    The interpreter's own teardown is skipped (``os._exit``). After a finished CPU job, gloo's
    threads occasionally abort that teardown ("terminate called without an active exception",
    SIGABRT after the last step and the metrics were written; on a 2-core machine about one
    launch in ten of a hand-written DDP script that ends with ``destroy_process_group``), which
    torchrun reports as a failed job and, with restarts allowed, runs again.
    ``destroy_process_group`` only unregisters the groups: the mesh, FSDP and DDP still hold
    them, so their C++ side (worker threads, pending work holding tensors) is destroyed during
    interpreter finalization, when it can no longer take the GIL (pytorch/pytorch#179291).
    Nothing is lost by skipping it: every file the program writes is complete and renamed into
    place before this point, and the output streams are flushed here.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def mean_over(value: torch.Tensor, group) -> float:
    """The mean of ``value`` over a process group (equal shards: the global mean)."""
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value.item() / dist.get_world_size(group)
