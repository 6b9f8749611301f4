"""Context parallelism: ring attention along the sequence, on CPU ranks (gloo) and CUDA ranks.

Each of the ``cp`` ranks of a context-parallel group holds ``c = S / cp`` tokens of every sequence
(``shard_sequence``), in one of two layouts (``ir.decisions.cp_load_balanced`` picks):

- **head-tail** (load-balanced, S divisible by 2cp): with ``h = S / (2cp)``, rank ``r`` holds the chunks
  ``r`` and ``2cp - 1 - r``, i.e. tokens ``[r*h, (r+1)*h)`` then ``[(2cp-1-r)*h, (2cp-r)*h)``
  (``head_tail_positions``; torch's ``_HeadTailLoadBalancer``). Under a causal mask every rank then does the
  same work at every ring step (torch's balanced ring: step 0 the local causal block, later steps half a
  block each), where contiguous chunks leave the last rank with cp times the first's.
- **contiguous**: rank ``r`` holds tokens ``[r*c, (r+1)*c)``.

Everything but attention is per token, so it runs unchanged on the rank's tokens in either order; attention
needs every key, and gets them by a ring; the positions a model numbers its tokens with (``torch.arange`` of
the local length) are made the rank's global ones (``ContextParallelMode``).

The maths (online softmax). Rank ``r`` holds its queries ``q`` and, step by step, the key and
value chunks ``(k_i, v_i)`` of every rank ``i``. A kernel run on one chunk gives the partial
output and the log-sum-exp of the scores of each query row::

    out_i = softmax(q k_i^T * scale) v_i,        lse_i = log sum_j exp(q k_ij * scale)

and the attention over all keys is their merge, exactly (up to rounding)::

    lse = log sum_i exp(lse_i),                  out = sum_i exp(lse_i - lse) out_i

(torch merges one chunk at a time, in the stable sigmoid form of the same formula).
Causal attention with contiguous chunks: chunk ``i == r`` is the diagonal block (causal
inside), chunks ``i < r`` are wholly in the past (no mask), chunks ``i > r`` wholly in the
future (skipped). The backward runs the kernel's backward on each chunk with the merged
``out`` and ``lse`` (so each block's softmax is the global one): ``dq`` accumulates on the
query's rank, ``dk, dv`` travel the ring back to the rank that owns the chunk.

What it reuses. torch's ``context_parallel`` (``torch.distributed.tensor.experimental``) runs
this ring only for the CUDA SDPA kernels (flash, efficient, cuDNN), by intercepting them on
DTensors; a CPU rank runs ``aten._scaled_dot_product_flash_attention_for_cpu``, which it does
not handle, so the public API has no CPU path. Its generic ring, ``_templated_ring_attention``
and ``_templated_ring_attention_backward``, takes the kernel as an argument: this module
calls those PRIVATE functions with the device's kernel (``_KERNELS``). They may change
between torch releases; tests/e2e/test_context_parallel_runtime.py checks them against one
process. Entry points:

- ``ring_attention`` / ``RingAttention``: the autograd function on local ``[B, H, S_local, D]``.
- ``ContextParallelMode``: a TorchFunctionMode entered around the model's forward and backward;
  it routes ``F.scaled_dot_product_attention`` to the ring (refusing what the ring cannot
  compute) and turns the local positions a model builds with ``torch.arange`` into global ones.
- ``shard_sequence``: this rank's tokens of a batch tensor; ``average_gradients``: the gradient
  mean over the cp (x dp) ranks for a model no dp wrapper reduces.
- ``use_cp_attention``: a transformers model's attention switched to a key of its own that builds no mask
  (``CP_ATTENTION``), so that head-tail positions, which jump in the middle, are not read as packed sequences.

GPU-only and untested here (no GPU in CI): the CUDA kernel pair (flash attention forward and
backward, bf16/fp16 only, its extra outputs passed to the backward as torch's own ring does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoshard.errors import AutoshardError
from autoshard.ir.decisions import cp_load_balanced

SEQ_DIM = 2  # [batch, heads, seq, head_dim], as SDPA and torch's ring take it
aten = torch.ops.aten


def _torch_ring():
    """torch's ring attention templates: a PRIVATE torch API, on purpose (the public ``context_parallel`` has
    no CPU path, module doc). Imported on first use: ``autoshard.runtime`` imports this module, and this one
    brings DTensor, which a process that only loads a model or a batch does not need."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


