"""Tensor parallelism: choose a per-module TP style by optimising tensor layouts on the OpGraph.

Nothing here matches module names. Every activation value v of a segment (one representative
block per block ``signature``, plus the ops outside all blocks) gets a layout

    L(v) ∈ {R, S, P}     R replicated, S sharded over tp ranks on one dimension s(v)
                          (the feature / heads dimension), P partial sums (Σ over ranks = value)

The sharded dimension s(v) is fixed by shape propagation before the solve
(``shard_dims``): a linear shards its last dim; view/reshape map it through equal prefix
products (F = H·hd → H, needs H mod tp = 0); transpose / unsqueeze / expand move it; an
elementwise op aligns broadcast dims from the right; a split / slice / cat / reduction / norm
over s(v) makes S illegal downstream. S is allowed on v only where s(v) exists and
size(v, s(v)) mod tp = 0.

Each op n picks one rule k from ``op_rules(n)``: a tuple of required input layouts and an
output layout. Boolean x[n,k], Σ_k x[n,k] = 1 (``add_op_choice``):

    linear (nn.Linear, Conv1D addmm)   replicate R→R | col R→S | row S→P   (Conv1D: not when the
                                       output is split along its feature dim, i.e. fused q, k, v)
    embedding                          replicate R→R | vocab-parallel R→P
    sdpa                               (R,R,R,[R])→R | (S,S,S,[R])→S   (heads split; GQA: the
                                       KV heads too)
    elementwise / views                all R → R    | S (with broadcast inputs R) → S
    norms, softmax / mean over s(v),   R → R only
    anything unknown

A producer's layout meets each consumer's required layout on the edge e = (u → n) through
one transition t[e,a,b], Σ_b t[e,a,b] = L(u)=a, Σ_a t[e,a,b] = need(e)=b
(``add_edge_transitions``). Allowed transitions and their price, S the bytes of u:

    a = b            0
    P → R            AR(S, tp)      all-reduce (the row-parallel output)
    S → R            AG(S, tp)      all-gather, only right after a col nn.Linear (ColwiseParallel
                                    with output_layouts=Replicate()); a Conv1D has no gather style
    R → S, S → P, R → P, P → S      forbidden (the runtime has no place to slice or scale)

Values entering a segment, and values leaving it (read by another segment or returned by the
model), are R: the residual stream between blocks is replicated, as in Megatron-LM.

Objective (``add_objective``), minimised over x and t, in integer picoseconds:

    Σ_n Σ_k x[n,k] · (3 · T_c(flops(n)) / d(k)  +  c_bwd(k))   +   Σ_e Σ_{a,b} t[e,a,b] · c(a→b, bytes(u))

with T_c(f) = f / (peak_tflops · 10¹² · matmul_efficiency), 3 = forward + two backward matmuls,
d(k) = tp when k computes on shards (col, row, sharded elementwise / sdpa) and 1 otherwise,
and c_bwd(col) = AR(bytes of its input, tp): the backward all-reduce of the input gradient of a
column-parallel linear (Megatron's f operator). Collective costs come from
``autoshard.cost.comm`` on the TP link. The model is solved exactly with OR-Tools CP-SAT,
once per block signature, and the representative's styles are copied to its repeats.

Styles: a col / row nn.Linear is colwise (colwise-gather when its S output is read as R) /
rowwise; a col / row transformers Conv1D (weight (in, out), y = x·W + b, seen as its views around
an ``addmm``) is conv1d-colwise / conv1d-rowwise (``runtime.tensor_parallel``'s Conv1D styles).

Divisibility (``check_divisibility``) is checked before the solve: tp must divide the query
heads and the KV heads of every attention; a violation is refused with the numbers and the
degrees that would work.
"""

from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from autoshard.cost.comm import all_gather_s, allreduce_s
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import SegmentCost, TPChoice
from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.names import op_name
from autoshard.ir.topology import DeviceSpec, LinkSpec

R, S, P = "R", "S", "P"
LAYOUTS = (R, S, P)
PS_PER_S = 1e12  # CP-SAT needs integers: costs are in picoseconds
FWD_BWD_FACTOR = 3  # forward matmul + two backward matmuls (input and weight gradients)

