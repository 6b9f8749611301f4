"""Tensor parallelism inside pipeline stages: local shards and collectives that survive tracing.

Why not ``parallelize_module`` here. ``torch.distributed.pipelining.pipeline()`` splits a model by
tracing it with ``torch.export``: each stage becomes a GraphModule of aten calls, so the module
hooks that DTensor's ParallelStyles install never run, and a DTensor parameter would meet plain
activations in ``aten.linear``. torchtitan avoids this with a hand split that needs the model's
cooperation (layers it can delete). Instead, before the split each sharded module becomes a
module holding only this rank's shard, and the Megatron communication points are custom ops
(``torch.library.custom_op``), which ``torch.export`` keeps as single calls with their own
autograd, so the traced stages still communicate::

    f = tp_copy     forward: identity          backward: all-reduce over tp   (before a column split)
    g = tp_reduce   forward: all-reduce        backward: identity             (after a row split)
        tp_gather   forward: all-gather dim −1  backward: this rank's slice    (a gathered column split)

Styles (the planner's names, as in ``runtime.tensor_parallel``), rank k of t::

    colwise           W[k·o/t:(k+1)·o/t, :], b likewise     y_k = x W_kᵀ + b_k           (input via f)
    colwise-gather    the same, then tp_gather               y = [y_0 … y_{t−1}]
    rowwise           W[:, k·i/t:(k+1)·i/t], b whole        y = g(x_k W_kᵀ) + b
    vocab-parallel-   rows [k·V/t, (k+1)·V/t) of the table   y = g(E_k[id − k·V/t] · 1[id in range])
      embedding
    conv1d-colwise    transformers Conv1D (weight (in, out)): W[:, k·o/t:(k+1)·o/t], b likewise
    conv1d-rowwise    W[k·i/t:(k+1)·i/t, :], b whole
    sharded-input-dimN  parameters whole, input this rank's shard; each parameter used through f,
                      so its gradient (partial: this rank's heads only) is summed over tp

Every TP rank builds the same seeded model and keeps its slice, so no weights are sent. Module
and parameter names do not change; ``shard_dims`` says which dimension of which parameter is
split, so the full tensors can be rebuilt by concatenating the tp ranks' shards in rank order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._C._distributed_c10d import _resolve_process_group

from autoshard.errors import AutoshardError
from autoshard.ir.decisions import tp_style

# ---------------------------------------------------------------------------- traceable collectives


@torch.library.custom_op("autoshard::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Megatron's f: the input of a column-parallel layer; its gradient is summed over tp."""
    return x.clone()