__all__ = [
    "RingAttention",
    "ring_attention",
    "ContextParallelMode",
    "shard_sequence",
    "average_gradients",
    "take_sequence_shard",
    "context_parallel",
    "head_tail_positions",
    "use_cp_attention",
    "cp_attention_refusal",
    "CP_ATTENTION",
]


# --------------------------------------------------------------------------- kernels


@dataclass(frozen=True)
class _Kernel:
    """One device's attention kernel pair, in the calling convention of torch's ring.

    ``forward(q, k, v, *, is_causal, dropout_p, scale) -> (out, lse [B, H, S], *rest)``;
    ``backward`` is called with keywords ``grad_out, query, key, value, out, logsumexp,
    is_causal`` and ``backward_kwargs(rest, scale)``; ``dtypes``: what the kernel computes in.
    """

    forward: Callable
    backward: Callable
    backward_kwargs: Callable[[tuple, float | None], dict]
    dtypes: tuple[torch.dtype, ...]


def _cpu_backward_kwargs(rest: tuple, scale: float | None) -> dict:
    return {"dropout_p": 0.0, "scale": scale}  # the CPU kernel returns (out, lse) only: no rest


def _cuda_flash_backward_kwargs(rest: tuple, scale: float | None) -> dict:
    # The forward's outputs after (out, lse), named as the flash backward takes them (derivatives.yaml):
    # rng_state and unused are its philox seed and offset (unread with dropout 0).
    cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, *_ = rest
    return {
        "cum_seq_q": cum_seq_q,
        "cum_seq_k": cum_seq_k,
        "max_q": max_q,
        "max_k": max_k,
        "dropout_p": 0.0,
        "philox_seed": rng_state,
        "philox_offset": unused,
        "scale": scale,
    }


_KERNELS = {
    "cpu": _Kernel(
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        _cpu_backward_kwargs,
        (torch.float32, torch.float64, torch.bfloat16, torch.float16),
    ),
    "cuda": _Kernel(
        aten._scaled_dot_product_flash_attention.default,  # as torch's own ring (GPU-only, untested)
        aten._scaled_dot_product_flash_attention_backward.default,
        _cuda_flash_backward_kwargs,
        (torch.bfloat16, torch.float16),
    ),
}


def _kernel_for(query: torch.Tensor) -> _Kernel:
    kernel = _KERNELS.get(query.device.type)
    if kernel is None:
        raise AutoshardError(
            f"context parallelism runs on cpu and cuda ranks, not {query.device.type}; "
            f"plan without context parallelism (cp=1)"
        )
    if query.dtype not in kernel.dtypes:
        raise AutoshardError(
            f"context parallelism on {query.device.type} attends in {query.dtype}, which its "
            f"flash kernel does not take; train under bf16 autocast (or plan cp=1)"
        )
    return kernel


@contextlib.contextmanager
def _load_balance(enabled: bool):
    """torch's ring with load balancing ``enabled`` (head-tail chunks, module doc) or off (contiguous chunks:
    the ring skips the future chunks, rank r computes r+1 of cp blocks), restored after. torch's flag is
    process-global and read on every ring call, so it is set around each call."""
    options = _torch_ring()._cp_options
    saved = options.enable_load_balance
    options.enable_load_balance = enabled
    try:
        yield
    finally:
        options.enable_load_balance = saved


# --------------------------------------------------------------------------- the ring