LINEAR_OPS = {"linear", "addmm"}
EMBEDDING_OPS = {"embedding"}
SDPA_OPS = {"scaled_dot_product_attention"}
VIEW_OPS = {"view", "reshape", "_unsafe_view"}
PASS_OPS = {"contiguous", "clone", "to", "dropout", "alias", "detach", "type_as", "operator.getitem",
            "lift_fresh", "lift_fresh_copy"}
ELEMENTWISE_OPS = {"add", "sub", "mul", "div", "gelu", "silu", "relu", "tanh", "neg", "pow", "rsqrt", "sigmoid",
                   "exp", "sqrt", "where", "masked_fill", "erf", "square"}
REDUCE_OPS = {"mean", "sum", "amax", "amin", "softmax", "_softmax", "log_softmax", "_log_softmax"}
DIM_OPS = {"split", "split_with_sizes", "slice", "cat", "chunk", "narrow", "select"}
SINK_OPS = {"_assert_tensor_metadata", "_assert_scalar", "_assert_async"}
CONV1D_TYPE = "transformers.pytorch_utils.Conv1D"
LINEAR_TYPES = frozenset({"torch.nn.modules.linear.Linear", "torch.nn.modules.linear.NonDynamicallyQuantizableLinear"})
EMBEDDING_TYPES = frozenset({"torch.nn.modules.sparse.Embedding"})
FUSED_REASON = ("fused q, k, v (its output is split along the sharded dim by {op}): a column shard would give each "
                "rank a contiguous block of the [q | k | v] columns, not its slice of q, k and v; replicated")

STYLE_OF_RULE = {"col": "colwise", "row": "rowwise", "vocab": "vocab-parallel-embedding", "rep": "replicate"}
CONV1D_STYLE_OF_RULE = {"col": "conv1d-colwise", "row": "conv1d-rowwise", "rep": "replicate"}


@dataclass(frozen=True)
class Rule:
    """One way to run an op: required layouts of its activation inputs, the output layout."""

    kind: str  # "rep", "col", "row", "vocab", "shard" (elementwise / sdpa on shards)
    inputs: tuple[str, ...]
    output: str


# ---------------------------------------------------------------------------- entry point


def choose_tp_styles(graph: OpGraph, tp: int, link: LinkSpec, device: DeviceSpec) -> TPChoice:
    """Solve the layout model (module doc) per block signature and for the ops outside blocks."""
    if tp < 1:
        raise AutoshardError(f"tp={tp} must be a positive integer")
    violations = check_divisibility(graph, tp)
    if violations:
        raise AutoshardError(f"tp={tp} cannot split this model: {'; '.join(violations)}; "
                             f"fix: use tp in {valid_degrees(graph, up_to=max(tp, 8))}")
    styles, reasons = _default_styles(graph)
    choice = TPChoice(tp, styles, reasons)
    if tp == 1:
        return choice
    consumers = consumer_map(graph)
    for path, nodes, repeats in segments(graph):
        rules, cost = solve_segment(graph, nodes, consumers, tp, link, device)
        cost.path, cost.repeats = path, repeats
        choice.segments.append(cost)
        _record_styles(graph, choice, nodes, rules, path)
    return choice


def check_divisibility(graph: OpGraph, tp: int) -> list[str]:
    """One line per attention whose query or KV head count tp does not divide."""
    return list(graph.derived(("tp_divisibility", tp), lambda: tuple(_divisibility(graph, tp))))


def _divisibility(graph: OpGraph, tp: int) -> list[str]:
    found = []
    for node in graph.nodes:
        if op_name(node.target) not in SDPA_OPS:
            continue
        q_heads, kv_heads = (projected_heads(graph, name) for name in node.inputs[:2])
        for what, heads in (("query heads", q_heads), ("KV heads", kv_heads)):
            if heads % tp:
                found.append(f"{node.module_path or 'model'}: {heads} {what} are not divisible by tp={tp}")
    return list(dict.fromkeys(found))


def projected_heads(graph: OpGraph, name: str) -> int:
    """Heads of an sdpa input as its projection made them: walk back through views / rotary ops
    to the view just after the linear (so GQA's repeat_kv does not hide the KV head count)."""
    heads = graph.value_meta(name)[0][1]
    node = graph._by_name().get(name)
    while node is not None and op_name(node.target) not in LINEAR_OPS:
        ins = activation_inputs(graph, node)
        producer = graph._by_name().get(ins[0]) if ins else None
        if producer is not None and op_name(producer.target) in LINEAR_OPS and len(node.shape) == 4:
            return node.shape[2]
        node = producer
    return heads


