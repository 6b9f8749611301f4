"""Loss parallelism's two runtime pieces, shared by the SPMD step (``runtime.train_step``) and the pipeline's last
stage (``runtime.pipeline_parallel``): torch's ``loss_parallel()`` around the loss, and the loss it returns (a
replicated DTensor) made a local tensor. Kept apart so that neither importer depends on the other."""

from __future__ import annotations

import contextlib

import torch

from autoshard.errors import AutoshardError


def vocabulary_shards(enabled: bool):
    """torch's ``loss_parallel()`` context where ``enabled`` (module doc, loss parallelism), else nothing."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def local_loss(loss: torch.Tensor, loss_parallel: bool) -> torch.Tensor:
    """With ``loss_parallel`` the loss computed on vocabulary shards comes back a replicated DTensor: its local
    value, the same on every rank (its backward hands the gradient back as the replicated DTensor); a loss that
    never read the sharded logits (a plain tensor) is refused. Without, the loss as it is."""
    from torch.distributed.tensor import DTensor, Replicate

    if not loss_parallel:
        return loss
    if not isinstance(loss, DTensor) or not all(isinstance(p, Replicate) for p in loss.placements):
        raise AutoshardError(
            "loss parallelism: the loss did not come from the logits' vocabulary shards (got "
            f"{type(loss).__name__}); the model's output is not what the plan proved; re-plan with --loss-parallel off"
        )
    return loss.to_local()