class RingAttention(torch.autograd.Function):
    """Attention of local ``query, key, value`` ``[B, H, S_local, D]`` over the whole sequence of
    the cp group (rank order = the group's ranks; ``balanced``: each rank's tokens are its head-tail pair of
    chunks, else one contiguous chunk, module doc); no mask, no dropout; ``key`` and ``value`` have the
    query's head count. Returns the local output ``[B, H, S_local, D]``. Attention without a causal mask is
    order-free (every block is whole), so it runs unbalanced on either layout (torch balances causal only)."""

    @staticmethod
    def forward(ctx, query, key, value, is_causal: bool, scale: float | None, group: dist.ProcessGroup, balanced: bool):
        kernel = _kernel_for(query)
        balanced = balanced and is_causal
        with _load_balance(balanced):
            out, lse, *rest = _torch_ring()._templated_ring_attention(
                group, SEQ_DIM, kernel.forward, query, key, value, is_causal=is_causal, dropout_p=0.0, scale=scale
            )
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.rest, ctx.is_causal, ctx.scale, ctx.group, ctx.kernel = tuple(rest), is_causal, scale, group, kernel
        ctx.balanced = balanced
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        with _load_balance(ctx.balanced):
            grad_q, grad_k, grad_v, *_ = _torch_ring()._templated_ring_attention_backward(
                ctx.group,
                SEQ_DIM,
                ctx.kernel.backward,
                grad_out=grad_out.contiguous(),
                grad_out_name="grad_out",
                query=query,
                key=key,
                value=value,
                out=out,
                logsumexp=lse,
                is_causal=ctx.is_causal,
                **ctx.kernel.backward_kwargs(ctx.rest, ctx.scale),
            )
        return grad_q, grad_k, grad_v, None, None, None, None


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    is_causal: bool = False,
    scale: float | None = None,
    balanced: bool = False,
) -> torch.Tensor:
    """``RingAttention.apply`` with keywords (see the class)."""
    return RingAttention.apply(query, key, value, is_causal, scale, group, balanced)


# --------------------------------------------------------------------------- the mode


# The aten ops a traced graph calls where the model's code called F.scaled_dot_product_attention and torch.arange
# (a pipeline stage: ``runtime.pipeline_parallel``); each takes its arguments in the order the function does.
_ATEN_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)


def _attention_eager_under_compile() -> None:
    """``ContextParallelMode._attention`` under ``torch.compiler.disable`` (once): a compiled block runs the ring
    eager, between two graphs (``runtime.compiled``). Applied as the first mode is made, not as this module is
    imported: the decorator imports ``torch._dynamo``, about 1.2 s of CPU in every process that imports the runtime,
    which a program without context parallelism never needs."""
    method = ContextParallelMode.__dict__["_attention"]
    if not getattr(method, "_torchdynamo_disable", False):
        ContextParallelMode._attention = torch.compiler.disable(method)