def valid_degrees(graph: OpGraph, up_to: int) -> list[int]:
    return [d for d in range(1, up_to + 1) if not check_divisibility(graph, d)]


# ---------------------------------------------------------------------------- segments


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
    """The inputs that are activations (not parameters or buffers), in argument order."""
    return [name for name in node.inputs if name not in graph.placeholder_params]


# ---------------------------------------------------------------------------- shard dims


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
        out = _view_dim(in_shape, shape, first)
    elif op == "transpose":
        out = _transpose_dim(node, len(shape), first)
    elif op == "unsqueeze":
        d = node.attrs["dim"] % len(shape)
        out = first + (d <= first)
    elif op == "expand":
        out = first if in_shape[first] == shape[first] else None
    elif op in PASS_OPS:
        out = first
    elif op in SDPA_OPS:
        out = _sdpa_dim(graph, node, dims)
    elif op in DIM_OPS:
        out = None if _dim_attr(node, len(in_shape)) == first else first
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
    return style_module_refusal(node, LINEAR_TYPES, "nn.Linear")


def style_module_refusal(node: OpNode, types: frozenset[str], kind: str) -> str:
    """Why DTensor's Colwise / Rowwise styles cannot take the module that runs ``node`` ("" if they can):
    they install hooks on an ``nn.Linear`` / ``nn.Embedding`` and shard its own ``weight`` (and ``bias``),
    so the op must be that module's own forward on its own weight. Module types are exact names: a
    subclass may override ``forward`` (OPT's positional embedding adds an offset)."""
    if node.module_type not in types:
        short = node.module_type.rsplit(".", 1)[-1] or "the root module"
        return (f"the op runs in a {short}, not an {kind}: DTensor's parallel styles take only {kind} modules; "
                f"replicated")
    if f"{node.module_path}.weight" not in node.param_inputs:
        return f"the op does not use {node.module_path}.weight (its module calls it on another tensor); replicated"
    return ""


def tied_reason(graph: OpGraph, node: OpNode) -> str:
    """Why a module whose weight is tied to another (GPT-2's wte / lm_head) stays replicated ("" if untied)."""
    tied = [p for p in node.param_inputs if graph.param(p).tied_to]
    if not tied:
        return ""
    p = graph.param(tied[0])
    return (f"weight tied to {', '.join((p.name, *p.tied_to))}: one parameter, two uses (the embedding looks up "
            f"rows, the head multiplies by it), so a shard that suits one is the wrong one for the other; replicated")


def is_conv1d(node: OpNode) -> bool:
    """transformers' Conv1D (GPT-2): an ``addmm`` on a (in, out) weight between two views."""
    return node.module_type == CONV1D_TYPE or node.module_type.endswith(".Conv1D")


def fused_split(graph: OpGraph, node: OpNode) -> str:
    """The op that splits ``node``'s output along its feature dim ("" if none): follow the readers
    through views and pass-through ops, mapping the last dim as ``_view_dim`` does, to a split /
    slice / chunk on that dim (GPT-2's ``c_attn(x).split(n_embd, dim=2)`` into q, k, v)."""
    readers, frontier = consumer_map(graph), [(node.name, len(node.shape) - 1)]
    while frontier:
        name, dim = frontier.pop()
        in_shape = graph.value_meta(name)[0]
        for reader in (graph.node(r) for r in readers.get(name, [])):
            op = op_name(reader.target)
            if op in DIM_OPS and _dim_attr(reader, len(in_shape)) == dim:
                return op
            if op in VIEW_OPS and (d := _view_dim(in_shape, reader.shape, dim)) is not None:
                frontier.append((reader.name, d))
            elif op in PASS_OPS:
                frontier.append((reader.name, dim))
    return ""


def _view_dim(in_shape: tuple, out_shape: tuple, d: int) -> int | None:
    """The output dim whose start lies where input dim d starts (equal prefix products)."""
    prefix = _prod(in_shape[:d])
    for j in range(len(out_shape)):
        if _prod(out_shape[:j]) == prefix and out_shape[j] > 1:
            return j
    return None


def _transpose_dim(node: OpNode, rank: int, d: int) -> int:
    a, b = node.attrs["dim0"] % rank, node.attrs["dim1"] % rank
    return b if d == a else a if d == b else d


