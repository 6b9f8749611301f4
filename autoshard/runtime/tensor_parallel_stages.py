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

Sequence parallelism (Megatron-LM's, Korthikanti et al. 2022) adds four, each along the sequence dim d::

        sp_gather   forward: all-gather dim d   backward: reduce-scatter dim d  (readers' gradients partial)
                                                 or this rank's slice           (readers' gradients whole)
        sp_scatter  forward: reduce-scatter d   backward: all-gather dim d      (after a row split)
        sp_split    forward: this rank's slice  backward: all-gather dim d      (replicated code → shard)

so between the parallel linears each rank holds its 1/t of the tokens, and a stage boundary there
carries 1/t of them (the traced shapes are the shards': each op's fake kernel divides dim d).

Styles (the planner's names, as in ``runtime.tensor_parallel``), rank k of t::

    colwise           W[k·o/t:(k+1)·o/t, :], b likewise     y_k = x W_kᵀ + b_k           (input via f)
    colwise-gather    the same, then tp_gather               y = [y_0 … y_{t−1}]
    colwise-loss-     the same, no gather: the last stage's     y_k, this rank's vocabulary shard, which the
      parallel        output (loss parallelism)                 loss reads as a Shard(-1) DTensor
                                                              (``pipeline_parallel`` module doc)
    rowwise           W[:, k·i/t:(k+1)·i/t], b whole        y = g(x_k W_kᵀ) + b
    vocab-parallel-   rows [k·V/t, (k+1)·V/t) of the table   y = g(E_k[id − k·V/t] · 1[id in range])
      embedding
    conv1d-colwise    transformers Conv1D (weight (in, out)): W[:, k·o/t:(k+1)·o/t], b likewise
    conv1d-rowwise    W[k·i/t:(k+1)·i/t, :], b whole
    sharded-input-dimN  parameters whole, input this rank's shard; each parameter used through f,
                      so its gradient (partial: this rank's heads only) is summed over tp

The sequence-parallel styles (``ir.decisions``' second table), the same shards with the sequence ops::

    colwise-seq-input-dimd          y_k = sp_gather(x) W_kᵀ + b_k, no f: the gather's backward reduce-scatters
    colwise-gather-seq-input-dimd   the same, then tp_gather
    colwise-loss-parallel-seq-      the same, no gather (loss parallelism)
      input-dimd
    rowwise-seq-output-dimd         y = sp_scatter(x_k W_kᵀ) + f(b): the bias meets this rank's tokens only,
                                    so its gradient is summed over tp
    vocab-parallel-embedding-       sp_scatter in place of g
      seq-output-dimd
    conv1d-*-seq-*-dimd             as the two linear ones, for transformers' Conv1D
    gather-seq-input-dimd           a replicated module: its first positional input sp_gather'd (slice back)
    scatter-seq-output-dimd         a replicated module: its output sp_split
    gather-seq-module-input-dimd    a module whose colwise linears read its input: its first tensor argument
                                    sp_gather'd once (reduce-scatter back); those linears then take no f, as
                                    DTensor's ColwiseParallel takes the gathered Replicate DTensor as it is (a
                                    trace where none of them read it as it is is refused)
    scatter-seq-input-dimd          a block: its first positional input sp_split

Every TP rank builds the same seeded model and keeps its slice, so no weights are sent. Module
and parameter names do not change; ``shard_dims`` says which dimension of which parameter is
split, so the full tensors can be rebuilt by concatenating the tp ranks' shards in rank order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._C._distributed_c10d import _resolve_process_group

from autoshard.errors import AutoshardError
from autoshard.ir.decisions import LOSS_PARALLEL, SHARDED_INPUT, tp_style

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


@torch.library.custom_op("autoshard::sp_gather", mutates_args=())
def sp_gather(x: torch.Tensor, dim: int, partial_grad: bool, group_name: str) -> torch.Tensor:
    """The tp ranks' slices of the sequence dim ``dim`` concatenated in rank order (Megatron's
    gather_from_sequence_parallel_region); backward: the gradient reduce-scattered where its readers' gradients
    are partial sums (``partial_grad``: column-parallel linears), else this rank's slice of it."""
    return _all_gather(x, dim, _resolve_process_group(group_name))


@torch.library.custom_op("autoshard::sp_scatter", mutates_args=())
def sp_scatter(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """The tp ranks' partial sums summed, this rank keeping its slice of dim ``dim`` (Megatron's
    reduce_scatter_to_sequence_parallel_region); backward: the gradient all-gathered."""
    return _reduce_scatter(x, dim, _resolve_process_group(group_name))


@torch.library.custom_op("autoshard::sp_split", mutates_args=())
def sp_split(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """This rank's slice of dim ``dim`` of a value every tp rank holds whole (Megatron's
    scatter_to_sequence_parallel_region); backward: the gradient all-gathered."""
    group = _resolve_process_group(group_name)
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].clone()


def _all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Σ over the group of ``x``, rank k keeping slice k of dim ``dim``: one reduce-scatter on dim 0 of ``x``
    with ``dim`` moved first."""
    size = dist.get_world_size(group)
    first = x.movedim(dim, 0).contiguous()
    out = first.new_empty((first.shape[0] // size, *first.shape[1:]))
    dist.reduce_scatter_tensor(out, first, group=group)
    return out.movedim(0, dim).contiguous()


def _seq_shape(x: torch.Tensor, dim: int, group_name: str, gather: bool) -> tuple[int, ...]:
    """``x``'s shape with dim ``dim`` multiplied (``gather``) or divided by the group's size; one line where it does
    not divide."""
    size = dist.get_world_size(_resolve_process_group(group_name))
    shape = list(x.shape)
    if not gather and shape[dim] % size:
        raise AutoshardError(
            f"sequence parallel: dim {dim} of a {tuple(x.shape)} activation does not split into {size} tp "
            f"ranks; re-plan with a sequence length that tp divides, or --sequence-parallel off"
        )
    shape[dim] = shape[dim] * size if gather else shape[dim] // size
    return tuple(shape)


@sp_gather.register_fake
def _(x, dim, partial_grad, group_name):
    return x.new_empty(_seq_shape(x, dim, group_name, gather=True))


@sp_scatter.register_fake
def _(x, dim, group_name):
    return x.new_empty(_seq_shape(x, dim, group_name, gather=False))


@sp_split.register_fake
def _(x, dim, group_name):
    return x.new_empty(_seq_shape(x, dim, group_name, gather=False))


def _keep_seq_args(ctx, inputs, output) -> None:
    ctx.dim, ctx.group_name = inputs[1], inputs[-1]
    ctx.partial_grad = inputs[2] if len(inputs) == 4 else None


def _sp_gather_backward(ctx, grad):
    if ctx.partial_grad:
        return sp_scatter(grad, ctx.dim, ctx.group_name), None, None, None
    group = _resolve_process_group(ctx.group_name)
    mine = grad.chunk(dist.get_world_size(group), dim=ctx.dim)[dist.get_rank(group)].contiguous()
    return mine, None, None, None


def _sp_to_whole_backward(ctx, grad):
    return sp_gather(grad, ctx.dim, False, ctx.group_name), None, None


sp_gather.register_autograd(_sp_gather_backward, setup_context=_keep_seq_args)
sp_scatter.register_autograd(_sp_to_whole_backward, setup_context=_keep_seq_args)
sp_split.register_autograd(_sp_to_whole_backward, setup_context=_keep_seq_args)


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


class GatheredInput:
    """The tokens a ``gather-seq-module-input`` module gathered for the call in progress: its column-parallel
    linears reading exactly this tensor take it as it is (their partial input gradients summed by the gather's
    reduce-scatter), as DTensor's ColwiseParallel takes the gathered Replicate DTensor; any other input goes
    through f. Set and read while ``pipeline()`` traces, so the traced stage holds the choice."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.reads = 0  # column linears that took it as it is, in the call in progress

    def holds(self, x: torch.Tensor) -> bool:
        held = self.value is not None and x is self.value
        self.reads += held
        return held


def _column_input(x: torch.Tensor, seq_dim: int | None, gathered: GatheredInput | None, group_name: str):
    """A column split's input: gathered over the sequence (``seq_dim``), taken as it is (its module gathered it),
    or through f."""
    if seq_dim is not None:
        return sp_gather(x, seq_dim, True, group_name)
    if gathered is not None and gathered.holds(x):
        return x
    return tp_copy(x, group_name)


def _row_output(y: torch.Tensor, bias: torch.Tensor | None, seq_dim: int | None, group_name: str) -> torch.Tensor:
    """A row split's partial sums summed (g), or reduce-scattered over the sequence (``seq_dim``), then the whole
    bias; on this rank's tokens only the bias's gradient is partial, so it goes through f."""
    if seq_dim is None:
        y = tp_reduce(y, group_name)
        return y + bias if bias is not None else y
    y = sp_scatter(y, seq_dim, group_name)
    return y + tp_copy(bias, group_name) if bias is not None else y


class ShardedLinear(nn.Module):
    """nn.Linear holding rank k's shard: column split (weight rows) or row split (weight columns); with
    ``seq_dim`` the column split gathers its input over the sequence and the row split reduce-scatters."""

    def __init__(
        self,
        linear: nn.Linear,
        style: str,
        rank: int,
        size: int,
        group_name: str,
        seq_dim: int | None = None,
        gathered: GatheredInput | None = None,
    ):
        super().__init__()
        self.style, self.group_name, self.seq_dim, self.gathered = style, group_name, seq_dim, gathered
        split_dim = 1 if style == "rowwise" else 0
        self.weight = nn.Parameter(_shard(linear.weight, split_dim, rank, size))
        bias = linear.bias
        if bias is not None:
            bias = bias.detach().clone() if style == "rowwise" else _shard(bias, 0, rank, size)
        self.bias = nn.Parameter(bias) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "rowwise":
            return _row_output(F.linear(x, self.weight), self.bias, self.seq_dim, self.group_name)
        y = F.linear(_column_input(x, self.seq_dim, self.gathered, self.group_name), self.weight, self.bias)
        return tp_gather(y, self.group_name) if self.style == "colwise-gather" else y


class ShardedConv1D(nn.Module):
    """transformers' Conv1D (y = x W + b, weight (in, out)) holding rank k's shard; ``seq_dim`` as ShardedLinear."""

    def __init__(
        self,
        conv: nn.Module,
        style: str,
        rank: int,
        size: int,
        group_name: str,
        seq_dim: int | None = None,
        gathered: GatheredInput | None = None,
    ):
        super().__init__()
        self.style, self.group_name, self.seq_dim, self.gathered = style, group_name, seq_dim, gathered
        rowwise = style == "conv1d-rowwise"
        self.weight = nn.Parameter(_shard(conv.weight, 0 if rowwise else 1, rank, size))
        bias = conv.bias.detach().clone() if rowwise else _shard(conv.bias, 0, rank, size)
        self.bias = nn.Parameter(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "conv1d-colwise":
            x = _column_input(x, self.seq_dim, self.gathered, self.group_name)
        flat = x.reshape(-1, x.shape[-1]) @ self.weight
        y = flat.view(*x.shape[:-1], self.weight.shape[1])
        if self.style == "conv1d-rowwise":
            return _row_output(y, self.bias, self.seq_dim, self.group_name)
        return y + self.bias


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding holding rows [k·V/t, (k+1)·V/t); ids outside them give zeros, summed over tp (with ``seq_dim``
    reduce-scattered over the sequence)."""

    def __init__(self, embedding: nn.Embedding, rank: int, size: int, group_name: str, seq_dim: int | None = None):
        super().__init__()
        if embedding.max_norm is not None or embedding.sparse:
            raise AutoshardError(
                "tensor parallel: an nn.Embedding with max_norm or sparse=True cannot be split "
                "by vocabulary; keep it replicated"
            )
        self.group_name, self.seq_dim = group_name, seq_dim
        self.weight = nn.Parameter(_shard(embedding.weight, 0, rank, size))
        rows = self.weight.shape[0]
        self.first_id = rank * rows
        pad = embedding.padding_idx
        self.local_padding_idx = pad - self.first_id if pad is not None and 0 <= pad - self.first_id < rows else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first_id
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local * mine, self.weight, self.local_padding_idx)
        partial = rows * mine.unsqueeze(-1).to(rows.dtype)
        if self.seq_dim is not None:  # the sum reduce-scattered: this rank's tokens
            return sp_scatter(partial, self.seq_dim, self.group_name)
        return tp_reduce(partial, self.group_name)


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
    gathering = {path: GatheredInput() for path, style in styles.items() if style.startswith(_GATHER_MODULE)}
    for path, style in sorted(styles.items()):
        if style == "replicate":
            continue
        original = model.get_submodule(path)
        gathered = next((g for p, g in gathering.items() if path.startswith(p + ".")), None)
        shard = LocalStyle(path, style, rank, size, name, gathering.get(path) or gathered)
        local = _keep_attributes(_local_module(original, shard), original)
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


@dataclass(frozen=True)
class LocalStyle:
    """What one module's local form needs: its path and style, this rank of the tp group, and the gathered input of
    the ``gather-seq-module-input`` module holding it (or its own, if it is one)."""

    path: str
    style: str
    rank: int
    size: int
    group_name: str
    gathered: GatheredInput | None = None

    @property
    def base(self) -> str:
        """The style without its sequence suffix: ``rowwise-seq-output-dim1`` -> ``rowwise``."""
        match = _SEQ_STYLE.fullmatch(self.style)
        return match.group(1) if match else self.style

    @property
    def seq_dim(self) -> int | None:
        """The sequence dim of a sequence-parallel style; None for the others."""
        match = _SEQ_STYLE.fullmatch(self.style)
        return int(match.group(3)) if match else None


_SEQ_STYLE = re.compile(r"(.+)-seq-(input|output|module-input)-dim(\d+)")
_GATHER_MODULE = "gather-seq-module-input-dim"
_MODULE_HOOKS = ("gather", "scatter")  # bases of the styles that wrap a module's forward, sharding nothing


def _local_module(module: nn.Module, shard: LocalStyle) -> nn.Module:
    style, base, seq = shard.style, shard.base, shard.seq_dim
    args = (shard.rank, shard.size, shard.group_name)
    if style.startswith(SHARDED_INPUT):
        return _params_through_copy(module, shard.group_name)
    if base in _MODULE_HOOKS:
        return _sequence_hooks(module, shard)
    if base.startswith("conv1d-") and type(module).__name__ == "Conv1D":
        return ShardedConv1D(module, base, *args, seq_dim=seq, gathered=shard.gathered)
    if base == "vocab-parallel-embedding" and isinstance(module, nn.Embedding):
        return VocabParallelEmbedding(module, *args, seq_dim=seq)
    if base == LOSS_PARALLEL and isinstance(module, nn.Linear):  # its vocabulary shard is the stage's output
        return ShardedLinear(module, "colwise", *args, seq_dim=seq, gathered=shard.gathered)
    if base in ("colwise", "colwise-gather", "rowwise") and isinstance(module, nn.Linear):
        return ShardedLinear(module, base, *args, seq_dim=seq, gathered=shard.gathered)
    raise AutoshardError(
        f"tensor parallel: {shard.path} is a {type(module).__name__}, which style {style!r} does not fit; "
        f"re-plan this model"
    )


def _sequence_hooks(module: nn.Module, shard: LocalStyle) -> nn.Module:
    """``module`` (in place) calling its forward between the sequence ops of its style (module doc)::

    gather-seq-input-dimd         first positional input  sp_gather (slice back: its code's gradient is whole)
    gather-seq-module-input-dimd  first tensor argument   sp_gather (reduce-scatter back), kept in ``gathered``
    scatter-seq-input-dimd        first positional input  sp_split
    scatter-seq-output-dimd       output                  sp_split
    """
    inner, d, group = module.forward, shard.seq_dim, shard.group_name
    kind = shard.style.removesuffix(f"-dim{d}")

    def first_input(change, args: tuple, kwargs: dict, keyword: bool) -> tuple[tuple, dict]:
        if args and isinstance(args[0], torch.Tensor):
            return (change(args[0]), *args[1:]), kwargs
        key = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None) if keyword else None
        if key is None:
            raise AutoshardError(
                f"sequence parallel: {shard.path} ({type(module).__name__}) takes {kind} but was called without "
                f"the tokens as its first {'tensor' if keyword else 'positional'} argument; re-plan with "
                f"--sequence-parallel off"
            )
        return args, {**kwargs, key: change(kwargs[key])}

    def keep(x: torch.Tensor) -> torch.Tensor:
        shard.gathered.value, shard.gathered.reads = sp_gather(x, d, True, group), 0
        return shard.gathered.value

    def check_read() -> None:
        """The gather's backward reduce-scatters partial gradients: a column linear must have read the gathered
        tokens as they are (the planner gives them no other reader), or the program would not train as one
        process does."""
        if not shard.gathered.reads:
            raise AutoshardError(
                f"sequence parallel: no column-parallel linear of {shard.path} ({type(module).__name__}) read the "
                f"tokens it gathered as they are; re-plan with --sequence-parallel off"
            )

    def forward(*args, **kwargs):
        if kind == "scatter-seq-output":
            return sp_split(inner(*args, **kwargs), d, group)
        if kind == "gather-seq-module-input":
            args, kwargs = first_input(keep, args, kwargs, keyword=True)
            try:
                out = inner(*args, **kwargs)
            finally:
                shard.gathered.value = None
            check_read()
            return out
        if kind == "gather-seq-input":
            args, kwargs = first_input(lambda x: sp_gather(x, d, False, group), args, kwargs, keyword=False)
        else:  # scatter-seq-input
            args, kwargs = first_input(lambda x: sp_split(x, d, group), args, kwargs, keyword=False)
        return inner(*args, **kwargs)

    module.forward = forward
    return module
