"""Annotate: forward FLOPs and bytes moved for every OpNode, from shapes alone.

FLOPs count a multiply-add as 2. For an op with output ``out`` and inputs ``x``, ``w``::

    linear(x, w[out_f, in_f])      2 · prod(x.shape[:-1]) · in_f · out_f     (bias not counted)
    matmul(a, b), mm, bmm, addmm   2 · numel(out) · a.shape[-1]               (K multiply-adds per output)
    grouped mm (a, b, offs)        2 · S · K · N                              (MoE experts: each of the S rows
                                                                             meets one group's [K, N] weight)
    einsum                         2 · numel(out) · prod(sizes of the contracted letters)
    conv (any)                     2 · numel(out) · in_channels/groups · prod(kernel)
    sdpa(q[B,H,L,E], k[B,Hk,S,E], v[B,Hk,S,Ev])
                                   2·B·H·L·S·E + 2·B·H·L·S·Ev                 (QKᵀ and PV; no causal
                                                                             discount, as PaLM's MFU
                                                                             and flop_counter)
    pointwise / norm / softmax     c_op · numel(out)                          (c_op in POINTWISE_FLOPS)
    reduction                      c_op · numel(input)                        (c_op in REDUCTION_FLOPS)
    alias (views), copies, creation  0

``torch.utils.flop_counter``'s registered formulas (``flop_registry``: mm, addmm, bmm,
baddbmm, convolution, the ``_scaled_dot_product_*`` kernels) are used for the ops they
cover; the training IR keeps higher-level ops (linear, matmul, scaled_dot_product_attention,
conv2d) whose formulas are written here from shapes.

Grouped matmuls (``GROUPED_MM_TARGETS``: ``aten._grouped_mm`` = ``F.grouped_mm``, its fp8
``_scaled_grouped_mm``, and transformers' CPU ``grouped_mm_fallback``) run a mixture of experts:
a[S, K] holds the token-expert pairs sorted by expert, b[E, K, N] the experts' weights, ``offs``
the end row of each expert's group; out[S, N]. Every row is multiplied by exactly one expert's
[K, N] matrix, so the count is 2·S·K·N whatever the routing (rows past ``offs[-1]`` are counted:
an upper bound; transformers routes all S). The shapes torch allows (its meta kernel,
``_create_grouped_mm_output_tensor``)::

    a[S, K]    · b[E, K, N]   -> out[S, N]      2 · numel(out) · K      (rows split by offs: forward)
    a[E, M, K] · b[E, K, N]   -> out[E, M, N]   2 · numel(out) · K      (a batched mm)
    a[E, M, K] · b[K, N]      -> out[M, N]      2 · numel(out) · K      (columns of b split by offs)
    a[M, K]    · b[K, N]      -> out[E, M, N]   2 · M · K · N           (K split by offs: weight grads;
                                                                         Σ_e K_e = K, not E·K)

A grouped mm reads its whole weight, all E experts, whichever rows each gets: the weight input
(a transposed view of the [E, N, K] parameter in transformers) counts in full in bytes_read.

Bytes (for the memory-bound side of the roofline in cost/compute)::

    bytes_read    = Σ bytes of the distinct tensor inputs, parameters included
                    (an embedding counts its whole table: an upper bound, and what cost/compute
                    assumes when it separates weight bytes from activation bytes)
    bytes_written = Σ bytes of the tensor outputs
    alias ops     read 0 and write 0: ALIAS_OPS, a ``to`` that keeps the dtype, dropout with p = 0
                  (views share storage; ``reshape`` and ``contiguous`` of a
                  non-contiguous tensor copy in reality — strides are not captured: reshape is
                  counted as a view, contiguous as a copy)
    creation ops  read 0 (arange, zeros, full, ...)

The constants are operation counts of each op's textbook definition (one per add, multiply,
compare or transcendental); they matter little next to matmuls but make the memory-bound ops
visible. Ops in no table get 0 FLOPs and their bytes: unknown ops are charged for memory only.
Higher-order ops (``higher_order.cond``, ``higher_order.wrap_with_set_grad_enabled``, as HF
Llama's rotary table) are such ops: the ops inside their bodies are not counted.

A formula that fails on a node (a registry formula that does not take an argument as the op was
called, a shape it does not expect) never fails the plan: the node gets an estimate instead, is
marked ``attrs[ESTIMATED] = True`` and is counted in the plan's ``model.ops_estimated``::

    estimated FLOPs  2 · numel(out) · max(last dimension of each tensor input)
                     (an upper bound for the matmul family, mm/addmm/bmm/baddbmm/matmul/linear:
                     K is the last dimension of the first matrix; a rough figure for others)
    estimated bytes  bytes_read = Σ bytes of the inputs it can size, bytes_written = outputs
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.names import NO_OP_OPS, VIEW_OPS, is_random, op_name

if TYPE_CHECKING:  # torch is imported where FLOPs are counted; op_name and is_alias serve the
    import torch  # cost model on graphs from the capture cache, where torch is never imported

# Ops that return a view or alias of an input, or compute nothing: no FLOPs, no bytes (ir.names' lists: aten op
# names without overload, in-place variants "add_" looked up as "add", or full targets)
ALIAS_OPS = VIEW_OPS | NO_OP_OPS

# Pointwise, normalisation and softmax-like ops: FLOPs per output element.
POINTWISE_FLOPS = {
    # one operation per element
    **dict.fromkeys(
        [
            "add",
            "sub",
            "rsub",
            "mul",
            "div",
            "neg",
            "abs",
            "sign",
            "square",
            "reciprocal",
            "sqrt",
            "rsqrt",
            "exp",
            "exp2",
            "expm1",
            "log",
            "log2",
            "log10",
            "log1p",
            "sin",
            "cos",
            "tan",
            "tanh",
            "erf",
            "erfc",
            "pow",
            "floor",
            "ceil",
            "round",
            "trunc",
            "frac",
            "remainder",
            "fmod",
            "maximum",
            "minimum",
            "clamp",
            "clamp_min",
            "clamp_max",
            "relu",
            "relu6",
            "threshold",
            "hardtanh",
            "where",
            "masked_fill",
            "fill",
            "eq",
            "ne",
            "lt",
            "le",
            "gt",
            "ge",
            "logical_and",
            "logical_or",
            "logical_not",
            "logical_xor",
            "bitwise_and",
            "bitwise_or",
            "bitwise_xor",
            "bitwise_not",
            "__and__",
            "__or__",
            "__xor__",
            "__invert__",
            "isnan",
            "isinf",
            "isfinite",
            "nan_to_num",
            "tril",
            "triu",
            "diff",
        ],
        1,
    ),
    # two operations: fused multiply-add forms and dropout (mask compare, scale)
    **dict.fromkeys(
        [
            "addcmul",
            "addcdiv",
            "lerp",
            "leaky_relu",
            "hardsigmoid",
            "dropout",
            "feature_dropout",
            "alpha_dropout",
            "native_dropout",
        ],
        2,
    ),
    # activations, as the count of their primitive operations
    "elu": 3,
    "celu": 3,
    "selu": 4,
    "softplus": 3,
    "hardswish": 4,
    "sigmoid": 4,
    "logsigmoid": 5,
    "silu": 5,
    "mish": 7,
    "gelu": 8,
    "glu": 5,
    # normalisations over the last dims: mean, subtract, square, mean, rsqrt·x, scale, shift
    "layer_norm": 7,
    "native_layer_norm": 7,
    "group_norm": 7,
    "native_group_norm": 7,
    "batch_norm": 7,
    "native_batch_norm": 7,
    "_native_batch_norm_legit": 7,
    "_native_batch_norm_legit_no_training": 5,
    "instance_norm": 7,
    "rms_norm": 4,
    "_fused_rms_norm": 4,  # square, mean, rsqrt·x, scale
    # softmax: max, subtract, exp, sum, divide (log-softmax: log and subtract instead of divide)
    "softmax": 5,
    "_softmax": 5,
    "log_softmax": 5,
    "_log_softmax": 5,
    "safe_softmax": 5,
    "_safe_softmax": 5,
}

# Reductions: FLOPs per *input* element.
REDUCTION_FLOPS = {
    **dict.fromkeys(
        [
            "sum",
            "mean",
            "amax",
            "amin",
            "max",
            "min",
            "argmax",
            "argmin",
            "prod",
            "cumsum",
            "cumprod",
            "all",
            "any",
            "nansum",
            "count_nonzero",
        ],
        1,
    ),
    "norm": 2,
    "linalg_vector_norm": 2,
    "var": 3,
    "std": 3,
    "var_mean": 3,
    "std_mean": 3,
    "logsumexp": 3,
    "cross_entropy_loss": 6,
    "nll_loss": 1,
    "nll_loss_forward": 1,
    "mse_loss": 3,
    "l1_loss": 2,
    "smooth_l1_loss": 3,
    "binary_cross_entropy_with_logits": 6,
}

# Ops that make a tensor from nothing: they write their output and read nothing.
CREATION_OPS = frozenset(
    {
        "arange",
        "zeros",
        "ones",
        "full",
        "empty",
        "empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
        "new_empty",
        "zeros_like",
        "ones_like",
        "full_like",
        "empty_like",
        "rand",
        "randn",
        "randint",
        "rand_like",
        "randn_like",
        "randint_like",
        "randperm",
        "scalar_tensor",
        "linspace",
        "logspace",
        "eye",
        "tensor",
        "lift_fresh_copy",
    }
)


ESTIMATED = "flops_estimated"  # key of OpNode.attrs marking a node whose cost is estimated (module doc)


def annotate(graph: OpGraph) -> OpGraph:
    """Fill ``flops``, ``bytes_read`` and ``bytes_written`` of every node (in place; returns graph).
    A node whose formula raises gets the module docstring's estimate and ``attrs[ESTIMATED]``."""
    for node in graph.nodes:
        node.attrs.pop(ESTIMATED, None)
        try:
            node.flops = node_flops(graph, node)
            node.bytes_read, node.bytes_written = node_bytes(graph, node)
        except Exception:  # noqa: BLE001 - any formula's failure on any op: estimate, never fail the plan
            node.flops = estimated_flops(graph, node)
            node.bytes_read, node.bytes_written = estimated_bytes(graph, node)
            node.attrs[ESTIMATED] = True
    return graph