def _dim_attr(node: OpNode, rank: int) -> int:
    return node.attrs.get("dim", 0) % rank


def _sdpa_dim(graph: OpGraph, node: OpNode, dims: dict) -> int | None:
    """Heads (dim 1) when q, k, v are all sharded on heads and the mask broadcasts over them."""
    q, k, v, *rest = activation_inputs(graph, node)
    if not all(dims.get(x) == 1 for x in (q, k, v)):
        return None
    if any(graph.value_meta(m)[0][1] != 1 for m in rest if len(graph.value_meta(m)[0]) == 4):
        return None
    return 1


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


# ---------------------------------------------------------------------------- rules per op


def op_rules(graph: OpGraph, node: OpNode, dims: dict, tp: int) -> list[Rule]:
    """The legal ways to run ``node`` (module doc table)."""
    op, ins = op_name(node.target), activation_inputs(graph, node)
    n_in = len(ins)
    rules = [Rule("rep", (R,) * n_in, R)]
    if op in SINK_OPS:
        return [Rule("rep", (layout,) * n_in, R) for layout in LAYOUTS][: 1 if not n_in else 3]
    if op in LINEAR_OPS and not linear_refusal(graph, node, tp):
        x_dim = dims.get(ins[0]) if ins else None
        if dims.get(node.name) is not None:
            rules.append(Rule("col", (R,), S))
        if x_dim is not None and x_dim == len(graph.value_meta(ins[0])[0]) - 1:
            rules.append(Rule("row", (S,), P))
    elif op in EMBEDDING_OPS and graph.param(node.param_inputs[0]).shape[0] % tp == 0 \
            and not graph.param(node.param_inputs[0]).tied_to \
            and not style_module_refusal(node, EMBEDDING_TYPES, "nn.Embedding"):
        rules.append(Rule("vocab", (R,) * n_in, P))
    elif dims.get(node.name) is not None and op not in LINEAR_OPS | EMBEDDING_OPS:
        rules.append(Rule("shard", shard_rule_inputs(graph, node, dims), S))
    return rules


def shard_rule_inputs(graph: OpGraph, node: OpNode, dims: dict) -> tuple[str, ...]:
    """Input layouts of an op computing on shards: elementwise inputs spanning the sharded dim are S
    (broadcast ones R); sdpa's q, k, v are S (its mask R); cat's all S; a view-like op's one input is S."""
    op, ins = op_name(node.target), activation_inputs(graph, node)
    if op in ELEMENTWISE_OPS:
        return tuple(S if dims.get(x) is not None and _full_at(graph, node, x, dims) else R for x in ins)
    if op in SDPA_OPS:
        return (S, S, S) + (R,) * (len(ins) - 3)
    if op == "cat":
        return (S,) * len(ins)
    return (S,) + (R,) * (len(ins) - 1)


def _full_at(graph: OpGraph, node: OpNode, name: str, dims: dict) -> bool:
    """Whether input ``name`` spans the output's sharded dim (so it must be sharded too)."""
    shape, rank = graph.value_meta(name)[0], len(node.shape)
    at = dims[node.name] - (rank - len(shape))
    return at >= 0 and shape[at] == node.shape[dims[node.name]]


def segment_rules(graph: OpGraph, nodes: list[OpNode], tp: int) -> tuple[dict, dict[str, list[Rule]]]:
    """(s(v) per node, ``allowed_rules``) of a segment, once per graph, tp and proof: the search prices many
    micro-batch sizes, and each solve's styles read them again."""
    refused = proof_refusals(graph, tp)
    key = ("tp_rules", tp, tuple(n.name for n in nodes), None if refused is None else tuple(sorted(refused)))

    def compute():
        dims = shard_dims(graph, nodes, tp)
        return dims, allowed_rules(graph, nodes, dims, tp)
    return graph.derived(key, compute)


def param_readers(graph: OpGraph) -> dict[str, tuple[str, ...]]:
    """Module path -> the nodes that read one of its parameters (not buffers), once per graph."""
    def compute():
        out: dict[str, list[str]] = {}
        for n in graph.nodes:
            for module in dict.fromkeys(graph.param(p).module_path for p in n.param_inputs
                                        if not graph.param(p).is_buffer):
                out.setdefault(module, []).append(n.name)
        return {m: tuple(names) for m, names in out.items()}
    return graph.derived("tp_param_readers", compute)


