"""Tensor-parallel layouts and the rules of an op on them: the vocabulary of every layout model of ``passes.layouts``.

Nothing here matches module names. Every activation value v of a segment (``segments``: one representative
block per block ``signature``, plus the ops outside all blocks) gets a layout

    L(v) ∈ {R, S, P}     R replicated, S sharded over tp ranks on one dimension s(v)
                          (the feature / heads dimension), P partial sums (Σ over ranks = value)

(with sequence parallelism also Q, G and H: ``passes.layouts.sequence``).

The sharded dimension s(v) is fixed by shape propagation before the solve
(``shard_dims``): a linear shards its last dim; view/reshape map it through equal prefix
products (F = H·hd → H, needs H mod tp = 0); transpose / unsqueeze / expand move it; repeat_interleave
keeps it (``repeat_dim``); an elementwise op aligns broadcast dims from the right; a split / slice / cat / reduction / norm
over s(v) makes S illegal downstream. S is allowed on v only where s(v) exists and
size(v, s(v)) mod tp = 0.

Each op n picks one rule k from ``passes.layouts.allowed.op_rules(n)``: a tuple of required input layouts and an
output layout. Boolean x[n,k], Σ_k x[n,k] = 1 (``passes.layouts.segment_model.add_op_choice``):

    linear (nn.Linear, Conv1D addmm)   replicate R→R | col R→S | row S→P   (Conv1D: not when the
                                       output is split along its feature dim, i.e. fused q, k, v)
    embedding                          replicate R→R | vocab-parallel R→P
    sdpa                               (R,R,R,[R])→R | (S,S,S,[R])→S   (heads split; GQA: the
                                       KV heads too)
    matmul / bmm of two activations    (R,R)→R | (S,S)→S on a batch dim   (attention written out:
                                       q @ kᵀ and probs @ v per head; ``_batched_matmul_dim``)
    elementwise / views                all R → R    | S (with broadcast inputs R) → S
    repeat_interleave (integer k, a    R → R | S → S on the same dim (GQA's KV heads repeated in place:
    dim)                               ``repeat_dim``)
    norms, softmax / mean over s(v),   R → R only
    anything unknown
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.names import VIEW_OPS as ALIASING_OPS
from autoshard.ir.names import is_in_place, op_name

R, S, P = "R", "S", "P"
Q = "Q"  # sharded over the sequence (sequence parallelism)
G, H = "G", "H"  # inside a Conv1D: its input gathered at the module's input hook; its partial sums to reduce-scatter
LAYOUTS = (R, S, P)
SP_LAYOUTS = (R, S, P, Q, G, H)

LINEAR_OPS = {"linear", "addmm"}
EMBEDDING_OPS = {"embedding"}
SDPA_OPS = {"scaled_dot_product_attention"}
BATCHED_MATMUL_OPS = {"matmul", "bmm"}  # two activations multiplied: attention written out (q @ kᵀ, probs @ v)
VIEW_OPS = {"view", "reshape", "_unsafe_view"}
PASS_OPS = {
    "contiguous",
    "clone",
    "to",
    "dropout",
    "alias",
    "detach",
    "type_as",
    "operator.getitem",
    "lift_fresh",
    "lift_fresh_copy",
}
DTYPE_ONLY_OPS = {"type_as"}  # the second tensor gives only a dtype (``activation_inputs``)
ELEMENTWISE_OPS = {
    "add",
    "sub",
    "mul",
    "div",
    "gelu",
    "silu",
    "relu",
    "tanh",
    "neg",
    "pow",
    "rsqrt",
    "sigmoid",
    "exp",
    "sqrt",
    "where",
    "masked_fill",
    "erf",
    "square",
}
REDUCE_OPS = {"mean", "sum", "amax", "amin", "softmax", "_softmax", "log_softmax", "_log_softmax"}
DIM_OPS = {"split", "split_with_sizes", "slice", "cat", "chunk", "narrow", "select"}
SINK_OPS = {"_assert_tensor_metadata", "_assert_scalar", "_assert_async"}
NORM_OPS = {"layer_norm", "rms_norm", "native_layer_norm"}  # over the trailing normalized_shape dims
MOVE_OPS = {"transpose", "unsqueeze", "expand"}
REPEAT_OPS = {"repeat_interleave"}  # GQA's KV heads repeated in place: ``k.repeat_interleave(H // H_kv, dim=1)``
PER_TOKEN_OPS = PASS_OPS | VIEW_OPS | MOVE_OPS | REDUCE_OPS | NORM_OPS | DIM_OPS  # per token where q survives
SEQ_KINDS = frozenset({"seq", "colq", "colm", "rowq", "vocabq", "repg", "reps", "gath", "scat", "slice"})  # use Q/G/H
SEQ_SOURCE_KINDS = frozenset({"rowq", "vocabq", "reps", "scat", "slice"})  # make Q from values that are not Q
SEQ_GATHER_KINDS = frozenset({"colq", "colm", "repg", "gath"})  # make whole tokens from Q
CONV1D_TYPE = "transformers.pytorch_utils.Conv1D"
LINEAR_TYPES = frozenset({"torch.nn.modules.linear.Linear", "torch.nn.modules.linear.NonDynamicallyQuantizableLinear"})
EMBEDDING_TYPES = frozenset({"torch.nn.modules.sparse.Embedding"})

FUSED_REASON = (
    "fused q, k, v (its output is split along the sharded dim by {op}): a column shard would give each "
    "rank a contiguous block of the [q | k | v] columns, not its slice of q, k and v; replicated"
)


@dataclass(frozen=True)
class Rule:
    """One way to run an op: required layouts of its activation inputs, the output layout."""

    kind: str  # "rep", "col", "row", "vocab", "shard" (elementwise / sdpa on shards)
    inputs: tuple[str, ...]
    output: str


def uses_seq(rule: Rule) -> bool:
    """The rule reads or writes a sequence shard (Q, or a Conv1D's G / H)."""
    return rule.kind in SEQ_KINDS


def segments(graph: OpGraph) -> list[tuple[str, list[OpNode], int]]:
    """(representative path, its nodes, number of blocks with that signature), then the rest."""
    in_blocks = {name for b in graph.blocks for name in b.node_names}
    out = []
    for block in graph.blocks:
        if block.path == block.representative:
            repeats = sum(b.signature == block.signature for b in graph.blocks)
            out.append((block.path, [graph.node(n) for n in block.node_names], repeats))
    rest = [n for n in graph.nodes if n.name not in in_blocks]
    if rest:
        out.append(("", rest, 1))
    return out


def consumer_map(graph: OpGraph) -> dict[str, list[str]]:
    """Value name -> the nodes that read it (computed once per graph; callers must not change it)."""
    return graph.derived("consumers", lambda: _readers(graph))


def _readers(graph: OpGraph) -> dict[str, list[str]]:
    readers: dict[str, list[str]] = {}
    for node in graph.nodes:
        for name in node.inputs:
            readers.setdefault(name, []).append(node.name)
    return readers


def activation_inputs(graph: OpGraph, node: OpNode) -> list[str]:
    """The inputs that are activations (not parameters or buffers), in argument order; of ``x.type_as(y)``
    only x (y gives a dtype, the same on every rank whatever its layout: RMSNorms' ``output.type_as(x)``)."""
    names = [name for name in node.inputs if name not in graph.placeholder_params]
    return names[:1] if op_name(node.target) in DTYPE_ONLY_OPS else names


def shard_dims(graph: OpGraph, nodes: list[OpNode], tp: int) -> dict[str, int | None]:
    """s(v) for every node of the segment: the dim S would shard, or None where S is illegal."""
    dims: dict[str, int | None] = {}
    for node in nodes:
        dims[node.name] = _shard_dim(graph, node, dims, tp)
    return dims


def _shard_dim(graph: OpGraph, node: OpNode, dims: dict, tp: int) -> int | None:
    op, shape = op_name(node.target), node.shape
    ins = [dims.get(name) for name in activation_inputs(graph, node)]
    if not shape:
        return None
    if op in LINEAR_OPS:
        return len(shape) - 1 if linear_can_split(graph, node, shape[-1], tp) else None
    first = ins[0] if ins else None
    if first is None or op in SINK_OPS:
        return None if op not in ELEMENTWISE_OPS else _elementwise_dim(graph, node, dims, tp)
    in_shape = graph.value_meta(activation_inputs(graph, node)[0])[0]
    if op in VIEW_OPS:
        out = view_dim(in_shape, shape, first)
    elif op == "transpose":
        out = transpose_dim(node, len(shape), first)
    elif op == "unsqueeze":
        d = node.attrs["dim"] % len(shape)
        out = first + (d <= first)
    elif op == "expand":
        out = first if in_shape[first] == shape[first] else None
    elif op in REPEAT_OPS:
        out = repeat_dim(node, first)
    elif op in PASS_OPS:
        out = first
    elif op in SDPA_OPS:
        out = _sdpa_dim(graph, node, dims)
    elif op in BATCHED_MATMUL_OPS:
        out = _batched_matmul_dim(graph, node, dims)
    elif op in DIM_OPS:
        out = None if dim_attr(node, len(in_shape)) == first else first
    elif op in ELEMENTWISE_OPS:
        out = _elementwise_dim(graph, node, dims, tp)
    elif op in REDUCE_OPS:
        reduced = node.attrs.get("dim")
        reduced = [reduced] if isinstance(reduced, int) else (reduced or list(range(len(in_shape))))
        keep = node.attrs.get("keepdim", True) or op not in {"mean", "sum", "amax", "amin"}
        out = None if first in {d % len(in_shape) for d in reduced} or not keep else first
    else:
        out = None
    return out if out is not None and out < len(shape) and shape[out] % tp == 0 else None


def linear_can_split(graph: OpGraph, node: OpNode, out_features: int, tp: int) -> bool:
    return not linear_refusal(graph, node, tp) and out_features % tp == 0


def linear_refusal(graph: OpGraph, node: OpNode, tp: int) -> str:
    """Why a linear module can be neither col nor row parallel ("" when it can)."""
    tied = tied_reason(graph, node)
    if tied:
        return tied
    if is_conv1d(node):
        splitter = fused_split(graph, node)
        return FUSED_REASON.format(op=splitter) if splitter else ""
    if op_name(node.target) != "linear":
        return f"{op_name(node.target)} outside an nn.Linear: no ParallelStyle for it; replicated"
    return style_module_refusal(node, LINEAR_TYPES, "nn.Linear") or in_place_output_refusal(graph, node)


def in_place_output_refusal(graph: OpGraph, node: OpNode) -> str:
    """Why a module's DTensor style cannot hand its output to the model's code ("" when it can): the styles return
    the output's local tensor (``DTensor.to_local``), a view made inside an autograd Function, and autograd refuses
    an in-place op on such a view while it records gradients. A model that writes into the module's output, or into
    a view of it (Llama 4's MoE adds its routed experts into its shared expert's output: ``out.add_(...)``), would
    fail at its first training step; the module stays replicated."""
    readers, seen, values = consumer_map(graph), set(), [node.name]
    while values:
        value = values.pop()
        for name in readers.get(value, ()):
            reader = graph.node(name)
            if not reader.inputs or reader.inputs[0] != value or name in seen:
                continue
            seen.add(name)
            if is_in_place(reader.target):
                return (
                    f"the code calling it writes into its output in place ({reader.target}), which the local tensor "
                    f"a DTensor style hands back does not allow while gradients are recorded; replicated"
                )
            if op_name(reader.target) in ALIASING_OPS:
                values.append(name)
    return ""


def style_module_refusal(node: OpNode, types: frozenset[str], kind: str) -> str:
    """Why DTensor's Colwise / Rowwise styles cannot take the module that runs ``node`` ("" if they can):
    they install hooks on an ``nn.Linear`` / ``nn.Embedding`` and shard its own ``weight`` (and ``bias``),
    so the op must be that module's own forward on its own weight. Module types are exact names: a
    subclass may override ``forward`` (OPT's positional embedding adds an offset)."""
    if node.module_type not in types:
        short = node.module_type.rsplit(".", 1)[-1] or "the root module"
        return (
            f"the op runs in a {short}, not an {kind}: DTensor's parallel styles take only {kind} modules; replicated"
        )
    if f"{node.module_path}.weight" not in node.param_inputs:
        return f"the op does not use {node.module_path}.weight (its module calls it on another tensor); replicated"
    return ""


def tied_reason(graph: OpGraph, node: OpNode) -> str:
    """Why a module whose weight is tied to another (GPT-2's wte / lm_head) stays replicated ("" if untied)."""
    tied = [p for p in node.param_inputs if graph.param(p).tied_to]
    if not tied:
        return ""
    p = graph.param(tied[0])
    return (
        f"weight tied to {', '.join((p.name, *p.tied_to))}: one parameter, two uses (the embedding looks up "
        f"rows, the head multiplies by it), so a shard that suits one is the wrong one for the other; replicated"
    )


def is_conv1d(node: OpNode) -> bool:
    """transformers' Conv1D (GPT-2): an ``addmm`` on a (in, out) weight between two views."""
    return node.module_type == CONV1D_TYPE or node.module_type.endswith(".Conv1D")


def fused_split(graph: OpGraph, node: OpNode) -> str:
    """The op that splits ``node``'s output along its feature dim ("" if none): follow the readers
    through views and pass-through ops, mapping the last dim as ``view_dim`` does, to a split /
    slice / chunk on that dim (GPT-2's ``c_attn(x).split(n_embd, dim=2)`` into q, k, v)."""
    readers, frontier = consumer_map(graph), [(node.name, len(node.shape) - 1)]
    while frontier:
        name, dim = frontier.pop()
        in_shape = graph.value_meta(name)[0]
        for reader in (graph.node(r) for r in readers.get(name, [])):
            op = op_name(reader.target)
            if op in DIM_OPS and dim_attr(reader, len(in_shape)) == dim:
                return op
            if op in VIEW_OPS and (d := view_dim(in_shape, reader.shape, dim)) is not None:
                frontier.append((reader.name, d))
            elif op in PASS_OPS:
                frontier.append((reader.name, dim))
    return ""


def view_dim(in_shape: tuple, out_shape: tuple, d: int) -> int | None:
    """The output dim whose start lies where input dim d starts (equal prefix products)."""
    prefix = _prod(in_shape[:d])
    for j in range(len(out_shape)):
        if _prod(out_shape[:j]) == prefix and out_shape[j] > 1:
            return j
    return None


def transpose_dim(node: OpNode, rank: int, d: int) -> int:
    a, b = node.attrs["dim0"] % rank, node.attrs["dim1"] % rank
    return b if d == a else a if d == b else d


def repeat_dim(node: OpNode, d: int) -> int | None:
    """The shard dim after ``repeat_interleave(x, k, dim=r)`` of an input sharded on d: d itself, for an integer
    k and a given r. Along r = d rank i holds the rows [i·n/t, (i+1)·n/t) of the input, each repeated k times in
    place: exactly the rows [i·n·k/t, (i+1)·n·k/t) of the output, its own shard (GQA's KV head j becomes query
    heads j·k .. j·k + k − 1, the rows the query's head shard holds). Along r ≠ d each shard repeats its own
    slice. A tensor of repeats (a length per row) or no dim (the input flattened first) is not sharded."""
    repeats, dim = node.attrs.get("repeats"), node.attrs.get("dim")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1 or not isinstance(dim, int):
        return None
    return d


def dim_attr(node: OpNode, rank: int) -> int:
    return node.attrs.get("dim", 0) % rank


def _sdpa_dim(graph: OpGraph, node: OpNode, dims: dict) -> int | None:
    """Heads (dim 1) when q, k, v are all sharded on heads and the mask broadcasts over them."""
    q, k, v, *rest = activation_inputs(graph, node)
    if not all(dims.get(x) == 1 for x in (q, k, v)):
        return None
    if any(graph.value_meta(m)[0][1] != 1 for m in rest if len(graph.value_meta(m)[0]) == 4):
        return None
    return 1


def _batched_matmul_dim(graph: OpGraph, node: OpNode, dims: dict) -> int | None:
    """A batch dim (not one of the last two) on which both factors are sharded, aligned from the right:
    ``(…, n, k) @ (…, k, m)`` multiplies matrix by matrix independently along the batch dims, so each rank
    multiplies its own heads (attention written out: ``q @ kᵀ``, ``probs @ v``). A factor broadcast
    along that dim (size 1 there, or missing) would have to be whole on every rank: not sharded here."""
    ins, rank = activation_inputs(graph, node), len(node.shape)
    if len(ins) != 2 or rank < 3:
        return None
    aligned = set()
    for name in ins:
        d, shape = dims.get(name), graph.value_meta(name)[0]
        if d is None or len(shape) < 3 or d >= len(shape) - 2 or shape[d] != node.shape[d + rank - len(shape)]:
            return None
        aligned.add(d + rank - len(shape))
    return aligned.pop() if len(aligned) == 1 else None


def _elementwise_dim(graph: OpGraph, node: OpNode, dims: dict, tp: int) -> int | None:
    """The common S dim, aligned from the right; inputs broadcast along it must be size 1 there."""
    rank, found = len(node.shape), None
    for name in activation_inputs(graph, node):
        d, shape = dims.get(name), graph.value_meta(name)[0]
        if d is not None:
            aligned = d + rank - len(shape)
            if found is not None and aligned != found:
                return None
            found = aligned
    if found is None:
        return None
    for name in node.inputs:  # parameters and R inputs must broadcast along the sharded dim
        shape = graph.value_meta(name)[0]
        at = found - (rank - len(shape))
        if dims.get(name) is None and at >= 0 and shape[at] != 1:
            return None
    return found


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def row_can_split(graph: OpGraph, node: OpNode, dims: dict) -> bool:
    """A linear's input is sharded on its last dim: the row split's input."""
    ins = activation_inputs(graph, node)
    x_dim = dims.get(ins[0]) if ins else None
    return x_dim is not None and x_dim == len(graph.value_meta(ins[0])[0]) - 1


def embedding_can_split(graph: OpGraph, node: OpNode, tp: int) -> bool:
    """Vocab-parallel: tp divides the rows, the table is its own (untied), and an nn.Embedding looks it up."""
    table = graph.param(node.param_inputs[0])
    return (
        table.shape[0] % tp == 0
        and not table.tied_to
        and not style_module_refusal(node, EMBEDDING_TYPES, "nn.Embedding")
    )


def shard_rule_inputs(graph: OpGraph, node: OpNode, dims: dict) -> tuple[str, ...]:
    """Input layouts of an op computing on shards: elementwise inputs spanning the sharded dim are S
    (broadcast ones R); sdpa's q, k, v are S (its mask R); cat's all S; a view-like op's one input is S."""
    op, ins = op_name(node.target), activation_inputs(graph, node)
    if op in ELEMENTWISE_OPS:
        return tuple(S if dims.get(x) is not None and _full_at(graph, node, x, dims) else R for x in ins)
    if op in SDPA_OPS:
        return (S, S, S) + (R,) * (len(ins) - 3)
    if op == "cat" or op in BATCHED_MATMUL_OPS:
        return (S,) * len(ins)
    return (S,) + (R,) * (len(ins) - 1)


def _full_at(graph: OpGraph, node: OpNode, name: str, dims: dict) -> bool:
    """Whether input ``name`` spans the output's sharded dim (so it must be sharded too)."""
    shape, rank = graph.value_meta(name)[0], len(node.shape)
    at = dims[node.name] - (rank - len(shape))
    return at >= 0 and shape[at] == node.shape[dims[node.name]]


def module_inputs(graph: OpGraph, members: list[OpNode]) -> list[str]:
    """Activation values the module's ops read from outside it, in order."""
    names = {n.name for n in members}
    return list(dict.fromkeys(x for n in members for x in activation_inputs(graph, n) if x not in names))