def estimated_ops(graph: OpGraph) -> list[OpNode]:
    """The nodes whose cost ``annotate`` estimated, in graph order."""
    return [node for node in graph.nodes if node.attrs.get(ESTIMATED)]


def random_ops(graph: OpGraph) -> dict[str, list[str]]:
    """The graph's random ops (``ir.names.is_random``: a drop-out with p = 0 is not one): op target -> the
    modules calling it, a run of numbered layers written once with "*" ("encoder.layer.*.drop_path"), sorted."""
    found: dict[str, set[str]] = {}
    for node in graph.nodes:
        if is_random(node.target, node.attrs):
            found.setdefault(node.target, set()).add(re.sub(r"(?<=\.)\d+(?=\.|$)", "*", node.module_path) or "(root)")
    return {target: sorted(modules) for target, modules in sorted(found.items())}


def estimated_flops(graph: OpGraph, node: OpNode) -> int:
    """2 · numel(out) · max(last dimension of each tensor input it can size) (module doc)."""
    last_dims = [shape[-1] for shape in _known_shapes(graph, node) if shape]
    return 2 * node.output_numel * max(last_dims, default=1)


def estimated_bytes(graph: OpGraph, node: OpNode) -> tuple[int, int]:
    """(Σ bytes of the inputs it can size, bytes of the outputs)."""
    read = 0
    for name in dict.fromkeys(node.inputs):
        try:
            read += graph.value_bytes(name)
        except Exception:  # noqa: BLE001 - an input without metadata reads nothing we can count
            continue
    return read, node.output_bytes


