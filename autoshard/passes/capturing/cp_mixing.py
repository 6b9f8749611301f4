"""The CP proof's op rules (``cp_proof`` step 3, ``mixing``): whether an op of a cp rank's local program mixes
the tokens of its sequence dims, i.e. computes something other than its share of the one-process op (a
reduction or a contraction over the sequence, a view that folds it, taking some of the tokens), by op family.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from autoshard.ir.names import op_name
from autoshard.passes.capturing.capture import target_name
from autoshard.passes.capturing.cp_local import (
    WRAPPERS,
    Local,
    StaticSizes,
    SymbolicSizes,
    bound_args,
    is_sdpa,
    show_shape,
    tensors,
)


class Call:
    """One call as ``mixing`` reads it: its arguments, and the sequence dims of its tensor inputs."""

    def __init__(self, node: torch.fx.Node, local: Local):
        self.node, self.local, self.args = node, local, bound_args(node)
        self.out = local.seq.get(node, ())
        self.out_rank = len(tensors(node)[0].shape)
        self.inputs = [x for x in node.all_input_nodes if x.op != "get_attr" and tensors(x)]

    def seq(self, x: Any) -> tuple[int, ...]:
        return self.local.seq.get(x, ()) if isinstance(x, torch.fx.Node) else ()

    def rank(self, x: Any) -> int:
        return tensors(x)[0].dim() if isinstance(x, torch.fx.Node) and tensors(x) else 0

    def any_seq(self) -> bool:
        return bool(self.out) or any(self.seq(x) for x in self.inputs)

    def dims(self, name: str, x: Any) -> set[int] | None:
        """The dims named by argument ``name`` of input ``x``, normalized; None for every dim."""
        value = self.args.get(name)
        n = max(self.rank(x), 1)
        if value is None or value == []:
            return None
        values = value if isinstance(value, (list, tuple)) else [value]
        return {int(v) % n for v in values}

    def shape(self, x: torch.fx.Node) -> str:
        return show_shape(x, self.local)


def mixing(node: torch.fx.Node, local: Local) -> str | None:
    """Why ``node`` mixes tokens along a sequence dim (module doc, step 3), or None."""
    call = Call(node, local)
    name = target_name(node.target)
    if not call.any_seq():
        return None
    if is_sdpa(node):
        return _attention(call)
    if name.endswith(WRAPPERS) or name == "operator.getitem":
        return None  # the wrapped ops were checked one by one; getitem picks an output
    pairs = [x for x in [node, *call.inputs] if len(call.seq(x)) > 1]
    if pairs:
        return f"makes a tensor of token pairs {call.shape(pairs[0])}: a cp rank would pair only its own tokens"
    rule = RULES.get(op_name(name))
    if rule is None:
        return f"is not known to act token by token, and it reads or writes the sequence ({call.shape(node)})"
    try:
        return rule(call)
    except Exception as exc:  # arguments this rule did not expect: refused, not assumed
        return f"has arguments the proof cannot read ({type(exc).__name__}: {exc})"


def _first_input(call: Call) -> torch.fx.Node | None:
    return next((x for x in call.node.args if isinstance(x, torch.fx.Node)), None)


def _pointwise(call: Call) -> str | None:
    """Broadcast token by token: each input's sequence dim lands, right-aligned, on the output's."""
    for x in call.inputs:
        shift = call.out_rank - call.rank(x)
        if any(d + shift not in call.out for d in call.seq(x)):
            return f"broadcasts the sequence of {call.shape(x)} onto another dim of {call.shape(call.node)}"
    return _no_source(call)


def _no_source(call: Call) -> str | None:
    """A sequence dim out of inputs that have none is a table read by length (``rope_cos[:s]``), unless made
    of constants."""
    if call.out and not any(call.seq(x) for x in call.inputs):
        rows = call.local.sizes.at_s(tensors(call.node)[0].shape[call.out[0]])
        return (
            f"slices {rows} rows out of a tensor that does not carry the sequence ({call.shape(call.node)} on "
            f"a cp rank; a precomputed position table?): every cp rank would take the first rank's rows"
        )
    return None


def _along(what: str, name: str = "dim", whole_if_none: bool = True) -> Callable[[Call], str | None]:
    """Ops that act along the dims named by argument ``name`` (all of them when it is None)."""

    def rule(call: Call) -> str | None:
        x = _first_input(call)
        dims = call.dims(name, x)
        hit = sorted(set(call.seq(x)) if dims is None and whole_if_none else set(call.seq(x)) & (dims or set()))
        if hit:
            return f"{what} (dim {hit[0]} of {call.shape(x)})"
        return _no_source(call)

    return rule


def _expand(call: Call) -> str | None:
    """A broadcast: the input's sequence dims stay, size-1 dims may grow to t (the same value per token)."""
    x = _first_input(call)
    shift = call.out_rank - call.rank(x)
    if any(d + shift not in call.out for d in call.seq(x)):
        return f"moves the sequence of {call.shape(x)} in {call.shape(call.node)}"
    return None


