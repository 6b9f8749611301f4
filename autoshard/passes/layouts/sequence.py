"""Sequence parallelism (``sequence_parallel=True``; Megatron-LM's, Korthikanti et al. 2022): the TP model's layouts
over the tokens and the rules that make and take them.

A fourth layout Q: sharded over tp ranks along the sequence (token) dim q(v) of v. q(v) comes from
shape propagation (``seq_dims``) from the model inputs' token dim (the dim of size
``graph.tokens_per_sample``): an embedding keeps its ids' dims, a linear keeps every dim but the
last, views keep q where its size survives whole, transpose / unsqueeze / expand move it,
elementwise ops align from the right, sdpa keeps its query's, a batched matmul its first factor's rows
(the query's tokens), a reduction / norm / split over q ends it. Q is allowed on v only where q(v)
exists, size(v, q(v)) mod tp = 0 and q(v) < MAX_SEQ_DIM.
The rules it adds (``seq_rules``; layouts G and H only live inside a transformers Conv1D, whose
``addmm`` sits between two views that fold the tokens into one dim):

    per-token op (elementwise with every     seq Q (inputs broadcast over q: R) → Q
      input spanning q itself Q, views /
      pass-through / dropout keeping q,
      reductions, norms, softmax, splits
      over another dim)
    linear (nn.Linear)                        col-seq Q→S    all-gather in its input hook
                                                             (ColwiseParallel(input_layouts=Shard(q)))
                                              row-seq S→Q    reduce-scatter in its output hook
                                                             (RowwiseParallel(output_layouts=Shard(q)))
    linears reading one value u, all inside   col-module Q→S ``module_gathers``: M's input hook all-gathers u
      a module M (attention's q, k, v)                       once, a replicated DTensor (gather-seq-module-
                                                             input-dim{q} on M, the linears colwise; all or none)
    linear, replicated, called once           gather Q→R     PrepareModuleInput Shard(q) → Replicate()
                                              scatter R→Q    PrepareModuleOutput Replicate() → Shard(q), a slice
    first op of a module M, the only reader   gather Q→R     ``module_input_gathers``: PrepareModuleInput on M, M
      of M's one input (a norm)                              replicated (GPT-2's ln_f before a constant-length view)
    embedding                                 vocab-seq R→Q  RowwiseParallel(input_layouts=Replicate(),
                                                                             output_layouts=Shard(q))
    Conv1D: entry view / addmm / exit view    gath Q→G; col-seq G→S | gather G→R; row-seq S→H; scat H→Q; slice R→Q

Their prices are the segment model's (``passes.layouts.segment_model``). Attention code reads its input's
sequence length (``b, s, _ = x.shape``; HF's ``hidden_states.shape[:-1]``) and views the projections with it: a
per-linear gather leaves that size 1/tp of the projections' tokens, which the proof refuses; the
col-module gather is what runs there.
"""

from __future__ import annotations

from autoshard.ir.decisions import MAX_SEQ_DIM
from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.names import op_name
from autoshard.passes.layouts.rules import (
    BATCHED_MATMUL_OPS,
    DIM_OPS,
    ELEMENTWISE_OPS,
    EMBEDDING_OPS,
    LINEAR_OPS,
    LINEAR_TYPES,
    NORM_OPS,
    PASS_OPS,
    PER_TOKEN_OPS,
    REDUCE_OPS,
    SDPA_OPS,
    SINK_OPS,
    VIEW_OPS,
    G,
    H,
    Q,
    R,
    Rule,
    S,
    activation_inputs,
    consumer_map,
    dim_attr,
    embedding_can_split,
    is_conv1d,
    linear_refusal,
    module_inputs,
    row_can_split,
    transpose_dim,
    view_dim,
)


def seq_dims(graph: OpGraph) -> dict[str, int | None]:
    """q(v) for every model input and node of the graph: the dim holding its tokens, or None (module doc).
    Once per graph."""
    return graph.derived("tp_seq_dims", lambda: _seq_dims(graph))