class ContextParallelMode(torch.overrides.TorchFunctionMode):
    """Run a model's forward (and backward) on this rank's sequence chunk as if on the whole sequence.

    Enter it around the forward and the backward on every rank of the cp group (the backward too:
    activation checkpointing recomputes the forward there). It changes two kinds of call:

    ``F.scaled_dot_product_attention`` becomes ``ring_attention`` over ``cp_group``; so does the aten op a traced
    graph calls in its place (a pipeline stage, traced by ``torch.export``: ``aten.scaled_dot_product_attention``,
    and ``aten.arange`` for ``torch.arange`` below). Refused with
    an ``AutoshardError``: an explicit ``attn_mask`` (the ring computes only "causal" or "none"),
    ``dropout_p > 0``, query and key lengths that differ (cross-attention, a KV cache) or a
    query that is not this rank's ``local_seq_len`` tokens. ``enable_gqa=True``: the key/value
    heads are repeated (``repeat_interleave`` on dim 1), as SDPA does.

    ``torch.arange`` with step 1 whose result has exactly ``local_seq_len`` elements returns
    the global positions: the rank's token positions minus ``arange(c)`` are added element by element
    (``head_tail_positions`` when ``balanced``, else ``cp_rank * local_seq_len`` throughout; so ``arange(0, c)``
    gives the rank's positions, ``[r*c, (r+1)*c)`` when contiguous; transformers' ``arange(c) + past`` likewise). That is how examples/gpt.py
    (``torch.arange(t)``) and transformers Llama (``position_ids``) number their tokens.
    SOUNDNESS: it is right only if every such arange in the model's forward numbers the local
    tokens. An arange of that length for anything else (heads, a hidden axis, a mask built over
    another axis of equal size) would be shifted wrongly; the planner must check on the captured
    graph that no other arange has that length, and refuse positions that come from elsewhere (a
    position buffer sliced ``[:t]``, a cumsum) since those are NOT shifted here. Positions passed
    as model inputs are sharded with the batch (``shard_sequence``) and need nothing. An arange
    whose every use ends in an SDPA ``attn_mask`` is harmless: a call with a mask is refused. (The
    graph torch.export captures of transformers Llama has two such, q_idx and kv_idx of the
    causal mask it materializes while exporting; run eagerly without padding it builds none and
    calls SDPA with ``attn_mask=None, is_causal=True``.)
    """

    rerun_under_recompute = True  # a checkpointed block's recomputation runs the ring too (runtime.selective)

    def __init__(
        self, cp_group: dist.ProcessGroup, cp_rank: int, cp_size: int, local_seq_len: int, balanced: bool = False
    ):
        super().__init__()
        assert 0 <= cp_rank < cp_size and local_seq_len > 0, (cp_rank, cp_size, local_seq_len)
        assert not balanced or local_seq_len % 2 == 0, f"head-tail chunks of {local_seq_len} tokens"
        self.cp_group, self.cp_rank, self.cp_size, self.local_seq_len = cp_group, cp_rank, cp_size, local_seq_len
        self.balanced = balanced
        self._deltas: dict[tuple, torch.Tensor] = {}
        _attention_eager_under_compile()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention or func is aten.scaled_dot_product_attention.default:
            return self._attention(*args, **kwargs)
        if func is torch.arange or func in _ATEN_ARANGES:
            return self._positions(func(*args, **kwargs), args, kwargs)
        return func(*args, **kwargs)

    def _attention(
        self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ) -> torch.Tensor:
        _check_attention(query, key, attn_mask, dropout_p, self.local_seq_len)
        assert dist.get_world_size(self.cp_group) == self.cp_size, "cp_group is not the cp_size ranks"
        device = query.device.type
        if torch.is_autocast_enabled(device):  # SDPA would attend in the autocast dtype: so does the ring
            dtype = torch.get_autocast_dtype(device)
            query, key, value = (t.to(dtype) for t in (query, key, value))
        if enable_gqa and key.shape[1] != query.shape[1]:
            repeats = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        return ring_attention(
            query, key, value, self.cp_group, is_causal=bool(is_causal), scale=scale, balanced=self.balanced
        )

    def _positions(self, result: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        step = args[2] if len(args) > 2 else kwargs.get("step", 1)
        if result.dim() != 1 or result.numel() != self.local_seq_len or step != 1:
            return result
        delta = self._delta(result.device, result.dtype)
        if kwargs.get("out") is not None:
            return result.add_(delta)
        return result + delta

    def _delta(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """What turns ``arange(a, a + c)`` into this rank's global positions ``a + positions``: ``positions −
        arange(c)``, per element (cached per device and dtype; made with the mode off, inside its handler)."""
        key = (device, dtype)
        if key not in self._deltas:
            c = self.local_seq_len
            if self.balanced:
                positions = head_tail_positions(self.cp_rank, self.cp_size, c)
            else:
                positions = torch.arange(self.cp_rank * c, (self.cp_rank + 1) * c)
            self._deltas[key] = (positions - torch.arange(c)).to(device=device, dtype=dtype)
        return self._deltas[key]


def _check_attention(query: torch.Tensor, key: torch.Tensor, attn_mask, dropout_p: float, local_seq_len: int) -> None:
    """Refuse, in one line with the fix, an attention call the ring cannot compute."""
    if attn_mask is not None:
        raise AutoshardError(
            f"context parallelism: an attention call passes an explicit attn_mask (shape {tuple(attn_mask.shape)}), "
            f"which the ring cannot split along the sequence; use is_causal=True without a mask (transformers: "
            f"attn_implementation='sdpa' and no padding attention_mask) or plan without context parallelism (cp=1)"
        )
    if dropout_p > 0:
        raise AutoshardError(
            f"context parallelism: attention dropout (dropout_p={dropout_p}) is not supported by the "
            f"ring; set the model's attention dropout to 0 or plan without context parallelism (cp=1)"
        )
    if query.dim() != 4:
        raise AutoshardError(
            f"context parallelism: attention on a {query.dim()}-d query {tuple(query.shape)}, not "
            f"[batch, heads, seq, head_dim]; reshape it so or plan without context parallelism (cp=1)"
        )
    if query.shape[SEQ_DIM] != key.shape[SEQ_DIM]:
        raise AutoshardError(
            f"context parallelism: attention with {query.shape[SEQ_DIM]} queries and {key.shape[SEQ_DIM]} keys "
            f"(cross-attention or a KV cache) cannot be split along the sequence; "
            f"plan without context parallelism (cp=1)"
        )
    if query.shape[SEQ_DIM] != local_seq_len:
        raise AutoshardError(
            f"context parallelism: attention over {query.shape[SEQ_DIM]} tokens, not this rank's {local_seq_len}-token "
            f"chunk of the sequence (tokens added or removed inside the model); "
            f"plan without context parallelism (cp=1)"
        )


# --------------------------------------------------------------------------- transformers models

CP_ATTENTION = "autoshard_cp"  # the attention key a transformers model runs under cp (``use_cp_attention``)


def _cp_attention(module, query, key, value, attention_mask, **kwargs):
    """``CP_ATTENTION``: transformers' own SDPA attention. The key has no mask function registered, so
    transformers builds no mask for it (``masking_utils._preprocess_mask_arguments`` exits early for such keys,
    before its packed-sequence detection, which would read head-tail positions as two documents) and this
    gets ``attention_mask=None``: SDPA with ``is_causal``, which ``ContextParallelMode`` runs as the ring."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _transformers_parts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost transformers ``PreTrainedModel`` modules of ``model`` (itself, or those a model file's own
    module holds); none without transformers loaded."""
    import sys

    transformers = sys.modules.get("transformers")
    if transformers is None:
        return []
    pretrained = transformers.PreTrainedModel
    parts, inside = [], set()
    for name, module in model.named_modules():
        if isinstance(module, pretrained) and not any(name.startswith(p + ".") or p == "" for p in inside):
            parts.append(module)
            inside.add(name)
    return parts


def cp_attention_refusal(model: torch.nn.Module) -> str | None:
    """Why ``use_cp_attention`` cannot switch this model's transformers attention (an attention of its own, e.g.
    eager or flash: the ring replaces SDPA only; a class whose code does not read transformers'
    ``AttentionInterface``), or None (nothing to switch counts as None)."""
    for part in _transformers_parts(model):
        current = part.config._attn_implementation
        if current not in ("sdpa", CP_ATTENTION):
            return f"{type(part).__name__} attends with {current!r}, not transformers' 'sdpa', which the ring replaces"
        if not type(part)._can_set_attn_implementation():
            return f"{type(part).__name__}'s attention does not go through transformers' AttentionInterface"
    return None


def use_cp_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switch every transformers part of ``model`` to ``CP_ATTENTION`` (in place; idempotent) and refuse a padding
    ``attention_mask`` at its forward (under that key transformers would drop it silently, where one process
    masks the padding). A model calling ``F.scaled_dot_product_attention`` itself is returned unchanged."""
    parts = _transformers_parts(model)
    if not parts:
        return model
    why = cp_attention_refusal(model)
    if why:
        raise AutoshardError(f"context parallelism: {why}; plan without context parallelism (cp=1)")
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(CP_ATTENTION) is not _cp_attention:
        AttentionInterface.register(CP_ATTENTION, _cp_attention)
    for part in parts:
        if part.config._attn_implementation != CP_ATTENTION:
            part.set_attn_implementation(CP_ATTENTION)
        if not getattr(part, _PADDING_REFUSED, False):  # per module: two models may share one config object
            part.register_forward_pre_hook(_refuse_padding, with_kwargs=True)
            setattr(part, _PADDING_REFUSED, True)
        unswitched = [type(m).__name__ for m in part.modules() if _attention_of(m) not in (None, CP_ATTENTION)]
        if unswitched:
            raise AutoshardError(
                f"context parallelism: {unswitched[0]} kept its attention after the switch to the ring's; "
                f"plan without context parallelism (cp=1)"
            )
    return model


_PADDING_REFUSED = "_autoshard_padding_refused"  # set on a part once its forward refuses padding masks


def _attention_of(module: torch.nn.Module) -> str | None:
    config = getattr(module, "config", None)
    return getattr(config, "_attn_implementation", None) if hasattr(module, "set_attn_implementation") else None


def _refuse_padding(module, args, kwargs):
    import inspect

    mask = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):
        raise AutoshardError(
            "context parallelism: the batch has a padding attention_mask, which the ring cannot apply; "
            "train on unpadded (packed or equal-length) sequences or plan without context parallelism (cp=1)"
        )
    return None


# --------------------------------------------------------------------------- data and gradients


def head_tail_positions(cp_rank: int, cp_size: int, local_seq_len: int) -> torch.Tensor:
    """The global positions of a balanced rank's ``local_seq_len`` = 2h tokens (module doc): ``[r*h, (r+1)*h)``
    then ``[(2cp-1-r)*h, (2cp-r)*h)``. The one definition the sharding and the positions read."""
    h = local_seq_len // 2
    assert 2 * h == local_seq_len, local_seq_len
    tail = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * h, (cp_rank + 1) * h), torch.arange(tail * h, (tail + 1) * h)])


def shard_sequence(
    tensor: torch.Tensor, seq_dim: int, cp_rank: int, cp_size: int, balanced: bool = False
) -> torch.Tensor:
    """This rank's tokens of ``tensor`` along ``seq_dim``: its head-tail pair of chunks when ``balanced``
    (``head_tail_positions``), else the contiguous chunk ``[r*c, (r+1)*c)``."""
    length = tensor.shape[seq_dim]
    parts = 2 * cp_size if balanced else cp_size
    if length % parts:
        raise AutoshardError(
            f"context parallelism over {cp_size} ranks needs a sequence length divisible by "
            f"{parts}, got {length}; pick a --seq-len that is a multiple of {parts}"
        )
    if not balanced:
        chunk = length // cp_size
        return tensor.narrow(seq_dim, cp_rank * chunk, chunk)
    h = length // parts
    tail = 2 * cp_size - 1 - cp_rank
    return torch.cat([tensor.narrow(seq_dim, cp_rank * h, h), tensor.narrow(seq_dim, tail * h, h)], dim=seq_dim)


def average_gradients(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """Replace each gradient by its mean over ``group`` (all ranks when None): one all-reduce per dtype.

    For a model no dp wrapper reduces. Over the cp ranks (x the dp ranks) this is the gradient of
    the global mean loss when each rank's loss is the mean over its own tokens and every rank has
    as many tokens: mean of the means = the global mean. (A dp wrapper in a real plan reduces over
    the flattened dp x cp ranks instead, as torchtitan does.) Every rank must hold the same
    gradients (the same parameters, all with or all without a gradient).
    """
    grads = [p.grad for p in params if p.grad is not None]
    size = dist.get_world_size(group)
    for dtype in sorted({g.dtype for g in grads}, key=str):
        same = [g for g in grads if g.dtype == dtype]
        flat = torch._utils._flatten_dense_tensors(same)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat /= size
        for grad, mean in zip(same, torch._utils._unflatten_dense_tensors(flat, same)):
            grad.copy_(mean)


def take_sequence_shard(inputs: tuple, targets, mesh, axis: str | None, seq_len: int):
    """This rank's tokens of a micro-batch along the mesh dim ``axis`` (the plan's sequence axis, "cp"):
    every input and target tensor whose dim 1 is the ``seq_len`` tokens is cut along it, inputs and targets
    alike (``shard_sequence``, head-tail where ``ir.decisions.cp_load_balanced``); the others (a per-sample
    tensor) stay whole. ``axis`` None (no context parallelism): the micro-batch unchanged."""
    if axis is None:
        return inputs, targets
    cp_mesh = mesh[axis]
    rank, size = cp_mesh.get_local_rank(), cp_mesh.size()
    balanced = cp_load_balanced(seq_len, size)

    def cut(t):
        is_tokens = isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == seq_len
        return shard_sequence(t, 1, rank, size, balanced) if is_tokens else t

    return tuple(cut(t) for t in inputs), cut(targets)


def context_parallel(mesh, axis: str | None, seq_len: int) -> ContextParallelMode | contextlib.nullcontext:
    """The mode a forward and backward run under on a rank of the mesh dim ``axis`` (``ContextParallelMode``:
    attention as a ring over its ranks, positions made global); ``axis`` None: nothing."""
    if axis is None:
        return contextlib.nullcontext()
    cp_mesh = mesh[axis]
    size = cp_mesh.size()
    balanced = cp_load_balanced(seq_len, size)
    return ContextParallelMode(cp_mesh.get_group(), cp_mesh.get_local_rank(), size, seq_len // size, balanced)