def _leading(call: Call) -> str | None:
    """view_as_real / view_as_complex: the last dim changes, the others keep their place."""
    x = _first_input(call)
    last = min(call.rank(x), call.out_rank) - 1
    if any(d >= last for d in call.seq(x)) or set(call.seq(x)) != set(call.out):
        return f"moves the sequence of {call.shape(x)} in {call.shape(call.node)}"
    return None


def _stack(call: Call) -> str | None:
    """Stacking inserts a dim at ``dim``; each input's sequence dim moves past it, and no token mixes."""
    tensors = [x for x in call.args.get("tensors", []) if isinstance(x, torch.fx.Node)]
    at = int(call.args.get("dim", 0)) % call.out_rank
    for x in tensors:
        if any((d if d < at else d + 1) not in call.out for d in call.seq(x)):
            return f"stacks {call.shape(x)} with its sequence on another dim"
    return None


def _constant(call: Call) -> str | None:
    return None  # the same value at every token: a rank's part of it is itself


def _layout(call: Call) -> str | None:
    """Transposes and the like move dims; the tokens stay whole."""
    return _no_source(call)


def _view(call: Call) -> str | None:
    """A view keeps each token's elements together when the elements after the sequence dim are the same
    number before and after (B·t merges, head splits); anything else moves the tokens."""
    x = _first_input(call)
    before, after = call.seq(x), call.out
    if not before:
        return _no_source(call)
    if len(after) != 1:
        return f"reshapes {call.shape(x)} to {call.shape(call.node)}, losing the sequence dim"
    inner_in = math.prod(int(d) for d in tensors(x)[0].shape[before[0] + 1 :])
    inner_out = math.prod(int(d) for d in tensors(call.node)[0].shape[after[0] + 1 :])
    if inner_in != inner_out:
        return f"reshapes {call.shape(x)} to {call.shape(call.node)}, which moves tokens into other dims"
    return None


def _slice(call: Call) -> str | None:
    """A slice of the whole sequence keeps it; any other slice along it takes some tokens."""
    x, dim = call.args["self"], int(call.args.get("dim", 0)) % max(call.rank(call.args["self"]), 1)
    if dim in call.seq(x):
        whole = str(tensors(x)[0].shape[dim]) == str(tensors(call.node)[0].shape[dim])
        if not (whole and call.args.get("start") in (None, 0) and call.args.get("step", 1) == 1):
            return f"takes some of the tokens (dim {dim} of {call.shape(x)} to {call.shape(call.node)})"
    return _no_source(call)


def _cat(call: Call) -> str | None:
    tensors = [x for x in call.args.get("tensors", []) if isinstance(x, torch.fx.Node)]
    dim = int(call.args.get("dim", 0))
    for x in tensors:
        if dim % max(call.rank(x), 1) in call.seq(x):
            return f"joins tensors along the sequence (dim {dim % call.rank(x)} of {call.shape(x)})"
    return _no_source(call)