def _seq_dims(graph: OpGraph) -> dict[str, int | None]:
    dims: dict[str, int | None] = {name: _input_seq_dim(graph, name) for name in graph.input_names}
    for node in graph.nodes:
        dims[node.name] = _seq_dim(graph, node, dims)
    return dims


def _input_seq_dim(graph: OpGraph, name: str) -> int | None:
    """The token dim of a model input: its first dim after the batch dim of size ``tokens_per_sample``."""
    shape, tokens = graph.placeholders[name][0], graph.tokens_per_sample
    return next((d for d in range(1, len(shape)) if shape[d] == tokens), None) if tokens > 1 else None


def _seq_dim(graph: OpGraph, node: OpNode, dims: dict) -> int | None:
    op, shape, ins = op_name(node.target), node.shape, activation_inputs(graph, node)
    if not shape or op in SINK_OPS or not ins:
        return None
    first = dims.get(ins[0])
    around = conv1d_views(graph).get(node.name)
    if around is not None and around[0] == "exit":  # a Conv1D's output: its input's tokens, new features
        x = activation_inputs(graph, graph.node(conv1d_views(graph)[around[1]][0]))[0]
        first, x_shape = dims.get(x), graph.value_meta(x)[0]
        out = first if first is not None and first < len(shape) - 1 and shape[first] == x_shape[first] else None
    elif op in ELEMENTWISE_OPS:
        out = _aligned_seq_dim(graph, node, dims)
    elif first is None:
        out = None
    elif op in EMBEDDING_OPS or op in PASS_OPS or op in SDPA_OPS:
        out = first  # ids' dims then the features; pass-through; the query's tokens
    elif op in LINEAR_OPS:
        out = first if first < len(shape) - 1 else None
    elif op in BATCHED_MATMUL_OPS:  # (…, n, k) @ (…, k, m): the rows are the first factor's (the query's tokens)
        in_rank = len(graph.value_meta(ins[0])[0])
        out = first + len(shape) - in_rank if first == in_rank - 2 else None
    else:
        out = _moved_seq_dim(graph, node, ins[0], first)
    return out if out is not None and out < len(shape) else None


def _moved_seq_dim(graph: OpGraph, node: OpNode, name: str, first: int) -> int | None:
    """q through an op that moves, keeps or ends dims (views, transpose, reductions, norms, splits)."""
    op, shape, in_shape = op_name(node.target), node.shape, graph.value_meta(name)[0]
    if op in VIEW_OPS:
        j = view_dim(in_shape, shape, first)
        return j if j is not None and shape[j] == in_shape[first] else None  # the tokens stay one whole dim
    if op == "transpose":
        return transpose_dim(node, len(shape), first)
    if op == "unsqueeze":
        return first + (node.attrs["dim"] % len(shape) <= first)
    if op == "expand":
        d = first + len(shape) - len(in_shape)
        return d if shape[d] == in_shape[first] else None
    if op in DIM_OPS:
        d = dim_attr(node, len(in_shape))
        return None if d == first else first - (op == "select" and d < first)
    if op in REDUCE_OPS:
        reduced = node.attrs.get("dim")
        reduced = [reduced] if isinstance(reduced, int) else (reduced or list(range(len(in_shape))))
        reduced = {d % len(in_shape) for d in reduced}
        keep = node.attrs.get("keepdim", True) or op not in {"mean", "sum", "amax", "amin"}
        return None if first in reduced else first - (0 if keep else sum(d < first for d in reduced))
    if op in NORM_OPS:
        normalized = len(node.attrs.get("normalized_shape") or ())
        return first if normalized and first < len(in_shape) - normalized else None
    return None


