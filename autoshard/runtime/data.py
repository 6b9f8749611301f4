"""Batches: every rank draws the same global batch from the model file and takes its share.

Drawing the global batch from ``example_batch`` under a seed derived from (seed, step), with
torch's RNG state saved and restored around it, gives every rank and the single-process
reference the very same data, which is what makes ``autoshard verify`` exact.
"""

from __future__ import annotations

from typing import Any

import torch

from autoshard.modelfile import ModelFile
from autoshard.runtime.randomness import drawing_freely

STEP_SEED_STRIDE = 1_000_003  # a prime, so (seed, step) pairs do not collide for small seeds


def global_batch(model_file: ModelFile, batch_size: int, seed: int, step: int):
    """``(inputs, targets)`` of the whole step, identical on every rank."""
    with torch.random.fork_rng(devices=[]), drawing_freely():  # drawn as usual where random ops are fixed
        torch.manual_seed(seed * STEP_SEED_STRIDE + step)
        return model_file.example_batch(batch_size)


def take_samples(batch, mesh, axis: str, device: torch.device):
    """This rank's share of the samples: the slice of the batch dimension of its place along the mesh dim
    ``axis`` (the plan's data axis, "dp"); the ranks along the other dims take the same samples."""
    return take_shard(batch, mesh.get_local_rank(axis), mesh[axis].size(), device)


def take_shard(batch, index: int, count: int, device: torch.device):
    """Rank ``index`` of ``count`` takes its contiguous slice of the batch dimension."""
    inputs, targets = batch
    return tuple(_slice(t, index, count).to(device) for t in inputs), _slice(targets, index, count).to(device)


def split_microbatches(inputs: tuple, targets: Any, count: int):
    """``count`` equal micro-batches of (inputs, targets)."""
    input_chunks = [t.chunk(count) for t in inputs]
    target_chunks = targets.chunk(count)
    return [(tuple(c[i] for c in input_chunks), target_chunks[i]) for i in range(count)]


def _slice(t: torch.Tensor, index: int, count: int) -> torch.Tensor:
    size = t.shape[0] // count
    return t[index * size:(index + 1) * size]
