"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, resumable, never half-written.

Layout: ``DIR/step-00000012/`` holds the state after 12 steps (model, optimizer, step).
Each save writes ``DIR/.step-00000012.partial/`` first; rank 0 renames it into place only
after every rank has finished writing (a barrier), so a crash during a write leaves a
``.partial`` folder that ``latest`` ignores, and the previous checkpoint still loads.

Resuming is exact because the data of step t depends only on (seed, t) (runtime.data) and
weights and optimizer state are restored in full.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer

from autoshard.errors import AutoshardError

STEP_DIR = re.compile(r"step-(\d{8})")


def save(checkpoint_dir: str | Path, steps_done: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    """Write the state after ``steps_done`` steps; returns the final folder."""
    _refuse_zero1(optimizer)
    root = Path(checkpoint_dir)
    final = root / f"step-{steps_done:08d}"
    partial = root / f".step-{steps_done:08d}.partial"
    if dist.get_rank() == 0 and partial.exists():
        shutil.rmtree(partial)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "steps_done": torch.tensor(steps_done)},
             checkpoint_id=partial)
    dist.barrier()  # every rank has written its shards
    if dist.get_rank() == 0:
        partial.replace(final)
    dist.barrier()
    return final


def latest(checkpoint_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (``.partial`` folders are never complete)."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and (p / ".metadata").is_file())
    return done[-1] if done else None


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore model and optimizer in place from ``path``; returns the steps already done."""
    _refuse_zero1(optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "steps_done": torch.tensor(0)}
    dcp.load(state, checkpoint_id=Path(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["steps_done"])


def resume(checkpoint_dir: str | Path | None, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the newest complete checkpoint in ``checkpoint_dir`` if any; the step to start at."""
    if not checkpoint_dir:
        return 0
    found = latest(checkpoint_dir)
    return load(found, model, optimizer) if found else 0


def _refuse_zero1(optimizer) -> None:
    # ZeroRedundancyOptimizer keeps a rank-local partition that DCP's state-dict API cannot
    # read (it asks for consolidate_state_dict to one rank); refuse rather than pickle rank 0.
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise AutoshardError("checkpoints of ZeRO-1 plans (ZeroRedundancyOptimizer) are not supported yet; "
                             "re-plan with --zero 0, 2 or 3 to checkpoint")