def _known_shapes(graph: OpGraph, node: OpNode) -> list[tuple[int, ...]]:
    shapes = []
    for name in node.inputs:
        try:
            shapes.append(tuple(_shape(graph, name)))
        except Exception:  # noqa: BLE001 - as estimated_bytes
            continue
    return shapes


def node_flops(graph: OpGraph, node: OpNode) -> int:
    """Forward FLOPs of one node (module docstring)."""
    op = op_name(node.target)
    if is_alias(graph, node):
        return 0
    if op in MATMUL_FORMULAS:
        return MATMUL_FORMULAS[op](graph, node)
    registered = _registry_flops(graph, node)
    if registered is not None:
        return registered
    if op in POINTWISE_FLOPS:
        return POINTWISE_FLOPS[op] * node.output_numel
    if op in REDUCTION_FLOPS and node.inputs:
        return REDUCTION_FLOPS[op] * _numel(_shape(graph, node.inputs[0]))
    return 0


def node_bytes(graph: OpGraph, node: OpNode) -> tuple[int, int]:
    """(bytes_read, bytes_written): distinct tensor inputs and all tensor outputs; 0 for aliases."""
    if is_alias(graph, node):
        return 0, 0
    written = node.output_bytes
    if op_name(node.target) in CREATION_OPS:
        return 0, written
    return sum(graph.value_bytes(name) for name in dict.fromkeys(node.inputs)), written