def _index(call: Call) -> str | None:
    """``x[idx]``: indexing a sequence dim takes tokens; indexing a table *by* tokens is a lookup."""
    x, indices = call.args["self"], call.args.get("indices", [])
    for d, idx in enumerate(indices):
        if idx is not None and d in call.seq(x):
            return f"takes tokens by index (dim {d} of {call.shape(x)})"
    return None


def _gather(call: Call) -> str | None:
    x = call.args["self"]
    dims = call.dims("dim", x)
    hit = set(call.seq(x)) if dims is None else set(call.seq(x)) & dims
    if hit:
        return f"gathers along the sequence (dim {min(hit)} of {call.shape(x)})"
    return None


def _embedding(call: Call) -> str | None:
    if call.seq(call.args["weight"]):
        return "looks up rows of a tensor that carries the sequence"
    return None


def _contract(a_dims: Callable[[int], set[int]], b_dims: Callable[[int], set[int]], a: str, b: str):
    """Products: refused when a contracted dim (``a_dims`` of input ``a``, ``b_dims`` of ``b``) is a sequence dim."""

    def rule(call: Call) -> str | None:
        for arg, dims in ((a, a_dims), (b, b_dims)):
            x = call.args.get(arg)
            if isinstance(x, torch.fx.Node) and set(call.seq(x)) & dims(call.rank(x)):
                return f"contracts over the sequence (dims {sorted(dims(call.rank(x)))} of {call.shape(x)})"
        bias = [x for x in call.inputs if x is not call.args.get(a) and x is not call.args.get(b) and call.seq(x)]
        if bias:
            return _pointwise(call)
        return None

    return rule


def _linear(call: Call) -> str | None:
    x, w = call.args["input"], call.args["weight"]
    if call.seq(w) or (isinstance(call.args.get("bias"), torch.fx.Node) and call.seq(call.args["bias"])):
        return "multiplies by a weight that carries the sequence"
    if call.rank(x) - 1 in call.seq(x):
        return f"contracts over the sequence (the last dim of {call.shape(x)})"
    return None


def _einsum(call: Call) -> str | None:
    equation = str(call.args["equation"]).replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    operands = [x for x in call.args.get("tensors", []) if isinstance(x, torch.fx.Node)]
    if "..." in equation or not rhs:
        return "is an einsum with an implicit output or ellipsis, not read here"
    for letters, x in zip(lhs.split(","), operands):
        for d in call.seq(x):
            if letters[d] not in rhs:
                return f"contracts over the sequence (index {letters[d]} of {call.shape(x)})"
    return None


def _norm_last(call: Call) -> str | None:
    """layer_norm / rms_norm over the last len(normalized_shape) dims."""
    x = call.args["input"]
    k = len(call.args.get("normalized_shape") or [])
    if any(d >= call.rank(x) - k for d in call.seq(x)):
        return f"normalizes over the sequence ({call.shape(x)} over its last {k} dims)"
    weight = [call.args.get(n) for n in ("weight", "bias")]
    if any(isinstance(w, torch.fx.Node) and call.seq(w) for w in weight):
        return "normalizes with a weight that carries the sequence"
    return None


def _batch_only(what: str) -> Callable[[Call], str | None]:
    """Ops that treat dim 0 as a batch and mix every other dim (conv, pooling, group norm)."""

    def rule(call: Call) -> str | None:
        for x in call.inputs:
            if any(d != 0 for d in call.seq(x)):
                return f"{what} ({call.shape(x)})"
        return None

    return rule


def _no_sequence(what: str) -> Callable[[Call], str | None]:
    return lambda call: f"{what} ({call.shape(_first_input(call) or call.node)})"