def allowed_rules(graph: OpGraph, nodes: list[OpNode], dims: dict, tp: int) -> dict[str, list[Rule]]:
    """``op_rules`` less what the model's code was not proven to compute on shards (``proof_refusals``)
    and less shard rules on replicated parameters that cannot be made DTensors (``param_module``)."""
    refused = proof_refusals(graph, tp)
    rules = {}
    for n in nodes:
        rs = op_rules(graph, n, dims, tp)
        rules[n.name] = rs[:1] if refused is None or n.name in refused else rs
    for module, members in param_modules(graph, nodes).items():
        if not param_module_fits(graph, module, members, rules, dims):
            for n in members:
                if _reads_own_params(graph, n, module):
                    rules[n.name] = rules[n.name][:1]
    return rules


def proof_refusals(graph: OpGraph, tp: int) -> dict[str, str] | None:
    """Nodes whose computation on a tp shard the model's code was not shown to give (passes/tp_proof); {} for
    a graph never checked (hand-built); None when tp was not among the degrees checked: nothing shards."""
    if graph.tp_proofs is None:
        return {}
    return graph.tp_proofs.get(str(tp))


def proof_reason(graph: OpGraph, node: OpNode, tp: int) -> str:
    """Why the shards a module's output would reach were refused by the proof, nearest module first."""
    refused = proof_refusals(graph, tp)
    if refused is None:
        return f"tp={tp} was not checked against the model's code when it was captured; replicated"
    if not refused or node.module_path not in _col_paths(graph):
        return ""
    parent = node.module_path.rpartition(".")[0]
    near = [r for name, r in refused.items() if graph.node(name).module_path.startswith(parent)
            and not r.startswith("not run on a shard")]
    return near[0] if near else ""


def _col_paths(graph: OpGraph) -> set[str]:
    return graph.derived("tp_linear_paths", lambda: {n.module_path for n in graph.nodes
                                                    if op_name(n.target) in LINEAR_OPS})


def param_modules(graph: OpGraph, nodes: list[OpNode]) -> dict[str, list[OpNode]]:
    """Modules other than linears and embeddings whose parameters (not buffers) the segment's ops read:
    module path -> the segment's nodes inside it (its subtree), in graph order."""
    owners = {}
    for n in nodes:
        if op_name(n.target) in LINEAR_OPS | EMBEDDING_OPS:
            continue
        for p in n.param_inputs:
            info = graph.param(p)
            if not info.is_buffer:
                owners[info.module_path] = None
    return {m: [n for n in nodes if n.module_path == m or n.module_path.startswith(m + ".")] for m in owners}


def _reads_own_params(graph: OpGraph, node: OpNode, module: str) -> bool:
    return any(not graph.param(p).is_buffer and graph.param(p).module_path == module for p in node.param_inputs)


def param_module_fits(graph: OpGraph, module: str, members: list[OpNode], rules: dict, dims: dict) -> bool:
    """Whether ``module`` can run on shards with its parameters replicated DTensors (torch's
    SequenceParallel on the sharded dim: the parameters' gradients, partial on each rank, are summed
    over tp by DTensor): no linear or embedding inside it, every op of it in this segment with a shard
    rule, its parameters read nowhere else, one activation input from outside it."""
    if not module or any(op_name(n.target) in LINEAR_OPS | EMBEDDING_OPS for n in members):
        return False
    if any(n.shape and not any(r.kind == "shard" for r in rules[n.name]) for n in members):
        return False
    names = {n.name for n in members}
    if any(n not in names for n in param_readers(graph).get(module, ())):
        return False
    return len(module_inputs(graph, members)) == 1


def module_inputs(graph: OpGraph, members: list[OpNode]) -> list[str]:
    """Activation values the module's ops read from outside it, in order."""
    names = {n.name for n in members}
    return list(dict.fromkeys(x for n in members for x in activation_inputs(graph, n) if x not in names))