def is_alias(graph: OpGraph, node: OpNode) -> bool:
    """A view or no-op: in ALIAS_OPS, a ``to`` that keeps the dtype, or dropout with p = 0."""
    op = op_name(node.target)
    if op in ALIAS_OPS:
        return True
    if op in ("to", "type_as") and node.inputs:
        return graph.value_meta(node.inputs[0]) == (node.shape, node.dtype)
    if op in ("dropout", "feature_dropout", "alpha_dropout"):
        return node.attrs.get("p") == 0 or node.attrs.get("train") is False
    return False


# ---------------------------------------------------------------------------- matmul-class formulas


def _shape(graph: OpGraph, name: str) -> tuple[int, ...]:
    return graph.value_meta(name)[0]


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def linear_flops(graph: OpGraph, node: OpNode) -> int:
    """2 · prod(x.shape[:-1]) · in_features · out_features."""
    x, w = _shape(graph, node.inputs[0]), _shape(graph, node.inputs[1])
    out_features = w[0] if len(w) == 2 else 1
    return 2 * _numel(x[:-1]) * x[-1] * out_features


def matmul_flops(graph: OpGraph, node: OpNode) -> int:
    """2 · numel(out) · K, K = a.shape[-1]: each output element is K multiply-adds (any broadcast)."""
    return 2 * node.output_numel * _shape(graph, node.inputs[0])[-1]


def einsum_flops(graph: OpGraph, node: OpNode) -> int:
    """2 · numel(out) · prod(sizes of the letters summed away)."""
    lhs, _, rhs = str(node.attrs.get("equation", "")).replace(" ", "").partition("->")
    sizes: dict[str, int] = {}
    for operand, name in zip(lhs.split(","), node.inputs):
        letters = operand.replace("...", "")
        shape = _shape(graph, name)
        tail = shape[len(shape) - len(letters) :] if "..." in operand else shape[: len(letters)]
        sizes.update(zip(letters, tail))
    contracted = [size for letter, size in sizes.items() if letter not in rhs]
    return 2 * node.output_numel * math.prod(contracted)