def _arange(call: Call) -> str | None:
    size = tensors(call.node)[0].shape[0]
    tokens = call.local.sizes
    one_length = (isinstance(tokens, SymbolicSizes) and tokens.show(size) == "t") or (
        isinstance(tokens, StaticSizes) and size == tokens.n
    )
    if not one_length or call.args.get("step", 1) != 1:
        return (
            f"numbers {tokens.show(size)} elements with step {call.args.get('step', 1)}, which the runtime "
            f"does not shift to a rank's global positions (only step-1 aranges of the local length)"
        )
    return None


def _repeat(call: Call) -> str | None:
    x, repeats = call.args["self"], list(call.args.get("repeats") or [])
    shift = len(repeats) - call.rank(x)
    if any(int(repeats[d + shift]) != 1 for d in call.seq(x)):
        return f"repeats the sequence ({call.shape(x)} by {repeats})"
    return None


def _repeat_interleave(call: Call) -> str | None:
    x = call.args.get("self")
    dims = call.dims("dim", x)
    if dims is None or set(call.seq(x)) & dims:
        return f"repeats along the sequence ({call.shape(x)})"
    return None


def _pad(call: Call) -> str | None:
    x, pad = call.args["self"], list(call.args.get("pad") or [])
    n = call.rank(x)
    for d in call.seq(x):
        at = 2 * (n - 1 - d)
        if at < len(pad) and any(int(p) for p in pad[at : at + 2]):
            return f"pads the sequence ({call.shape(x)} by {pad})"
    return None


def _loss(call: Call) -> str | None:
    if int(call.args.get("reduction", 1)) != 0:
        return f"reduces a loss over the tokens ({call.shape(_first_input(call))}); a cp rank has only its own"
    x = _first_input(call)
    if 1 in call.seq(x) and call.rank(x) > 1:
        return f"takes the sequence for the classes ({call.shape(x)})"
    return None


def _attention(call: Call) -> str | None:
    """q, k, v with the sequence on dim 2 and nowhere else; the mask is the runtime's to refuse."""
    for arg in ("query", "key", "value"):
        x = call.args.get(arg)
        if call.seq(x) != (2,) or call.rank(x) != 4:
            return (
                f"attends with {arg} {call.shape(x)}: the ring splits q, k and v [batch, heads, t, head_dim] "
                f"along dim 2 only"
            )
    return None


POINTWISE = (
    "add sub rsub mul div true_divide floor_divide remainder fmod pow neg abs exp exp2 expm1 log log1p log2 "
    "log10 sqrt rsqrt reciprocal sign sgn sin cos tan tanh sinh cosh asin acos atan atan2 sigmoid logit relu "
    "relu6 leaky_relu gelu silu mish elu selu celu softplus softsign hardtanh hardswish hardsigmoid threshold "
    "erf erfc erfinv clamp clamp_min clamp_max clip minimum maximum fmin fmax where masked_fill lerp addcmul "
    "addcdiv eq ne lt le gt ge logical_and logical_or logical_not logical_xor bitwise_and bitwise_or "
    "bitwise_not bitwise_xor __and__ __or__ __xor__ __invert__ floor ceil round trunc frac isnan isinf "
    "isfinite nan_to_num square dropout native_dropout to _to_copy type_as clone contiguous detach alias "
    "lift_fresh_copy copy zeros_like ones_like full_like empty_like rand_like randn_like fill zero bernoulli "
    "polar"
).split()


LAYOUT = "transpose permute t movedim swapaxes swapdims unsqueeze squeeze".split()


VIEWS = "view _unsafe_view reshape flatten unflatten view_as".split()


CONSTANTS = (
    "full zeros ones empty empty_strided empty_permuted scalar_tensor rand randn randint new_zeros "
    "new_ones new_full new_empty"
).split()


_REDUCE = "reduces over the sequence"


_TAKE = "takes some of the tokens"