def add_same_module_rules(model, graph: OpGraph, nodes: list[OpNode], rules: dict, pick: dict) -> None:
    """A module called more than once gets one style: its linear / embedding nodes pick the same kind
    of rule (Σ_{k: kind(k)=c} x[n,k] equal across the module's nodes, for every kind c)."""
    by_module: dict[str, list[OpNode]] = {}
    for n in nodes:
        if op_name(n.target) in LINEAR_OPS | EMBEDDING_OPS and n.module_path:
            by_module.setdefault(n.module_path, []).append(n)
    for group in by_module.values():
        _same_kind(model, group, rules, pick)


def add_replicated_param_modules(model, graph: OpGraph, nodes: list[OpNode], rules: dict, pick: dict,
                                 dims: dict) -> None:
    """A module with replicated parameters runs wholly on shards (its SequenceParallel style) or wholly
    replicated: every op inside it picks the same kind."""
    for module, members in param_modules(graph, nodes).items():
        if param_module_fits(graph, module, members, rules, dims):
            _same_kind(model, [n for n in members if n.shape], rules, pick)


def _same_kind(model, group: list[OpNode], rules: dict, pick: dict) -> None:
    kinds = sorted({r.kind for n in group for r in rules[n.name]})
    for kind in kinds:
        sums = [sum((x for x, r in zip(pick[n.name], rules[n.name]) if r.kind == kind), 0) for n in group]
        for other in sums[1:]:
            if not (isinstance(sums[0], int) and isinstance(other, int)):
                model.Add(sums[0] == other)


# ---------------------------------------------------------------------------- CP-SAT model


def solve_segment(graph: OpGraph, nodes: list[OpNode], consumers: dict, tp: int, link: LinkSpec,
                  device: DeviceSpec) -> tuple[dict[str, Rule], SegmentCost]:
    """Solve the CP-SAT model of one segment on ``link``; the chosen rule per node and its cost. The
    variables and constraints depend on the graph, the segment and tp only: they are built once
    (``segment_model``; a search solves each for several micro-batch sizes, i.e. scaled links) and
    solved again with each link's prices as the objective."""
    refused = proof_refusals(graph, tp)
    key = ("tp_segment_model", tp, tuple(n.name for n in nodes), None if refused is None else tuple(sorted(refused)))
    model, rules, pick, terms = graph.derived(key, lambda: segment_model(graph, nodes, consumers, tp))
    costs = priced(terms, tp, link, device)
    add_objective(model, costs)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    status = solver.Solve(model)
    assert status == cp_model.OPTIMAL, f"TP layout model: {solver.StatusName(status)}"
    chosen = {name: rs[k] for name, rs in rules.items() for k in range(len(rs)) if solver.Value(pick[name][k])}
    return chosen, _segment_cost(solver, costs)


def segment_model(graph: OpGraph, nodes: list[OpNode], consumers: dict, tp: int) -> tuple:
    """(model, rules per node, x per node, cost terms (var, flops, collective, bytes)) of one segment."""
    dims, rules = segment_rules(graph, nodes, tp)
    model = cp_model.CpModel()
    pick = add_op_choice(model, rules)
    layout = add_layouts(model, nodes, rules, pick)
    terms = add_edge_transitions(model, graph, nodes, rules, pick, layout, consumers)
    add_same_module_rules(model, graph, nodes, rules, pick)
    add_replicated_param_modules(model, graph, nodes, rules, pick, dims)
    return model, rules, pick, terms + op_terms(graph, nodes, rules, pick, tp)


def priced(terms: list[tuple], tp: int, link: LinkSpec, device: DeviceSpec) -> list[tuple]:
    """(var, compute_s, comm_s, comm_bytes) of every term: 3·T_c(flops) on the device, the collective on the link."""
    flops_per_s = device.peak_tflops * 1e12 * device.matmul_efficiency
    comm = {None: lambda size: 0.0, "all_reduce": lambda size: allreduce_s(size, tp, link),
            "all_gather": lambda size: all_gather_s(size, tp, link)}
    return [(var, FWD_BWD_FACTOR * flops / flops_per_s, comm[kind](size), size) for var, flops, kind, size in terms]


def add_op_choice(model: cp_model.CpModel, rules: dict[str, list[Rule]]) -> dict[str, list]:
    """x[n,k] booleans, Σ_k x[n,k] = 1."""
    pick = {name: [model.NewBoolVar(f"x[{name},{k}]") for k in range(len(rs))] for name, rs in rules.items()}
    for xs in pick.values():
        model.AddExactlyOne(xs)
    return pick