@torch.library.custom_op("autoshard::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Megatron's g: the sum over tp of row-parallel partial outputs; its gradient passes through."""
    out = x.clone()
    dist.all_reduce(out, group=_resolve_process_group(group_name))
    return out


@torch.library.custom_op("autoshard::tp_gather", mutates_args=())
def tp_gather(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The tp ranks' slices of the last dimension, concatenated in rank order."""
    group = _resolve_process_group(group_name)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


@tp_copy.register_fake
def _(x, group_name):
    return torch.empty_like(x)


@tp_reduce.register_fake
def _(x, group_name):
    return torch.empty_like(x)


@tp_gather.register_fake
def _(x, group_name):
    size = dist.get_world_size(_resolve_process_group(group_name))
    return x.new_empty((*x.shape[:-1], x.shape[-1] * size))


def _keep_group(ctx, inputs, output) -> None:
    ctx.group_name = inputs[1]


def _copy_backward(ctx, grad):
    return tp_reduce(grad, ctx.group_name), None


def _reduce_backward(ctx, grad):
    return grad, None


def _gather_backward(ctx, grad):
    group = _resolve_process_group(ctx.group_name)
    return grad.chunk(dist.get_world_size(group), dim=-1)[dist.get_rank(group)].contiguous(), None


tp_copy.register_autograd(_copy_backward, setup_context=_keep_group)
tp_reduce.register_autograd(_reduce_backward, setup_context=_keep_group)
tp_gather.register_autograd(_gather_backward, setup_context=_keep_group)


# ---------------------------------------------------------------------------- local-shard modules


class ShardedLinear(nn.Module):
    """nn.Linear holding rank k's shard: column split (weight rows) or row split (weight columns)."""

    def __init__(self, linear: nn.Linear, style: str, rank: int, size: int, group_name: str):
        super().__init__()
        self.style, self.group_name = style, group_name
        split_dim = 1 if style == "rowwise" else 0
        self.weight = nn.Parameter(_shard(linear.weight, split_dim, rank, size))
        bias = linear.bias
        if bias is not None:
            bias = bias.detach().clone() if style == "rowwise" else _shard(bias, 0, rank, size)
        self.bias = nn.Parameter(bias) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "rowwise":
            y = tp_reduce(F.linear(x, self.weight), self.group_name)
            return y + self.bias if self.bias is not None else y
        y = F.linear(tp_copy(x, self.group_name), self.weight, self.bias)
        return tp_gather(y, self.group_name) if self.style == "colwise-gather" else y


class ShardedConv1D(nn.Module):
    """transformers' Conv1D (y = x W + b, weight (in, out)) holding rank k's shard."""

    def __init__(self, conv: nn.Module, style: str, rank: int, size: int, group_name: str):
        super().__init__()
        self.style, self.group_name = style, group_name
        rowwise = style == "conv1d-rowwise"
        self.weight = nn.Parameter(_shard(conv.weight, 0 if rowwise else 1, rank, size))
        bias = conv.bias.detach().clone() if rowwise else _shard(conv.bias, 0, rank, size)
        self.bias = nn.Parameter(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "conv1d-colwise":
            x = tp_copy(x, self.group_name)
        flat = x.reshape(-1, x.shape[-1]) @ self.weight
        y = flat.view(*x.shape[:-1], self.weight.shape[1])
        if self.style == "conv1d-rowwise":
            y = tp_reduce(y, self.group_name)
        return y + self.bias


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding holding rows [k·V/t, (k+1)·V/t); ids outside them give zeros, summed over tp."""

    def __init__(self, embedding: nn.Embedding, rank: int, size: int, group_name: str):
        super().__init__()
        if embedding.max_norm is not None or embedding.sparse:
            raise AutoshardError(
                "tensor parallel: an nn.Embedding with max_norm or sparse=True cannot be split "
                "by vocabulary; keep it replicated"
            )
        self.group_name = group_name
        self.weight = nn.Parameter(_shard(embedding.weight, 0, rank, size))
        rows = self.weight.shape[0]
        self.first_id = rank * rows
        pad = embedding.padding_idx
        self.local_padding_idx = pad - self.first_id if pad is not None and 0 <= pad - self.first_id < rows else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first_id
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local * mine, self.weight, self.local_padding_idx)
        return tp_reduce(rows * mine.unsqueeze(-1).to(rows.dtype), self.group_name)


def _shard(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if tensor.shape[dim] % size:
        raise AutoshardError(
            f"tensor parallel: dimension {dim} of a {tuple(tensor.shape)} weight does not split "
            f"into {size}; re-plan with a tp that divides it"
        )
    return tensor.detach().chunk(size, dim=dim)[rank].clone()


# ---------------------------------------------------------------------------- applying a plan


def shard_for_tracing(model: nn.Module, tp_group: dist.ProcessGroup, styles: dict[str, str]) -> dict[str, int]:
    """Replace each module named in ``styles`` by its local shard (in place), ready for ``pipeline()``.

    Returns ``shard_dims``: parameter name → the dimension split over tp (absent: whole on every rank).
    """
    rank, size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    name = tp_group.group_name
    for path, style in sorted(styles.items()):
        if style == "replicate":
            continue
        original = model.get_submodule(path)
        local = _keep_attributes(_local_module(path, original, style, rank, size, name), original)
        parent, _, child = path.rpartition(".")
        (model.get_submodule(parent) if parent else model).register_module(child, local)
    return shard_dims(model, styles)


def _keep_attributes(local: nn.Module, original: nn.Module) -> nn.Module:
    """``local`` with the original module's own attributes (``in_features``, ``num_embeddings``, ``padding_idx``,
    ...), as ``parallelize_module`` leaves them on a module of DTensors: the model's code may read them (Whisper's
    encoder takes ``torch.arange(self.embed_positions.num_embeddings)``), and the TP proof checked it with them."""
    for name, value in vars(original).items():
        if not name.startswith("_") and name != "training" and name not in vars(local):
            setattr(local, name, value)
    return local


def shard_dims(model: nn.Module, styles: dict[str, str]) -> dict[str, int]:
    """Parameter name -> the dimension split over tp, for the modules ``styles`` shards (a missing bias is
    left out)."""
    return {
        f"{path}.{p}": d
        for path, style in sorted(styles.items())
        if style != "replicate"
        for p, d in param_shard_dims(style).items()
        if getattr(model.get_submodule(path), p, None) is not None
    }


def _params_through_copy(module: nn.Module, group_name: str) -> nn.Module:
    """``module`` (in place) running with each parameter p replaced by tp_copy(p): the same values, and in
    backward the tp ranks' partial gradients summed. ``_reparametrize_module`` is what
    ``torch.func.functional_call`` swaps parameters with; calling the class's forward inside it keeps the
    module, its names and its parameters as they are (functional_call would re-enter this forward)."""
    from torch.nn.utils.stateless import _reparametrize_module

    class_forward = type(module).forward

    def forward(*args, **kwargs):
        swapped = {name: tp_copy(p, group_name) for name, p in module.named_parameters()}
        with _reparametrize_module(module, swapped):
            return class_forward(module, *args, **kwargs)

    module.forward = forward
    return module


def param_shard_dims(style: str) -> dict[str, int]:
    """Which of a style's parameters are split, and along which dimension (``ir.decisions.TP_STYLES``)."""
    return tp_style(style).param_shard_dims


def _local_module(path: str, module: nn.Module, style: str, rank: int, size: int, group_name: str) -> nn.Module:
    if style.startswith("sharded-input-dim"):
        return _params_through_copy(module, group_name)
    if style.startswith("conv1d-") and type(module).__name__ == "Conv1D":
        return ShardedConv1D(module, style, rank, size, group_name)
    if style == "vocab-parallel-embedding" and isinstance(module, nn.Embedding):
        return VocabParallelEmbedding(module, rank, size, group_name)
    if style in ("colwise", "colwise-gather", "rowwise") and isinstance(module, nn.Linear):
        return ShardedLinear(module, style, rank, size, group_name)
    raise AutoshardError(
        f"tensor parallel: {path} is a {type(module).__name__}, which style {style!r} does not fit; re-plan this model"
    )