def _aligned_seq_dim(graph: OpGraph, node: OpNode, dims: dict) -> int | None:
    """The inputs' common q, aligned from the right (None when two inputs disagree)."""
    rank, found = len(node.shape), None
    for name in activation_inputs(graph, node):
        d = dims.get(name)
        if d is not None:
            aligned = d + rank - len(graph.value_meta(name)[0])
            if found is not None and aligned != found:
                return None
            found = aligned
    return found


def seq_ok(graph: OpGraph, name: str, qdims: dict, tp: int) -> bool:
    """Q is legal on ``name``: q exists, tp divides its size, and a sequence-parallel style names it."""
    q = qdims.get(name)
    if q is None or q >= MAX_SEQ_DIM:
        return False
    size = graph.value_meta(name)[0][q]
    return size > 1 and size % tp == 0


def spans_seq(graph: OpGraph, node: OpNode, name: str, q: int) -> bool:
    """Whether input ``name`` of ``node`` covers the output's tokens (not broadcast along q)."""
    shape, rank = graph.value_meta(name)[0], len(node.shape)
    at = q - (rank - len(shape))
    return at >= 0 and shape[at] == node.shape[q]


def per_token(graph: OpGraph, node: OpNode, qdims: dict, tp: int) -> bool:
    """``node`` computes each token from the same token of its inputs (module doc, "per-token op"), so it may
    run on a sequence shard: elementwise with every input spanning the tokens itself a sequence shard on the
    same dim (a parameter or a model input spanning them, e.g. a learned position table, is not), or a
    one-input op (cat: all inputs) through which q survives."""
    op, ins, q = op_name(node.target), activation_inputs(graph, node), qdims[node.name]
    if op in ELEMENTWISE_OPS:
        for name in node.inputs:
            if not spans_seq(graph, node, name, q):
                continue
            rank_gap = len(node.shape) - len(graph.value_meta(name)[0])
            aligned = None if qdims.get(name) is None else qdims[name] + rank_gap
            if name not in ins or not seq_ok(graph, name, qdims, tp) or aligned != q:
                return False
        return True
    if op not in PER_TOKEN_OPS or op in SDPA_OPS:
        return False
    spread = ins if op == "cat" else ins[:1]
    if op != "cat" and len(ins) > 1:
        return False
    return all(seq_ok(graph, x, qdims, tp) and qdims[x] == qdims[ins[0]] for x in spread)


def seq_rules(graph: OpGraph, node: OpNode, dims: dict, qdims: dict, tp: int) -> list[Rule]:
    """The sequence-parallel rules of ``node`` (module doc)."""
    op, ins = op_name(node.target), activation_inputs(graph, node)
    if op in SINK_OPS or not node.shape:
        return []
    if op in LINEAR_OPS:
        return linear_seq_rules(graph, node, dims, qdims, tp)
    if op in EMBEDDING_OPS:
        return (
            [Rule("vocabq", (R,) * len(ins), Q)]
            if embedding_can_split(graph, node, tp) and seq_ok(graph, node.name, qdims, tp)
            else []
        )
    around = conv1d_views(graph).get(node.name)
    if around is not None:
        return conv1d_view_rules(graph, node, around, dims, qdims, tp)
    rules = []
    if seq_ok(graph, node.name, qdims, tp) and per_token(graph, node, qdims, tp):
        rules.append(Rule("seq", seq_rule_inputs(graph, node, qdims), Q))
    gathered = module_input_gathers(graph).get(node.name)
    if gathered is not None and seq_ok(graph, gathered, qdims, tp):
        rules.append(Rule("repg", tuple(Q if x == gathered else R for x in ins), R))
    return rules


def module_input_gathers(graph: OpGraph) -> dict[str, str]:
    """Node -> the input its module may all-gather (``gather-seq-input-dim{q}``: PrepareModuleInput on the module,
    a local replicated tensor out): the node is the only reader of that input in its module, the module (not a
    block, not the root, not a linear or embedding: those have their own rules) reads no other activation
    from outside, and it is called once (its nodes read one outside input). A norm before code that needs
    whole tokens (GPT-2's final ``ln_f`` before a view with a constant length) runs replicated this way."""
    return graph.derived("tp_module_input_gathers", lambda: _module_input_gathers(graph))