def add_layouts(model, nodes: list[OpNode], rules: dict, pick: dict) -> dict[str, dict[str, object]]:
    """L(v)=a as a linear expression of the x of v's producer: Σ_{k: out(k)=a} x[v,k]."""
    return {n.name: {a: sum(x for x, r in zip(pick[n.name], rules[n.name]) if r.output == a) for a in LAYOUTS}
            for n in nodes}


TRANSITIONS = {(R, R), (S, S), (P, P), (P, R), (S, R)}


def add_edge_transitions(model, graph: OpGraph, nodes: list[OpNode], rules: dict, pick: dict, layout: dict,
                         consumers: dict) -> list[tuple]:
    """t[e,a,b] per edge into the segment's nodes and per value leaving it; returns cost terms.
    A col linear's output is gathered for every reader or for none (``add_gather_all_or_none``)."""
    inside = {n.name for n in nodes}
    terms, edges_of = [], {}
    for node in nodes:
        for i, name in enumerate(activation_inputs(graph, node)):
            need = {b: sum(x for x, r in zip(pick[node.name], rules[node.name]) if r.inputs[i] == b) for b in LAYOUTS}
            have = layout[name] if name in inside else {R: 1, S: 0, P: 0}
            edge_terms, t = _link_edge(model, graph, f"{name}->{node.name}", name, have, need)
            terms += edge_terms
            edges_of.setdefault(name, []).append(t)
    for node in nodes:  # values read outside the segment, or returned by the model, must be R
        outside = [c for c in consumers.get(node.name, []) if c not in inside]
        if node.shape and (outside or not consumers.get(node.name)):
            edge_terms, t = _link_edge(model, graph, f"{node.name}->out", node.name, layout[node.name],
                                       {R: 1, S: 0, P: 0})
            terms += edge_terms
            edges_of.setdefault(node.name, []).append(t)
    add_gather_all_or_none(model, edges_of)
    return terms


def add_gather_all_or_none(model, edges_of: dict[str, list[dict]]) -> None:
    """ColwiseParallel(output_layouts=Replicate()) hands every reader the gathered tensor, so no reader of
    a value may keep its shard (S→S) while another gathers it (S→R): t[e,S,S] + t[e',S,R] ≤ 1."""
    for edges in edges_of.values():
        kept = [t[S, S] for t in edges if (S, S) in t]
        gathered = [t[S, R] for t in edges if (S, R) in t]
        for a in kept:
            for b in gathered:
                model.Add(a + b <= 1)


def _link_edge(model, graph: OpGraph, key: str, producer: str, have: dict, need: dict) -> tuple[list[tuple], dict]:
    size = graph.value_bytes(producer)
    node = graph._by_name().get(producer)
    after_linear = node is not None and op_name(node.target) in LINEAR_OPS and not is_conv1d(node)
    allowed = [(a, b) for a, b in TRANSITIONS if (a, b) != (S, R) or after_linear]
    t = {(a, b): model.NewBoolVar(f"t[{key},{a}{b}]") for a, b in allowed}
    for a in LAYOUTS:
        model.Add(sum(v for (x, _), v in t.items() if x == a) == have[a])
    for b in LAYOUTS:
        model.Add(sum(v for (_, y), v in t.items() if y == b) == need[b])
    collective = {(P, R): "all_reduce", (S, R): "all_gather"}
    return [(var, 0.0, collective[a, b], size) for (a, b), var in t.items() if (a, b) in collective], t


def op_terms(graph: OpGraph, nodes: list[OpNode], rules: dict, pick: dict, tp: int) -> list[tuple]:
    """(x, flops, collective, comm_bytes) per op rule: T_c(flops/d(k)) and c_bwd(k) once priced."""
    terms = []
    for node in nodes:
        for x, rule in zip(pick[node.name], rules[node.name]):
            split = tp if rule.kind in ("col", "row", "shard") else 1
            kind, size = None, 0
            if rule.kind == "col":
                kind, size = "all_reduce", graph.value_bytes(activation_inputs(graph, node)[0])
            terms.append((x, node.flops / split, kind, size))
    return terms


def add_objective(model, terms: list[tuple]) -> None:
    model.Minimize(sum(var * round((compute + comm) * PS_PER_S) for var, compute, comm, _ in terms))


