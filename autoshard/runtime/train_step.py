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

**Loss parallelism** (``loss_parallel``: the plan's output projection leaves its logits a DTensor sharded on the
vocabulary over tp): ℓ_j and its backward run under ``torch.distributed.tensor.parallel.loss_parallel()``, so
``F.cross_entropy`` computes on the vocabulary shards, per token t with logits z_t split over the tp ranks,

    m_t = max_r max_{v∈V_r} z_tv          (all-reduce max)
    Z_t = Σ_r Σ_{v∈V_r} exp(z_tv − m_t)   (all-reduce sum)
    ℓ_t = log Z_t + m_t − z_{t,y_t}       (the target logit: all-reduce sum of the one rank holding it)

and its gradient softmax(z_t) − onehot(y_t) stays on each rank's shard. ℓ_j comes back a replicated DTensor:
its local value (the same on every tp rank) is what the loop adds up and scales.

The gradients left behind are, after the wrapper's reduction over the data axes, the one-process gradient of
the global batch's mean loss; ``runtime.mean_over(Σ_j ℓ_j, loss axis)`` is that mean.

**Partial gradients, settled once.** A replicated parameter that reads sharded activations (the norms of
sequence parallelism) gets its gradient from DTensor as ``Partial``: each TP rank holds a summand. Left so, every
op of the optimizer that reads it (AdamW's ``lerp_``, ``addcmul_``, the norm for clipping) redistributes it
again, one all-reduce per tensor per op: on 2 CPU ranks 55 all-reduces per step for the example GPT's 18 norm
tensors, 90 of its 200 ms. ``settle_partial_grads`` sums them over their mesh dimension after the last
micro-batch, in one all-reduce per (mesh dimension, reduce op, dtype), and leaves them ``Replicate``: the values
DTensor's own redistribution gives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from autoshard.runtime.context_parallel import context_parallel, take_sequence_shard
from autoshard.runtime.data import split_microbatches
from autoshard.runtime.loss_shards import local_loss, vocabulary_shards
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
    loss_parallel: bool = False,
) -> torch.Tensor:
    """Forward and backward of each of ``num_microbatches`` micro-batches of this rank's samples (module doc);
    returns the sum of their losses, each divided by ``num_microbatches``. ``scaler``: ``runtime.grad_scaler``'s
    (fp16 scales the loss before backward; a disabled scaler, or None, passes it through). ``before_each`` is
    called before each micro-batch's forward (``autoshard dryrun`` resets its memory tracker's records there).
    ``loss_parallel``: the loss and its backward on the logits' vocabulary shards (module doc)."""
    step_loss = torch.zeros((), device=targets.device)
    for j, (x, y) in enumerate(split_microbatches(inputs, targets, num_microbatches)):
        x, y = take_sequence_shard(x, y, mesh, sequence_axis, tokens_per_sample)
        x = cast_inputs(x, precision)  # bf16-pure: floating inputs in the weights' dtype
        if before_each is not None:
            before_each()
        with (
            grad_sync(model, enabled=j == num_microbatches - 1),
            context_parallel(mesh, sequence_axis, tokens_per_sample),
            vocabulary_shards(loss_parallel),
        ):
            with autocast(precision, targets.device):
                # the mean over this rank's tokens
                loss = local_loss(loss_fn(model(*x), y), loss_parallel) / num_microbatches
            (loss if scaler is None else scaler.scale(loss)).backward()
        step_loss += loss.detach()
    settle_partial_grads(model)
    return step_loss


def settle_partial_grads(model: nn.Module) -> int:
    """Every gradient DTensor left ``Partial`` made ``Replicate``, summed over its mesh dimension in one
    all-reduce per (mesh, dimension, reduce op, dtype) (module doc); returns how many gradients it settled. A
    DTensor's reduce ops are "sum", "avg", "max", "min" (``Partial.reduce_op``); the all-reduce takes the same.
    This is DTensor's own Partial → Replicate redistribution, done once and bucketed (torch has no bucketed
    redistribution of many DTensors)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    buckets: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
            dims = tuple((i, pl.reduce_op) for i, pl in enumerate(g.placements) if isinstance(pl, Partial))
            buckets.setdefault((id(g.device_mesh), dims, g.dtype), []).append(p)
    for (_, dims, _), params in buckets.items():
        grads = [p.grad for p in params]
        mesh = grads[0].device_mesh
        flat = torch.cat([g.to_local().reshape(-1) for g in grads])
        for dim, op in dims:
            _all_reduce(flat, op, mesh.get_group(dim))
        placements = [tuple(Replicate() if isinstance(pl, Partial) else pl for pl in g.placements) for g in grads]
        for p, g, placed, local in zip(params, grads, placements, _split_like(flat, grads)):
            p.grad = DTensor.from_local(local, mesh, placed, run_check=False, shape=g.shape, stride=g.stride())
    return sum(len(params) for params in buckets.values())


def _all_reduce(flat: torch.Tensor, op: str, group) -> None:
    import torch.distributed as dist

    if op == "avg":  # gloo has no AVG: sum, then divide, as DTensor's Partial("avg") does on gloo
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat /= dist.get_world_size(group)
        return
    dist.all_reduce(
        flat, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op], group=group
    )


def _split_like(flat: torch.Tensor, grads: list) -> list[torch.Tensor]:
    out, start = [], 0
    for g in grads:
        local = g.to_local()
        out.append(flat[start : start + local.numel()].view_as(local).clone())
        start += local.numel()
    return out