def _module_input_gathers(graph: OpGraph) -> dict[str, str]:
    members: dict[str, list[OpNode]] = {}
    for n in graph.nodes:
        if n.module_path:
            members.setdefault(n.module_path, []).append(n)
    blocks, out = set(graph.block_paths), {}
    for module, nodes in members.items():
        if module in blocks or any(op_name(n.target) in LINEAR_OPS | EMBEDDING_OPS for n in nodes):
            continue
        outer = module_inputs(graph, nodes)
        readers = [
            n for n in nodes if outer and outer[0] in activation_inputs(graph, n) and op_name(n.target) not in SINK_OPS
        ]  # a shape assertion reads any layout
        if len(outer) == 1 and len(readers) == 1:
            out[readers[0].name] = outer[0]
    return out


def seq_rule_inputs(graph: OpGraph, node: OpNode, qdims: dict) -> tuple[str, ...]:
    """Input layouts of a per-token op on Q: inputs spanning the tokens Q, broadcast ones R; cat's all Q."""
    op, ins = op_name(node.target), activation_inputs(graph, node)
    if op in ELEMENTWISE_OPS:
        return tuple(Q if spans_seq(graph, node, x, qdims[node.name]) else R for x in ins)
    if op == "cat":
        return (Q,) * len(ins)
    return (Q,) + (R,) * (len(ins) - 1)


def linear_seq_rules(graph: OpGraph, node: OpNode, dims: dict, qdims: dict, tp: int) -> list[Rule]:
    """col-seq, row-seq (a TP split that gathers / reduce-scatters the tokens) and, on a replicated linear
    module called once, gather / scatter (its input or output hook changes the layout). A Conv1D's tokens
    are folded by its entry view, so its gather is the entry view's (G) and its reduce-scatter the exit
    view's (H)."""
    ins = activation_inputs(graph, node)
    if not ins:
        return []
    can = not linear_refusal(graph, node, tp)
    col, row, hook = (
        can and dims.get(node.name) is not None,
        can and row_can_split(graph, node, dims),
        hookable(graph, node),
    )
    if is_conv1d(node):
        entry, exit_ = conv1d_views(graph).get(node.name, (None, None))
        if entry is None or exit_ is None:
            return []
        gathers = hook and seq_ok(graph, activation_inputs(graph, graph.node(entry))[0], qdims, tp)
        return (
            ([Rule("colq", (G,), S)] if gathers and col else [])
            + ([Rule("repg", (G,), R)] if gathers else [])
            + ([Rule("rowq", (S,), H)] if hook and row and seq_ok(graph, exit_, qdims, tp) else [])
        )
    in_ok, out_ok = seq_ok(graph, ins[0], qdims, tp), seq_ok(graph, node.name, qdims, tp)
    grouped = node.name in module_gathers(graph)
    candidates = (
        (col and in_ok, Rule("colq", (Q,), S)),
        (col and in_ok and grouped, Rule("colm", (Q,), S)),
        (row and out_ok, Rule("rowq", (S,), Q)),
        (hook and in_ok, Rule("repg", (Q,), R)),
        (hook and out_ok, Rule("reps", (R,), Q)),
    )
    return [rule for ok, rule in candidates if ok]


def module_gathers(graph: OpGraph) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """col-module candidates: linear -> (module M, value u, the linears reading u). u is read only by nn.Linear
    modules called once, all inside M, the lowest module above them (not a block, not the root). M's input hook
    then all-gathers u once, as a replicated DTensor (``gather-seq-module-input-dim{q}``): the code of M reads
    its input's whole shape (attention's ``b, s, _ = x.shape``) and the linears, column-parallel, take the
    DTensor, so their input gradients are summed while partial and reduce-scattered once (torchtitan's
    PrepareModuleInput on attention)."""
    return graph.derived("tp_module_gathers", lambda: _module_gathers(graph))