def _segment_cost(solver, terms: list[tuple]) -> SegmentCost:
    on = [(c, m, b) for var, c, m, b in terms if solver.Value(var)]
    return SegmentCost("", 1, sum(c for c, _, _ in on), sum(m for _, m, _ in on), sum(b for _, _, b in on))


# ---------------------------------------------------------------------------- styles


def _default_styles(graph: OpGraph) -> tuple[dict[str, str], dict[str, str]]:
    """Every module that owns parameters starts replicated."""
    styles = {p.module_path: "replicate" for p in graph.params if not p.is_buffer}
    return styles, {}


def _record_styles(graph: OpGraph, choice: TPChoice, nodes: list[OpNode], rules: dict[str, Rule], path: str) -> None:
    """Write the representative's styles (and reasons) for it and every block sharing its signature."""
    local: dict[str, tuple[str, str]] = {}
    gathered = _gathered_outputs(graph, nodes, rules)
    for node in nodes:
        op, rule = op_name(node.target), rules[node.name]
        if op not in LINEAR_OPS | EMBEDDING_OPS or not node.module_path:
            continue
        style = STYLE_OF_RULE.get(rule.kind, "replicate")
        if style == "colwise" and node.name in gathered:
            style = "colwise-gather"
        if is_conv1d(node):
            assert node.name not in gathered, f"{node.module_path}: a Conv1D has no gather style"
            style = CONV1D_STYLE_OF_RULE[rule.kind]
        local[node.module_path] = (style, "" if style != "replicate" else _replicate_reason(graph, node, choice.tp))
    local |= _param_module_styles(graph, nodes, rules, choice.tp)
    for target in _repeats(graph, path):
        for module, (style, reason) in local.items():
            name = target + module[len(path):] if path else module
            choice.styles[name] = style
            if reason:
                choice.reasons[name] = reason


def _param_module_styles(graph: OpGraph, nodes: list[OpNode], rules: dict[str, Rule], tp: int) -> dict:
    """Style and reason of each module with replicated parameters (norms, per-head norms, scales):
    ``sharded-input-dim{d}`` when its ops run on shards (d: the dim its input is sharded on)."""
    dims, allowed = segment_rules(graph, nodes, tp)
    out = {}
    for module, members in param_modules(graph, nodes).items():
        if any(rules[n.name].kind == "shard" for n in members):
            out[module] = (f"sharded-input-dim{dims[module_inputs(graph, members)[0]]}", "")
        elif not param_module_fits(graph, module, members, allowed, dims):
            out[module] = ("replicate", REPLICATED_PARAMS_REASON)
        else:
            out[module] = ("replicate", "its input is replicated in the cheapest layout assignment")
    return out


REPLICATED_PARAMS_REASON = ("its computation needs whole tensors where its input would be sharded (a norm, softmax or "
                            "reduction over that dim, or an op with no sharding rule); replicated")


def _gathered_outputs(graph: OpGraph, nodes: list[OpNode], rules: dict[str, Rule]) -> set[str]:
    """Col linears whose S output some consumer reads as R (so the runtime gathers it)."""
    out = set()
    inside = {n.name for n in nodes}
    for node in nodes:
        for i, name in enumerate(activation_inputs(graph, node)):
            if name in inside and rules[name].output == S and rules[node.name].inputs[i] == R:
                out.add(name)
    return out | {n.name for n in nodes if rules[n.name].kind == "col" and _leaves(graph, n, inside)}


def _leaves(graph: OpGraph, node: OpNode, inside: set[str]) -> bool:
    readers = consumer_map(graph).get(node.name, [])
    return not readers or any(r not in inside for r in readers)


def _replicate_reason(graph: OpGraph, node: OpNode, tp: int) -> str:
    op = op_name(node.target)
    refusal = (linear_refusal(graph, node, tp) if op in LINEAR_OPS
               else tied_reason(graph, node) or style_module_refusal(node, EMBEDDING_TYPES, "nn.Embedding")
               if op in EMBEDDING_OPS else "")
    refusal = refusal or proof_reason(graph, node, tp)
    return refusal or ("the cheapest layout assignment keeps it replicated: sharding saves less compute than the "
                       "resharding communication it adds")


def _repeats(graph: OpGraph, path: str) -> list[str]:
    if not path:
        return [""]
    signature = next(b.signature for b in graph.blocks if b.path == path)
    return [b.path for b in graph.blocks if b.signature == signature]