def conv_flops(graph: OpGraph, node: OpNode) -> int:
    """``flop_counter.conv_flop_count``: 2 · numel(out) · in_channels/groups · prod(kernel)."""
    x, w = _shape(graph, node.inputs[0]), _shape(graph, node.inputs[1])
    import torch.utils.flop_counter as flop_counter

    transposed = op_name(node.target).startswith("conv_transpose")
    return int(flop_counter.conv_flop_count(list(x), list(w), list(node.shape), transposed=transposed))


def sdpa_flops(graph: OpGraph, node: OpNode) -> int:
    """QKᵀ and PV: 2·B·H·L·S·(E + Ev), by ``flop_counter.sdpa_flop_count`` (GQA allowed)."""
    import torch.utils.flop_counter as flop_counter

    q, k, v = (_as_bhse(_shape(graph, name)) for name in node.inputs[:3])
    return int(flop_counter.sdpa_flop_count(q, k, v))


def _as_bhse(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(..., L, E) as (batch, heads, L, E): leading dims beyond the heads fold into the batch."""
    padded = (1,) * max(0, 4 - len(shape)) + tuple(shape)
    return (_numel(padded[:-3]), *padded[-3:])


def grouped_mm_flops(graph: OpGraph, node: OpNode) -> int:
    """2·S·K·N: every row of a[S, K] times one group's [K, N]; a[M, K]·b[K, N] split on K: 2·M·K·N."""
    a, b = _shape(graph, node.inputs[0]), _shape(graph, node.inputs[1])
    if len(a) == 2 and len(b) == 2:  # out[E, M, N], the groups partition K
        return 2 * a[0] * a[1] * b[1]
    return 2 * node.output_numel * a[-1]


# Targets (prefixes) of grouped matmuls: the MoE experts' GEMMs (module doc).
GROUPED_MM_TARGETS = ("aten._grouped_mm.", "aten._scaled_grouped_mm.", "transformers.grouped_mm_fallback.")

MATMUL_FORMULAS: dict[str, Callable[[OpGraph, OpNode], int]] = {
    "linear": linear_flops,
    "_grouped_mm": grouped_mm_flops,
    "_scaled_grouped_mm": grouped_mm_flops,
    "transformers.grouped_mm_fallback.default": grouped_mm_flops,
    "matmul": matmul_flops,
    "einsum": einsum_flops,
    "scaled_dot_product_attention": sdpa_flops,
    **dict.fromkeys(
        ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"], conv_flops
    ),
}


def _registry_flops(graph: OpGraph, node: OpNode) -> int | None:
    """FLOPs from ``flop_counter.flop_registry`` for the aten ops it covers, else None.

    The formulas take the op's arguments with tensors replaced by shapes; they are rebuilt
    from the schema as an ordinary call makes them: Tensor arguments from ``node.inputs`` in
    order, the rest from ``attrs``; positional ones with trailing defaults left off
    (``addmm_flop`` takes no beta), keyword-only ones (addmm's ``beta``, ``alpha``) as keywords
    when not the default.
    """
    import torch.utils.flop_counter as flop_counter

    overload = _overload(node.target)
    formula = flop_counter.flop_registry.get(overload.overloadpacket) if overload is not None else None
    if formula is None:
        return None
    schema_args = overload._schema.arguments
    shapes = iter(_shape(graph, name) for name in node.inputs)
    values = [node.attrs[a.name] if a.name in node.attrs else next(shapes) for a in schema_args]
    args = [v for a, v in zip(schema_args, values) if not a.kwarg_only]
    kwargs = {
        a.name: v
        for a, v in zip(schema_args, values)
        if a.kwarg_only and not (a.has_default_value() and v == a.default_value)
    }
    while (
        args and schema_args[len(args) - 1].has_default_value() and args[-1] == schema_args[len(args) - 1].default_value
    ):
        args.pop()
    return int(formula(*args, out_val=node.shape, **kwargs))


def _overload(target: str) -> torch._ops.OpOverload | None:
    import torch

    parts = target.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return None
    packet = getattr(torch.ops.aten, parts[1], None)
    return getattr(packet, parts[2], None) if packet is not None else None