def _module_gathers(graph: OpGraph) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    out: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    blocks = set(graph.block_paths)
    for value, readers in consumer_map(graph).items():
        nodes = [graph.node(r) for r in readers]
        if not nodes or any(
            op_name(n.target) != "linear"
            or not hookable(graph, n)
            or is_conv1d(n)
            or activation_inputs(graph, n)[:1] != [value]
            for n in nodes
        ):
            continue
        owner = _common_module([n.module_path.rpartition(".")[0] for n in nodes])
        if owner and owner not in blocks:
            out |= {n.name: (owner, value, tuple(readers)) for n in nodes}
    return out


def _common_module(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def hookable(graph: OpGraph, node: OpNode) -> bool:
    """A linear that is its own nn.Linear / Conv1D module's only call: a hook on that module's input or
    output sees exactly this op's input or output."""
    if not node.module_path or not (node.module_type in LINEAR_TYPES or is_conv1d(node)):
        return False
    return _linear_calls(graph).get(node.module_path, 0) == 1


def _linear_calls(graph: OpGraph) -> dict[str, int]:
    def compute():
        calls: dict[str, int] = {}
        for n in graph.nodes:
            if op_name(n.target) in LINEAR_OPS and n.module_path:
                calls[n.module_path] = calls.get(n.module_path, 0) + 1
        return calls

    return graph.derived("tp_linear_calls", compute)


def conv1d_views(graph: OpGraph) -> dict[str, tuple]:
    """For each transformers Conv1D ``addmm``: its entry view (folding the module's input to 2-d) and exit
    view (unfolding its output), both in the module: addmm -> (entry, exit), entry -> ("entry", addmm),
    exit -> ("exit", addmm). Once per graph."""
    return graph.derived("tp_conv1d_views", lambda: _conv1d_views(graph))


def _conv1d_views(graph: OpGraph) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    readers = consumer_map(graph)
    for node in graph.nodes:
        if op_name(node.target) not in LINEAR_OPS or not is_conv1d(node):
            continue
        ins = activation_inputs(graph, node)
        entry = graph._by_name().get(ins[0]) if ins else None
        after = readers.get(node.name, [])
        exit_ = graph.node(after[0]) if len(after) == 1 else None
        if not (_module_view(entry, node) and _module_view(exit_, node)):
            continue
        outer = activation_inputs(graph, entry)
        if (
            len(outer) != 1
            or graph._by_name().get(outer[0]) is not None
            and graph.node(outer[0]).module_path == node.module_path
        ):
            continue
        out[node.name] = (entry.name, exit_.name)
        out[entry.name], out[exit_.name] = ("entry", node.name), ("exit", node.name)
    return out


def _module_view(view: OpNode | None, linear: OpNode) -> bool:
    return view is not None and op_name(view.target) in VIEW_OPS and view.module_path == linear.module_path


def conv1d_view_rules(graph: OpGraph, node: OpNode, around: tuple, dims: dict, qdims: dict, tp: int) -> list[Rule]:
    """A Conv1D's entry view may gather its sequence-shard input (Q→G, the module's input hook); its exit view
    may reduce-scatter the row split's partial sums (H→Q) or slice a replicated output (R→Q)."""
    role, linear = around
    rules = linear_seq_rules(graph, graph.node(linear), dims, qdims, tp)
    if role == "entry":
        return [Rule("gath", (Q,), G)] if any(r.inputs == (G,) for r in rules) else []
    out = [Rule("scat", (H,), Q)] if any(r.output == H for r in rules) else []
    if hookable(graph, graph.node(linear)) and seq_ok(graph, node.name, qdims, tp):
        out.append(Rule("slice", (R,), Q))
    return out