RULES: dict[str, Callable[[Call], str | None]] = {
    **{op: _pointwise for op in POINTWISE},
    **{op: _layout for op in LAYOUT},
    **{op: _view for op in VIEWS},
    **{op: _constant for op in CONSTANTS},
    "expand": _expand,
    "expand_as": _expand,
    "view_as_real": _leading,
    "view_as_complex": _leading,
    "stack": _stack,
    **{
        op: _along(_REDUCE)
        for op in (
            "sum nansum mean nanmean amax amin max min argmax argmin var std var_mean "
            "std_mean logsumexp prod norm linalg_vector_norm any all count_nonzero "
            "median nanmedian mode kthvalue"
        ).split()
    },
    **{
        op: _along("normalizes over the sequence", whole_if_none=False)
        for op in ("softmax _softmax log_softmax _log_softmax _safe_softmax").split()
    },
    **{
        op: _along("accumulates along the sequence", whole_if_none=False)
        for op in "cumsum cumprod cummax cummin logcumsumexp diff".split()
    },
    **{op: _along("orders along the sequence", whole_if_none=False) for op in "sort argsort topk".split()},
    **{
        op: _along(_TAKE, whole_if_none=False)
        for op in "select narrow index_select split split_with_sizes unsafe_split chunk unbind glu".split()
    },
    "flip": _along("reverses the sequence", name="dims"),
    "roll": _along("rolls the sequence", name="dims"),
    "unfold": _along("makes windows along the sequence", name="dimension"),
    "tril": _no_sequence("masks by position within the rank's tokens"),
    "triu": _no_sequence("masks by position within the rank's tokens"),
    "linspace": _no_sequence("spaces points over the local length"),
    "slice": _slice,
    "cat": _cat,
    "concat": _cat,
    "concatenate": _cat,
    "index": _index,
    "gather": _gather,
    "take_along_dim": _gather,
    "embedding": _embedding,
    "linear": _linear,
    "mm": _contract(lambda n: {1}, lambda n: {0}, "self", "mat2"),
    "addmm": _contract(lambda n: {1}, lambda n: {0}, "mat1", "mat2"),
    "bmm": _contract(lambda n: {2}, lambda n: {1}, "self", "mat2"),
    "baddbmm": _contract(lambda n: {2}, lambda n: {1}, "batch1", "batch2"),
    "matmul": _contract(lambda n: {n - 1}, lambda n: {max(n - 2, 0)}, "self", "other"),
    "mv": _contract(lambda n: {1}, lambda n: {0}, "self", "vec"),
    "dot": _contract(lambda n: {0}, lambda n: {0}, "self", "tensor"),
    "outer": _contract(lambda n: set(), lambda n: set(), "self", "vec2"),
    "einsum": _einsum,
    "layer_norm": _norm_last,
    "native_layer_norm": _norm_last,
    "rms_norm": _norm_last,
    "_fused_rms_norm": _norm_last,
    **{
        op: _batch_only("convolves or pools over the sequence")
        for op in (
            "convolution _convolution conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d "
            "max_pool1d max_pool2d max_pool3d max_pool2d_with_indices max_pool3d_with_indices avg_pool1d "
            "avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d "
            "adaptive_max_pool1d adaptive_max_pool2d _adaptive_avg_pool2d upsample_nearest1d "
            "upsample_linear1d upsample_nearest2d upsample_bilinear2d reflection_pad1d reflection_pad2d "
            "replication_pad1d replication_pad2d"
        ).split()
    },
    **{op: _batch_only("normalizes over the sequence") for op in "group_norm native_group_norm instance_norm".split()},
    **{
        op: _no_sequence("normalizes over the batch and the sequence")
        for op in (
            "batch_norm native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_no_training "
            "_native_batch_norm_legit_functional"
        ).split()
    },
    "arange": _arange,
    "repeat": _repeat,
    "repeat_interleave": _repeat_interleave,
    "constant_pad_nd": _pad,
    **{
        op: _loss
        for op in (
            "cross_entropy_loss nll_loss nll_loss_nd nll_loss2d mse_loss l1_loss smooth_l1_loss "
            "huber_loss binary_cross_entropy binary_cross_entropy_with_logits kl_div"
        ).split()
    },
}
