"""One training step's forward and backward on an SPMD plan's rank: the emitted program's loop and
``autoshard.parallelize``'s ``train_step`` both call it, so the two cannot drift.

For this rank's share of a step's global batch, cut into m micro-batches (x_j, y_j):

    for j in 0..m-1:
        x_j, y_j = its chunk of every sequence along the sequence axis (context parallelism; else as is)
        with gradients synchronised only when j = m - 1, ring attention over the sequence axis,
             the precision's autocast:
            ℓ_j = loss(model(*x_j), y_j) / m
        backward of scale · ℓ_j            (scale: fp16's loss scale; 1 otherwise)
    returns Σ_j ℓ_j (detached, this rank's)

The gradients left behind are, after the wrapper's reduction over the data axes, the one-process gradient of
the global batch's mean loss; ``runtime.mean_over(Σ_j ℓ_j, loss axis)`` is that mean.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from autoshard.runtime.context_parallel import context_parallel, take_sequence_shard
from autoshard.runtime.data import split_microbatches
from autoshard.runtime.parallel import autocast, cast_inputs, grad_sync


def forward_backward(
    model: nn.Module,
    inputs: tuple,
    targets: torch.Tensor,
    loss_fn: Callable,
    mesh,
    num_microbatches: int,
    sequence_axis: str | None,
    tokens_per_sample: int,
    precision: str,
    scaler=None,
    before_each: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Forward and backward of each of ``num_microbatches`` micro-batches of this rank's samples (module doc);
    returns the sum of their losses, each divided by ``num_microbatches``. ``scaler``: ``runtime.grad_scaler``'s
    (fp16 scales the loss before backward; a disabled scaler, or None, passes it through). ``before_each`` is
    called before each micro-batch's forward (``autoshard dryrun`` resets its memory tracker's records there)."""
    step_loss = torch.zeros((), device=targets.device)
    for j, (x, y) in enumerate(split_microbatches(inputs, targets, num_microbatches)):
        x, y = take_sequence_shard(x, y, mesh, sequence_axis, tokens_per_sample)
        x = cast_inputs(x, precision)  # bf16-pure: floating inputs in the weights' dtype
        if before_each is not None:
            before_each()
        with (
            grad_sync(model, enabled=j == num_microbatches - 1),
            context_parallel(mesh, sequence_axis, tokens_per_sample),
        ):
            with autocast(precision, targets.device):
                loss = loss_fn(model(*x), y) / num_microbatches  # the mean over this rank's tokens
            (loss if scaler is None else scaler.scale(loss)).backward()
        step_loss += loss.detach()
    return step_loss
