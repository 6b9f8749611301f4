"""What autograd keeps for backward, op by op, in the dtypes the emitted program runs.

A captured op n keeps for its backward the tensors its derivative formula reads (torch's
``derivatives.yaml``, or the ops a composite decomposes into), and only where an input needs a
gradient; its output only where the formula reads it. Per op (x, y activations; W a parameter;
c a tensor that needs no gradient, such as rotary tables; r(x) whether x needs a gradient)::

    linear / mm / addmm / matmul / bmm     its activation inputs (W's gradient reads x; x's reads W)
    scaled_dot_product_attention           q, k, v, the output and the log-sum-exp (fp32, b·h·s):
                                           the flash kernels' saved set, CPU (``_for_cpu``) and CUDA alike
    mul(x, y)                              y if r(x), x if r(y)       (mul(q, cos) keeps only cos)
    div(x, c)                              c                          (as mul; x / y keeps y and the output)
    silu, gelu, sigmoid', pow, log ...     its input                  (``_INPUT_SAVERS``)
    relu, tanh, sigmoid, softmax, exp      its output                 (``_OUTPUT_SAVERS``)
    dropout (p > 0)                        its mask, 1 byte per element
    rms_norm(x, W)                         torch's composite: x upcast to fp32 (4 B per element; x itself
                                           when x is already fp32) and x·rstd in fp32 (W's gradient), rstd
    layer_norm(x, W, b)                    x, mean and rstd (native_layer_norm)
    embedding(W, ids)                      the ids (int64)
    add, sub, neg, cat, views, repeat_interleave, to, arange ...   nothing (``_SAVES_NOTHING``)
    any other op                           its outputs (the conservative rule)

Bytes: a graph value of e elements in the captured dtype weighs e·a bytes as trained (a the
precision's activation bytes: bf16 under autocast and FSDP2's bf16 parameters); the fp32
statistics above weigh 4 bytes per element whatever a. A view counts as the tensor it views, and
a tensor kept by several ops once (``saved_set``): the union over a block's ops is what the
block keeps. Where a < 4, the model's own casts that are no-ops in the fp32 capture copy
(``cost.casts``): ``x.to(torch.float32)`` of a 16-bit activation is an fp32 tensor of its own (4 B per
element, and what is computed from it alone), the cast back to the input's dtype a 16-bit one.

A tensor-parallel rank (``RankShare``, made from the layout by ``cost.tp.rank_share``) keeps the same
tensors on its shards' shapes: a value the layout splits over the t TP ranks (a column-parallel linear's
output and what is computed from it up to the row-parallel linear; with sequence parallelism also the
residual stream between a row linear's reduce-scatter and the next gather) weighs 1/t, and so do the
statistics of an op that runs on split data (attention's log-sum-exp, a sequence-parallel norm's rstd);
the rest weighs whole. A matmul of a replicated or column-parallel weight reading a split value keeps its
input gathered whole (the all-gather's output, not the split value): once per module that gathers its
input (``GatherSequenceInput``, the key ``value:gathered``), once per linear that gathers its own.
Inside a pipeline stage the column-parallel linears read their input through Megatron's f
(``runtime.tensor_parallel_stages.tp_copy``, a clone that survives tracing): each keeps its own copy
(``RankShare.copies``, the key ``linear:copy``), where a DTensor layout keeps the one input they share.

Where CUDA differs from these kernels (the dry run's fake tensors are CPU tensors): torch ≥ 2.8
runs ``rms_norm`` on CUDA as ``_fused_rms_norm``, which keeps the 16-bit input and rstd (2 B per
element) where the composite keeps two fp32 tensors (8 B): a CUDA rank keeps 6 B per norm element
less than priced here (benchmarks/RESULTS.md, "Dry run").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from autoshard.cost.casts import sixteen_bit_casts
from autoshard.ir.graph import OpGraph, OpNode, dtype_bytes
from autoshard.ir.names import CAST_OPS, op_name
from autoshard.ir.names import VIEW_OPS as NAMED_VIEW_OPS

FP32_BYTES = 4
INDEX_BYTES = 8  # int64 token ids
MASK_BYTES = 1  # a dropout mask is a bool tensor

# views, and casts that change nothing: their output is their input's storage (``_is_view``)
VIEW_OPS = NAMED_VIEW_OPS | CAST_OPS
MATMUL_OPS = frozenset({"linear", "mm", "addmm", "matmul", "bmm", "baddbmm", "einsum"})
SDPA_OPS = frozenset(
    {
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    }
)
_SAVES_NOTHING = frozenset(
    {
        "add",
        "sub",
        "neg",
        "cat",
        "stack",
        "repeat_interleave",
        "repeat",
        "arange",
        "zeros",
        "ones",
        "full",
        "zeros_like",
        "ones_like",
        "full_like",
        "empty",
        "sum",
        "mean",
        "outer",
        "cos",
        "sin",
        "triu",
        "tril",
        "masked_fill",
        "where",
        "index_select",
        "gather",
        "rsub",
        "copy",
        "fill",
        "scalar_tensor",
        "pad",
        "constant_pad_nd",
        "to",  # ToCopyBackward and CloneBackward keep no tensor
        "_to_copy",
        "type_as",
        "clone",
        "contiguous",
    }
)
_INPUT_SAVERS = frozenset(
    {"silu", "gelu", "pow", "log", "square", "abs", "hardswish", "mish", "softplus", "elu", "leaky_relu"}
)
_OUTPUT_SAVERS = frozenset(
    {"relu", "tanh", "sigmoid", "softmax", "_softmax", "exp", "log_softmax", "_log_softmax", "rsqrt"}
)
_DROPOUT_OPS = frozenset({"dropout", "feature_dropout", "alpha_dropout", "native_dropout"})


@dataclass(frozen=True)
class RankShare:
    """What one tensor-parallel rank keeps of each saved tensor (module doc): ``split`` values (storage
    names) weigh 1/tp, as do the statistics of ``split_ops``; ``gathers`` are the matmuls that keep their
    split input gathered whole, ``gathers_own`` those of them that gather it themselves (one copy each);
    ``copies`` the matmuls that keep a copy of their own input (a pipeline stage's column-parallel linears);
    ``partial`` the matmuls whose local output is a partial sum of the whole shape (row-parallel: a collective
    then reduces it), ``gathered_out`` those whose split output a collective then gathers whole (colwise-gather):
    selective recompute keeps both the matmul's own output and the collective's (``cost.memory``)."""

    tp: int = 1
    split: frozenset[str] = frozenset()
    split_ops: frozenset[str] = frozenset()
    gathers: frozenset[str] = frozenset()
    gathers_own: frozenset[str] = frozenset()
    copies: frozenset[str] = frozenset()
    partial: frozenset[str] = frozenset()
    gathered_out: frozenset[str] = frozenset()

    def entry(self, graph: OpGraph, node: OpNode, key: str, nbytes: int) -> tuple[str, int]:
        """(key, bytes on this rank) of what ``node`` keeps as (``key``, ``nbytes`` whole)."""
        if self.tp == 1:
            return key, nbytes
        if node.name in self.copies:
            return f"{node.name}:copy", nbytes // self.tp if key in self.split else nbytes
        if key in self.split and node.name in self.gathers:
            return (f"{node.name}:gathered" if node.name in self.gathers_own else f"{key}:gathered"), nbytes
        base, _, stat = key.partition(":")
        split = base in self.split_ops and stat not in ("ids", "gathered") if stat else key in self.split
        return key, nbytes // self.tp if split else nbytes

    def value_bytes(self, graph: OpGraph, name: str, ratio: float) -> int:
        """``value_bytes`` of one TP rank's part of ``name``."""
        nbytes = value_bytes(graph, name, ratio)
        return nbytes // self.tp if self.tp > 1 and storage_of(graph, name, ratio) in self.split else nbytes


WHOLE = RankShare()  # no tensor parallelism: every tensor whole


def storage_of(graph: OpGraph, name: str, ratio: float = 1.0) -> str:
    """The value whose storage ``name`` is: follow views (``VIEW_OPS``) back to a materialised tensor (once per
    value of a graph: the search asks for the same values' storage hundreds of thousands of times). With 16-bit
    activations (``ratio`` < 1) the model's own casts that copy are storages (``cost.casts``)."""
    known = graph.derived(("storage_of", ratio < 1), dict)
    if name not in known:
        node, storage = graph._by_name().get(name), name
        while node is not None and node.inputs and _is_view(graph, node, ratio):
            storage = node.inputs[0]
            node = graph._by_name().get(storage)
        known[name] = storage
    return known[name]


def _is_view(graph: OpGraph, node: OpNode, ratio: float = 1.0) -> bool:
    op = op_name(node.target)
    if op in CAST_OPS:
        if ratio < 1 and node.name in sixteen_bit_casts(graph).copies:
            return False  # a no-op as captured in fp32, a copy in 16 bits
        return graph.value_meta(node.inputs[0]) == (node.shape, node.dtype)  # a cast that changes nothing
    if op in _DROPOUT_OPS:
        return node.attrs.get("p") == 0 or node.attrs.get("train") is False
    return op in VIEW_OPS


def needs_grad(graph: OpGraph) -> set[str]:
    """Values whose gradient backward computes: parameters (not buffers) and what is computed from them (once per
    graph; the set is shared, not to be changed)."""
    return graph.derived(("needs_grad",), lambda: _needs_grad(graph))


def _needs_grad(graph: OpGraph) -> set[str]:
    params = {name for name, path in graph.placeholder_params.items() if not graph.param(path).is_buffer}
    out = set(params)
    for node in graph.nodes:
        if (
            node.param_inputs
            and any(not graph.param(p).is_buffer for p in node.param_inputs)
            or any(i in out for i in node.inputs)
        ):
            out.add(node.name)
    return out


def saved_by(
    graph: OpGraph, node: OpNode, grads: set[str], ratio: float, share: RankShare = WHOLE
) -> list[tuple[str, int]]:
    """(key, bytes as trained at the captured batch) of what ``node``'s backward keeps (module doc), on one
    TP rank of ``share``. ``grads``: ``needs_grad(graph)``; ``ratio``: trained activation bytes over captured."""
    kept = _saved_whole(graph, node, grads, ratio)
    return kept if share.tp == 1 else [share.entry(graph, node, key, nbytes) for key, nbytes in kept]


def _saved_whole(graph: OpGraph, node: OpNode, grads: set[str], ratio: float) -> list[tuple[str, int]]:
    if node.name not in grads or _is_view(graph, node, ratio):
        return []
    op = op_name(node.target)
    acts = [i for i in node.inputs if i not in graph.placeholder_params]
    if op in MATMUL_OPS:
        return _values(graph, acts, ratio)
    if op in SDPA_OPS:
        return _values(graph, acts[:3] + [node.name], ratio) + [(f"{node.name}:lse", _lse_bytes(node))]
    if op == "mul" or op == "div":
        return _mul_saved(graph, node, grads, ratio)
    if op == "rms_norm":
        return _rms_norm_saved(graph, node, ratio)
    if op in ("layer_norm", "native_layer_norm", "group_norm"):
        return _values(graph, acts[:1], ratio) + [(f"{node.name}:stats", 2 * _rows(node) * FP32_BYTES)]
    if op in ("embedding", "embedding_bag"):
        return [(f"{node.name}:ids", _numel(graph.value_meta(node.inputs[-1])[0]) * INDEX_BYTES)]
    if op in _DROPOUT_OPS:
        return [(f"{node.name}:mask", node.output_numel * MASK_BYTES)]
    if op in _SAVES_NOTHING:
        return []
    if op in _INPUT_SAVERS:
        return _values(graph, acts[:1], ratio)
    if op in _OUTPUT_SAVERS:
        return _values(graph, [node.name], ratio)
    return [(node.name, value_bytes(graph, node.name, ratio))]


def weight_grad_inputs(graph: OpGraph, nodes: Iterable[OpNode], ratio: float, share: RankShare = WHOLE) -> int:
    """Bytes of the gradients of ``nodes``' outputs that read a trained parameter (not a view of one), on one TP
    rank: what torch's split backward keeps of a micro-batch from its input pass to its weight pass
    (``stage_backward_input`` hooks the op where each weight's path meets the inputs' and keeps the gradient
    flowing into it; ``stage_backward_weight`` starts from those)::

        G = Σ_{n reads a trained parameter} |out(n)|      a linear's dy, a norm's weight-mul's, the head's logits'"""
    total = 0
    for node in nodes:
        if not node.param_inputs or _is_view(graph, node, ratio):
            continue
        if any(not graph.param(p).is_buffer for p in node.param_inputs):
            total += share.value_bytes(graph, node.name, ratio)
    return total


def saved_set(
    graph: OpGraph, nodes: Iterable[OpNode], ratio: float, grads: set[str] | None = None, share: RankShare = WHOLE
) -> dict[str, int]:
    """The union of what ``nodes`` keep: storage key -> bytes (a tensor kept by several ops once)."""
    grads = needs_grad(graph) if grads is None else grads
    kept: dict[str, int] = {}
    for node in nodes:
        kept.update(saved_by(graph, node, grads, ratio, share))
    return kept


def value_bytes(graph: OpGraph, name: str, ratio: float) -> int:
    """Bytes of a graph value as trained: activations at ``ratio`` of their captured bytes, integers whole, and
    the values the model upcasts itself in fp32 where activations run in 16 bits (``cost.casts``)."""
    shape, dtype = graph.value_meta(name)
    nbytes = _numel(shape) * dtype_bytes(dtype) if dtype else 0
    if ratio < 1 and name in sixteen_bit_casts(graph).upcast:
        return nbytes
    return int(nbytes * ratio) if dtype.startswith(("float", "bfloat")) else nbytes


def _values(graph: OpGraph, names: list[str], ratio: float) -> list[tuple[str, int]]:
    return [(key, value_bytes(graph, key, ratio)) for key in (storage_of(graph, n, ratio) for n in names)]


def _mul_saved(graph: OpGraph, node: OpNode, grads: set[str], ratio: float) -> list[tuple[str, int]]:
    """mul(x, y): y if x needs a gradient, x if y does; div(x, y) keeps y, and x if y needs one."""
    if len(node.inputs) < 2:  # times a scalar
        return []
    x, y = node.inputs[:2]
    keep = ([y] if x in grads else []) + ([x] if y in grads else [])
    return _values(graph, [n for n in keep if n not in graph.placeholder_params], ratio)  # weights are state


def _rms_norm_saved(graph: OpGraph, node: OpNode, ratio: float) -> list[tuple[str, int]]:
    """torch's composite rms_norm: x upcast to fp32 (x itself when fp32 already), x·rstd in fp32, rstd."""
    x = node.inputs[0]
    elements = _numel(graph.value_meta(x)[0])
    trained = value_bytes(graph, x, ratio)
    upcast = (
        [(storage_of(graph, x, ratio), trained)]
        if trained >= elements * FP32_BYTES
        else [(f"{node.name}:upcast", elements * FP32_BYTES)]
    )
    return upcast + [(f"{node.name}:normed", elements * FP32_BYTES), (f"{node.name}:rstd", _rows(node) * FP32_BYTES)]


def _lse_bytes(node: OpNode) -> int:
    """The log-sum-exp of attention: one fp32 per (batch, head, query)."""
    return _numel(node.shape[:-1]) * FP32_BYTES


def _rows(node: OpNode) -> int:
    return _numel(node.shape[:-1])


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
