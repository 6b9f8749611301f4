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
    matmul / bmm of two activations    (R,R)→R | (S,S)→S on a batch dim   (attention written out:
                                       q @ kᵀ and probs @ v per head; ``_batched_matmul_dim``)
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

Sequence parallelism (``sequence_parallel=True``; Megatron-LM's, Korthikanti et al. 2022)
-----------------------------------------------------------------------------------------
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

Transitions add Q → Q (and G → G, H → H) only: the all-gathers and reduce-scatters sit in the rules,
i.e. in module hooks, where the runtime puts them. Prices (S the whole tensor's bytes):

    col-seq        AG(S_in) forward (Conv1D: in gath) + RS(S_in) backward (the input gradient)
    col-module     AG(S_u) + RS(S_u), once per module (its linears' partial input gradients add up first)
    row-seq        RS(S_out) forward + AG(S_out) backward (Conv1D: in scat)
    vocab-seq      RS(S_out) + AG(S_out)
    gather         AG(S_in) forward; backward free (every rank computes the same whole gradient: a slice)
    scatter        backward AG(S_out); forward free (a slice)

A Megatron block thus trades each all-reduce for a reduce-scatter and an all-gather of the same
tensor: the same bytes per rank, 2(p−1)/p·S, and the same α-β time (``autoshard.cost.comm``),
while the per-token ops run on 1/tp of the tokens and their activations are 1/tp in memory. (Without
sequence parallelism DTensor all-reduces the input gradient of each column-parallel linear apart, so
attention's q, k, v cost three all-reduces where a col-module costs one reduce-scatter.) A module
gathering its input keeps that whole input for its backward, one copy per gathering module or linear
(``TPChoice.block_activation_fraction`` counts it). Attention code reads its input's sequence length
(``b, s, _ = x.shape``; HF's ``hidden_states.shape[:-1]``) and views the projections with it: a
per-linear gather leaves that size 1/tp of the projections' tokens, which the proof refuses; the
col-module gather is what runs there.

Values crossing segments (``sp_boundary``): crossing edges of the whole graph join the values at both
ends into classes (a representative block's input slot, the values every repeat feeds it, the
rest's values read by blocks and its reads of block outputs). A class is Q when every value in it has
a legal Q and every segment can run with it Q: per segment, CP-SAT maximises Σ b over boolean
boundary layouts b (1 = Q); a class that some segment leaves R is dropped and the segments are solved
again until none is (a fixed point; the prices play no part: with ``sequence_parallel=True`` the
residual stream is Q wherever the model allows). Model inputs and outputs stay R. A value of the rest
that is R but must enter a block as Q takes R→Q at that block's input (``scatter-seq-input-dim{q}``,
a slice; backward AG) when all its outside readers are in that one block, and one value per block.

The TP proof (``passes.capturing.tp_proof``) checks the Q rules on the model's own code as it checks S
(``OpGraph.tp_proofs[f"{tp}sp"]``); a model whose code does not compute on sequence shards comes
out with R segments, ``TPChoice.sequence_parallel`` False.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ortools.sat.python import cp_model

from autoshard.cost.comm import all_gather_s, allreduce_s, reduce_scatter_s
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import MAX_SEQ_DIM, SegmentCost, TPChoice
from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.names import op_name
from autoshard.ir.topology import DeviceSpec, LinkSpec

R, S, P = "R", "S", "P"
Q = "Q"  # sharded over the sequence (sequence parallelism)
G, H = "G", "H"  # inside a Conv1D: its input gathered at the module's input hook; its partial sums to reduce-scatter
LAYOUTS = (R, S, P)
SP_LAYOUTS = (R, S, P, Q, G, H)
PS_PER_S = 1e12  # CP-SAT needs integers: costs are in picoseconds
FWD_BWD_FACTOR = 3  # forward matmul + two backward matmuls (input and weight gradients)

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
PER_TOKEN_OPS = PASS_OPS | VIEW_OPS | MOVE_OPS | REDUCE_OPS | NORM_OPS | DIM_OPS  # per token where q survives
SEQ_KINDS = frozenset({"seq", "colq", "colm", "rowq", "vocabq", "repg", "reps", "gath", "scat", "slice"})  # use Q/G/H
SEQ_SOURCE_KINDS = frozenset({"rowq", "vocabq", "reps", "scat", "slice"})  # make Q from values that are not Q
SEQ_GATHER_KINDS = frozenset({"colq", "colm", "repg", "gath"})  # make whole tokens from Q
CONV1D_TYPE = "transformers.pytorch_utils.Conv1D"
LINEAR_TYPES = frozenset({"torch.nn.modules.linear.Linear", "torch.nn.modules.linear.NonDynamicallyQuantizableLinear"})
EMBEDDING_TYPES = frozenset({"torch.nn.modules.sparse.Embedding"})
UNEXERCISED_PREFIX = "not run on a shard by the check"  # passes.capturing.tp_proof.UNEXERCISED
FUSED_REASON = (
    "fused q, k, v (its output is split along the sharded dim by {op}): a column shard would give each "
    "rank a contiguous block of the [q | k | v] columns, not its slice of q, k and v; replicated"
)

STYLE_OF_RULE = {"col": "colwise", "row": "rowwise", "vocab": "vocab-parallel-embedding", "rep": "replicate"}
CONV1D_STYLE_OF_RULE = {"col": "conv1d-colwise", "row": "conv1d-rowwise", "rep": "replicate"}


@dataclass(frozen=True)
class Rule:
    """One way to run an op: required layouts of its activation inputs, the output layout."""

    kind: str  # "rep", "col", "row", "vocab", "shard" (elementwise / sdpa on shards)
    inputs: tuple[str, ...]
    output: str


# ---------------------------------------------------------------------------- entry point


def choose_tp_styles(
    graph: OpGraph, tp: int, link: LinkSpec, device: DeviceSpec, sequence_parallel: bool = False
) -> TPChoice:
    """Solve the layout model (module doc) per block signature and for the ops outside blocks; with
    ``sequence_parallel`` the residual stream between blocks is sharded over the sequence (Q) where the
    model allows (module doc, "Sequence parallelism"), replicated elsewhere."""
    if tp < 1:
        raise AutoshardError(f"tp={tp} must be a positive integer")
    violations = check_divisibility(graph, tp)
    if violations:
        raise AutoshardError(
            f"tp={tp} cannot split this model: {'; '.join(violations)}; "
            f"fix: use tp in {valid_degrees(graph, up_to=max(tp, 8))}"
        )
    styles, reasons = _default_styles(graph)
    choice = TPChoice(tp, styles, reasons)
    if tp == 1:
        return choice
    sp = sequence_parallel and sp_available(graph, tp)
    boundary = sp_boundary(graph, tp) if sp else None
    consumers = consumer_map(graph)
    chosen: dict[str, dict[str, Rule]] = {}
    for path, nodes, repeats in segments(graph):
        rules, cost, scatters = solve_segment(graph, nodes, consumers, tp, link, device, boundary)
        cost.path, cost.repeats = path, repeats
        choice.segments.append(cost)
        _record_styles(graph, choice, nodes, rules, path, sp, scatters)
        chosen[path] = rules
        choice.sequence_parallel |= bool(scatters) or any(uses_seq(r) for r in rules.values())
    choice.block_activation_fraction = block_activation_fraction(graph, tp, chosen)
    return choice


def uses_seq(rule: Rule) -> bool:
    """The rule reads or writes a sequence shard (Q, or a Conv1D's G / H)."""
    return rule.kind in SEQ_KINDS


def sp_available(graph: OpGraph, tp: int) -> bool:
    """Sequence parallelism can be considered: a token model, and the TP proof checked it at tp (module doc of
    ``passes.capturing.tp_proof``) without refusing it outright; a hand-built graph (never checked) may."""
    if graph.tokens_per_sample <= 1:
        return False
    refused = proof_refusals(graph, tp, sp=True)
    return refused is not None and SP_REFUSED not in refused


PROOF_DEGREES = range(2, 9)  # tp inside a node of up to 8 devices; each that divides the heads is checked
SP_REFUSED = "*sequence-parallel"  # a tp_proofs entry: the model's code refused every sequence-parallel layout


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
    """The inputs that are activations (not parameters or buffers), in argument order; of ``x.type_as(y)``
    only x (y gives a dtype, the same on every rank whatever its layout: RMSNorms' ``output.type_as(x)``)."""
    names = [name for name in node.inputs if name not in graph.placeholder_params]
    return names[:1] if op_name(node.target) in DTYPE_ONLY_OPS else names


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
    elif op in BATCHED_MATMUL_OPS:
        out = _batched_matmul_dim(graph, node, dims)
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


# ---------------------------------------------------------------------------- sequence dims


def seq_dims(graph: OpGraph) -> dict[str, int | None]:
    """q(v) for every model input and node of the graph: the dim holding its tokens, or None (module doc,
    "Sequence parallelism"). Once per graph."""
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
        j = _view_dim(in_shape, shape, first)
        return j if j is not None and shape[j] == in_shape[first] else None  # the tokens stay one whole dim
    if op == "transpose":
        return _transpose_dim(node, len(shape), first)
    if op == "unsqueeze":
        return first + (node.attrs["dim"] % len(shape) <= first)
    if op == "expand":
        d = first + len(shape) - len(in_shape)
        return d if shape[d] == in_shape[first] else None
    if op in DIM_OPS:
        d = _dim_attr(node, len(in_shape))
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


# ---------------------------------------------------------------------------- rules per op


def op_rules(graph: OpGraph, node: OpNode, dims: dict, tp: int, sp: bool = False) -> list[Rule]:
    """The legal ways to run ``node`` (module doc table); with ``sp`` also the sequence-parallel ones
    (``seq_rules``)."""
    op, ins = op_name(node.target), activation_inputs(graph, node)
    n_in = len(ins)
    rules = [Rule("rep", (R,) * n_in, R)]
    if op in SINK_OPS:
        sinks = (R, S, P, Q) if sp else LAYOUTS
        return [Rule("rep", (layout,) * n_in, R) for layout in sinks][: 1 if not n_in else len(sinks)]
    if op in LINEAR_OPS and not linear_refusal(graph, node, tp):
        if dims.get(node.name) is not None:
            rules.append(Rule("col", (R,), S))
        if row_can_split(graph, node, dims):
            rules.append(Rule("row", (S,), P))
    elif op in EMBEDDING_OPS and embedding_can_split(graph, node, tp):
        rules.append(Rule("vocab", (R,) * n_in, P))
    elif dims.get(node.name) is not None and op not in LINEAR_OPS | EMBEDDING_OPS:
        rules.append(Rule("shard", shard_rule_inputs(graph, node, dims), S))
    return rules + (seq_rules(graph, node, dims, seq_dims(graph), tp) if sp else [])


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


def seq_rules(graph: OpGraph, node: OpNode, dims: dict, qdims: dict, tp: int) -> list[Rule]:
    """The sequence-parallel rules of ``node`` (module doc, "Sequence parallelism")."""
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


def segment_rules(graph: OpGraph, nodes: list[OpNode], tp: int, sp: bool = False) -> tuple[dict, dict[str, list[Rule]]]:
    """(s(v) per node, ``allowed_rules``) of a segment, once per graph, tp, sequence parallelism and proof:
    the search prices many micro-batch sizes, and each solve's styles read them again."""
    key = ("tp_rules", tp, tuple(n.name for n in nodes), _refusal_key(graph, tp, sp)) + (("sp",) if sp else ())

    def compute():
        dims = shard_dims(graph, nodes, tp)
        return dims, allowed_rules(graph, nodes, dims, tp, sp)

    return graph.derived(key, compute)


def _refusal_key(graph: OpGraph, tp: int, sp: bool) -> tuple | None:
    refused = proof_refusals(graph, tp, sp)
    return None if refused is None else tuple(sorted(refused))


def param_readers(graph: OpGraph) -> dict[str, tuple[str, ...]]:
    """Module path -> the nodes that read one of its parameters (not buffers), once per graph."""

    def compute():
        out: dict[str, list[str]] = {}
        for n in graph.nodes:
            for module in dict.fromkeys(
                graph.param(p).module_path for p in n.param_inputs if not graph.param(p).is_buffer
            ):
                out.setdefault(module, []).append(n.name)
        return {m: tuple(names) for m, names in out.items()}

    return graph.derived("tp_param_readers", compute)


def allowed_rules(graph: OpGraph, nodes: list[OpNode], dims: dict, tp: int, sp: bool = False) -> dict[str, list[Rule]]:
    """``op_rules`` less what the model's code was not proven to compute on shards (``proof_refusals``: a node
    refused whole keeps its replicated rule only, ``node:kind`` drops that kind of rule) and less shard rules
    on replicated parameters that cannot be made DTensors (``param_module``)."""
    refused = proof_refusals(graph, tp, sp)
    rules = {}
    for n in nodes:
        rs = op_rules(graph, n, dims, tp, sp)
        if refused is None or n.name in refused:
            rs = rs[:1]
        elif sp:
            rs = [r for r in rs if f"{n.name}:{r.kind}" not in refused]
        rules[n.name] = rs
    for module, members in param_modules(graph, nodes).items():
        if not param_module_fits(graph, module, members, rules, dims):
            for n in members:
                if _reads_own_params(graph, n, module):  # replicated (a gather at its input stays possible)
                    rules[n.name] = rules[n.name][:1] + [r for r in rules[n.name][1:] if r.kind == "repg"]
    return rules


def unproven_degrees(graph: OpGraph, degrees) -> list[int]:
    """The degrees of ``degrees`` that the proof would check (``PROOF_DEGREES``, dividing the heads) and that
    ``graph`` has no proof for yet; none for a graph never proved (hand-built: ``proof_refusals``)."""
    if graph.tp_proofs is None:
        return []
    return [
        tp
        for tp in degrees
        if tp in PROOF_DEGREES and proof_key(tp) not in graph.tp_proofs and not check_divisibility(graph, tp)
    ]


def proof_key(tp: int, sp: bool = False) -> str:
    """The ``OpGraph.tp_proofs`` entry of degree tp, with or without sequence parallelism."""
    return f"{tp}sp" if sp else str(tp)


def proof_refusals(graph: OpGraph, tp: int, sp: bool = False) -> dict[str, str] | None:
    """Nodes whose computation on a tp shard the model's code was not shown to give (passes/capturing/tp_proof); {} for
    a graph never checked (hand-built); None when tp was not among the degrees checked: nothing shards.
    With ``sp`` the entry that checked sequence-parallel layouts too."""
    if graph.tp_proofs is None:
        return {}
    return graph.tp_proofs.get(proof_key(tp, sp))


def proof_reason(graph: OpGraph, node: OpNode, tp: int) -> str:
    """Why the proof refused the module's own op, or else the shards its output would reach, nearest module
    first."""
    refused = proof_refusals(graph, tp)
    if refused is None:
        return f"tp={tp} was not checked against the model's code when it was captured; replicated"
    own = (refused or {}).get(node.name, "")
    if own and not own.startswith("not run on a shard"):  # its own op (the model's code read its weight)
        return own
    if not refused or node.module_path not in _col_paths(graph):
        return ""
    parent = node.module_path.rpartition(".")[0]
    near = [
        r
        for name, r in refused.items()
        if graph.node(name).module_path.startswith(parent) and not r.startswith("not run on a shard")
    ]
    return near[0] if near else ""


def _col_paths(graph: OpGraph) -> set[str]:
    return graph.derived(
        "tp_linear_paths", lambda: {n.module_path for n in graph.nodes if op_name(n.target) in LINEAR_OPS}
    )


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
    rule (but those computing on its parameters alone, e.g. Gemma's ``1 + weight``: replicated DTensors),
    its parameters read nowhere else, one activation input from outside it."""
    if not module or any(op_name(n.target) in LINEAR_OPS | EMBEDDING_OPS for n in members):
        return False
    of_params = _params_only(graph, members)
    if any(
        n.shape and n.name not in of_params and not any(r.kind in ("shard", "seq") for r in rules[n.name])
        for n in members
    ):
        return False
    names = {n.name for n in members}
    if any(n not in names for n in param_readers(graph).get(module, ())):
        return False
    return len(module_inputs(graph, members)) == 1


def _params_only(graph: OpGraph, members: list[OpNode]) -> set[str]:
    """The members computed from parameters and constants alone (no activation reaches them)."""
    out: set[str] = set()
    for n in members:  # graph order: an op's inputs come before it
        if n.param_inputs and all(x in out for x in activation_inputs(graph, n)):
            out.add(n.name)
        elif not n.param_inputs and activation_inputs(graph, n) and all(x in out for x in activation_inputs(graph, n)):
            out.add(n.name)
    return out


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


def add_replicated_param_modules(
    model, graph: OpGraph, nodes: list[OpNode], rules: dict, pick: dict, dims: dict
) -> None:
    """A module with replicated parameters runs wholly on shards (its SequenceParallel style) or wholly
    replicated: every op inside it picks the same kind."""
    for module, members in param_modules(graph, nodes).items():
        if param_module_fits(graph, module, members, rules, dims):
            of_params = _params_only(graph, members)  # replicated in either case
            _same_kind(model, [n for n in members if n.shape and n.name not in of_params], rules, pick)


def _same_kind(model, group: list[OpNode], rules: dict, pick: dict) -> None:
    """Σ_{k: kind(k)=c} x[n,k] equal across the group for every kind c (a module gathering its input,
    ``repg`` on its first op, still runs replicated: it counts as ``rep``)."""
    kind_of = lambda r: "rep" if r.kind == "repg" else r.kind  # noqa: E731
    kinds = sorted({kind_of(r) for n in group for r in rules[n.name]})
    for kind in kinds:
        sums = [sum((x for x, r in zip(pick[n.name], rules[n.name]) if kind_of(r) == kind), 0) for n in group]
        for other in sums[1:]:
            if not (isinstance(sums[0], int) and isinstance(other, int)):
                model.Add(sums[0] == other)


# ---------------------------------------------------------------------------- CP-SAT model


class SegmentModel(NamedTuple):
    """One segment's CP-SAT model: x per node, its cost terms (var, flops, collective, bytes), and with
    sequence parallelism the scatter transitions t[v, R→Q] per value and the soft boundary b per class."""

    model: cp_model.CpModel
    rules: dict
    pick: dict
    terms: list
    scatters: dict = {}
    soft: dict = {}


def solve_segment(
    graph: OpGraph,
    nodes: list[OpNode],
    consumers: dict,
    tp: int,
    link: LinkSpec,
    device: DeviceSpec,
    boundary: Boundary | None = None,
) -> tuple[dict[str, Rule], SegmentCost, dict]:
    """Solve the CP-SAT model of one segment on ``link``; the chosen rule per node, its cost and the values it
    hands to a block through ``scatter-seq-input`` (value -> (block, seq dim)). The variables and constraints
    depend on the graph, the segment, tp and the boundary only: they are built once (``segment_model``; a
    search solves each for several micro-batch sizes, i.e. scaled links) and solved again with each link's
    prices as the objective. ``boundary`` (``sp_boundary``) turns sequence parallelism on."""
    sp = boundary is not None
    key = ("tp_segment_model", tp, tuple(n.name for n in nodes), _refusal_key(graph, tp, sp)) + (
        (("sp",) + boundary.key,) if sp else ()
    )
    built = graph.derived(key, lambda: segment_model(graph, nodes, consumers, tp, boundary))
    costs = priced(built.terms, tp, link, device)
    add_objective(built.model, costs)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    status = solver.Solve(built.model)
    assert status == cp_model.OPTIMAL, f"TP layout model: {solver.StatusName(status)}"
    rules, pick = built.rules, built.pick
    chosen = {name: rs[k] for name, rs in rules.items() for k in range(len(rs)) if solver.Value(pick[name][k])}
    scatters = {name: boundary.scatter[name] for name, var in built.scatters.items() if solver.Value(var)}
    return chosen, _segment_cost(solver, costs), scatters


def segment_model(
    graph: OpGraph,
    nodes: list[OpNode],
    consumers: dict,
    tp: int,
    boundary: Boundary | None = None,
    soft: dict[str, int] | None = None,
) -> SegmentModel:
    """The segment's model (``SegmentModel``). ``soft`` (value -> class) makes those boundary values' layouts
    variables (``sp_boundary``'s fixed point) instead of ``boundary``'s."""
    sp = boundary is not None
    dims, rules = segment_rules(graph, nodes, tp, sp)
    model = cp_model.CpModel()
    pick = add_op_choice(model, rules)
    layout = add_layouts(model, nodes, rules, pick, SP_LAYOUTS if sp else LAYOUTS)
    terms, scatters, soft_vars = add_edge_transitions(
        model, graph, nodes, rules, pick, layout, consumers, boundary, soft
    )
    add_same_module_rules(model, graph, nodes, rules, pick)
    add_replicated_param_modules(model, graph, nodes, rules, pick, dims)
    if sp:
        add_one_hook_per_conv1d(model, graph, nodes, rules, pick)
        add_module_gathers_together(model, graph, nodes, rules, pick)
    return SegmentModel(model, rules, pick, terms + op_terms(graph, nodes, rules, pick, tp), scatters, soft_vars)


def priced(terms: list[tuple], tp: int, link: LinkSpec, device: DeviceSpec) -> list[tuple]:
    """(var, compute_s, comm_s, comm_bytes) of every term: 3·T_c(flops) on the device, the collective on the link."""
    flops_per_s = device.peak_tflops * 1e12 * device.matmul_efficiency
    comm = {
        None: lambda size: 0.0,
        "all_reduce": lambda size: allreduce_s(size, tp, link),
        "all_gather": lambda size: all_gather_s(size, tp, link),
        "reduce_scatter": lambda size: reduce_scatter_s(size, tp, link),
    }
    return [(var, FWD_BWD_FACTOR * flops / flops_per_s, comm[kind](size), size) for var, flops, kind, size in terms]


def add_op_choice(model: cp_model.CpModel, rules: dict[str, list[Rule]]) -> dict[str, list]:
    """x[n,k] booleans, Σ_k x[n,k] = 1."""
    pick = {name: [model.NewBoolVar(f"x[{name},{k}]") for k in range(len(rs))] for name, rs in rules.items()}
    for xs in pick.values():
        model.AddExactlyOne(xs)
    return pick


def add_layouts(
    model, nodes: list[OpNode], rules: dict, pick: dict, layouts: tuple[str, ...] = LAYOUTS
) -> dict[str, dict[str, object]]:
    """L(v)=a as a linear expression of the x of v's producer: Σ_{k: out(k)=a} x[v,k]."""
    return {
        n.name: {a: sum(x for x, r in zip(pick[n.name], rules[n.name]) if r.output == a) for a in layouts}
        for n in nodes
    }


# tuples, not sets: the model's variables are made in this order, and a set of strings iterates in the process's
# hash order, so CP-SAT met the same model in another order in each process and chose another of its optima
TRANSITIONS = ((R, R), (S, S), (P, P), (P, R), (S, R))
SP_TRANSITIONS = TRANSITIONS + ((Q, Q), (G, G), (H, H))  # gathers and reduce-scatters sit in rules (module hooks)
SCATTER = (R, Q)  # a value of the rest sliced at a block's input (scatter-seq-input); only on a boundary


def add_edge_transitions(
    model,
    graph: OpGraph,
    nodes: list[OpNode],
    rules: dict,
    pick: dict,
    layout: dict,
    consumers: dict,
    boundary: Boundary | None = None,
    soft: dict[str, int] | None = None,
) -> tuple[list[tuple], dict, dict]:
    """t[e,a,b] per edge into the segment's nodes and per value leaving it; returns (cost terms, scatter
    transitions, soft boundary variables). A col linear's output is gathered for every reader or for none
    (``add_gather_all_or_none``). Without ``boundary`` everything entering or leaving is R."""
    inside = {n.name for n in nodes}
    lays = LAYOUTS if boundary is None else SP_LAYOUTS
    terms, edges_of, scatters, soft_vars = [], {}, {}, {}
    crossing = boundary.crossing if boundary is not None else frozenset()
    for node in nodes:
        for i, name in enumerate(activation_inputs(graph, node)):
            need = {b: sum(x for x, r in zip(pick[node.name], rules[node.name]) if r.inputs[i] == b) for b in lays}
            have = layout[name] if name in inside else _boundary_layout(model, boundary, soft, soft_vars, name)
            edge_terms, t = _link_edge(model, graph, f"{name}->{node.name}", name, have, need, lays)
            terms += edge_terms
            edges_of.setdefault(name, []).append(t)
    for node in nodes:  # values read outside the segment, or returned by the model: R, or Q under SP
        outside = [c for c in consumers.get(node.name, []) if c not in inside]
        if node.shape and (outside or not consumers.get(node.name) or node.name in crossing):
            need = _boundary_layout(model, boundary, soft, soft_vars, node.name)
            scatter = (SCATTER,) if boundary is not None and node.name in boundary.scatter else ()
            edge_terms, t = _link_edge(
                model, graph, f"{node.name}->out", node.name, layout[node.name], need, lays, scatter
            )
            terms += edge_terms
            edges_of.setdefault(node.name, []).append(t)
            if scatter:
                scatters[node.name] = t[SCATTER]
    add_gather_all_or_none(model, edges_of)
    return terms, scatters, soft_vars


def _boundary_layout(model, boundary: Boundary | None, soft: dict | None, soft_vars: dict, name: str) -> dict:
    """The layout of a value entering or leaving the segment: R; under SP the boundary's (R or Q), or, for a
    value of a class in ``soft``, b = 1 for Q (one variable per class and segment)."""
    if boundary is None:
        return {R: 1, S: 0, P: 0}
    value = boundary.canon.get(name, name)
    if soft and value in soft:
        b = soft_vars.setdefault(soft[value], model.NewBoolVar(f"b[{soft[value]}]"))
        return {R: 1 - b, Q: b}
    return {boundary.layout(name): 1}


def add_gather_all_or_none(model, edges_of: dict[str, list[dict]]) -> None:
    """ColwiseParallel(output_layouts=Replicate()) hands every reader the gathered tensor, so no reader of
    a value may keep its shard (S→S) while another gathers it (S→R): t[e,S,S] + t[e',S,R] ≤ 1."""
    for edges in edges_of.values():
        kept = [t[S, S] for t in edges if (S, S) in t]
        gathered = [t[S, R] for t in edges if (S, R) in t]
        for a in kept:
            for b in gathered:
                model.Add(a + b <= 1)


def _link_edge(
    model,
    graph: OpGraph,
    key: str,
    producer: str,
    have: dict,
    need: dict,
    layouts: tuple[str, ...] = LAYOUTS,
    extra: tuple = (),
) -> tuple[list[tuple], dict]:
    size = graph.value_bytes(producer)
    node = graph._by_name().get(producer)
    after_linear = node is not None and op_name(node.target) in LINEAR_OPS and not is_conv1d(node)
    transitions = TRANSITIONS if layouts == LAYOUTS else SP_TRANSITIONS
    allowed = [(a, b) for a, b in transitions if (a, b) != (S, R) or after_linear] + list(extra)
    t = {(a, b): model.NewBoolVar(f"t[{key},{a}{b}]") for a, b in allowed}
    for a in layouts:
        model.Add(sum(v for (x, _), v in t.items() if x == a) == have.get(a, 0))
    for b in layouts:
        model.Add(sum(v for (_, y), v in t.items() if y == b) == need.get(b, 0))
    collective = {(P, R): "all_reduce", (S, R): "all_gather", SCATTER: "all_gather"}  # scatter: backward gather
    return [(var, 0.0, collective[a, b], size) for (a, b), var in t.items() if (a, b) in collective], t


def add_one_hook_per_conv1d(model, graph: OpGraph, nodes: list[OpNode], rules: dict, pick: dict) -> None:
    """A replicated Conv1D gathers its input or slices its output, not both (one style per module):
    x[entry, gath] + x[exit, slice] ≤ 1."""
    names = {n.name for n in nodes}
    for linear, around in conv1d_views(graph).items():
        if linear not in names or around[0] in ("entry", "exit"):
            continue
        entry, exit_ = around
        gathers = [x for x, r in zip(pick[entry], rules[entry]) if r.kind == "gath"]
        slices = [x for x, r in zip(pick[exit_], rules[exit_]) if r.kind == "slice"]
        if gathers and slices:
            model.Add(sum(gathers) + sum(slices) <= 1)


def add_module_gathers_together(model, graph: OpGraph, nodes: list[OpNode], rules: dict, pick: dict) -> None:
    """The linears under one module gather (``module_gathers``) are column-parallel on its gathered input
    together or not at all: x[n,colm] equal for all of them."""
    names = {n.name for n in nodes}
    for linear, (_, _, group) in module_gathers(graph).items():
        if linear != group[0] or not all(g in names for g in group):
            continue
        xs = [sum((x for x, r in zip(pick[g], rules[g]) if r.kind == "colm"), 0) for g in group]
        for other in xs[1:]:
            if not (isinstance(xs[0], int) and isinstance(other, int)):
                model.Add(xs[0] == other)


SPLIT_KINDS = frozenset({"col", "row", "shard", "colq", "colm", "rowq", "seq"})  # compute on 1/tp of the data


def op_terms(graph: OpGraph, nodes: list[OpNode], rules: dict, pick: dict, tp: int) -> list[tuple]:
    """(x, flops, collective, comm_bytes) per op rule: T_c(flops/d(k)) and its collectives (``rule_collectives``)
    once priced; a rule with two collectives adds a second term on the same x."""
    terms = []
    for node in nodes:
        for x, rule in zip(pick[node.name], rules[node.name]):
            split = tp if rule.kind in SPLIT_KINDS else 1
            collectives = rule_collectives(graph, node, rule)
            kind, size = collectives[0] if collectives else (None, 0)
            terms.append((x, node.flops / split, kind, size))
            terms += [(x, 0.0, more, more_size) for more, more_size in collectives[1:]]
    return terms


def rule_collectives(graph: OpGraph, node: OpNode, rule: Rule) -> list[tuple[str, int]]:
    """(collective, bytes S of the whole tensor) that running ``node`` by ``rule`` costs, forward and backward
    (module doc: c_bwd(col), and the sequence-parallel prices)."""
    if rule.kind != "col" and rule.kind not in SEQ_KINDS:
        return []
    ins = activation_inputs(graph, node)
    x = graph.value_bytes(ins[0]) if ins else 0
    out = graph.value_bytes(node.name)
    gathers = rule.inputs[:1] == (Q,)  # a Conv1D's linear reads G: its entry view gathered
    first_of_group = module_gathers(graph).get(node.name, ("", "", ("",)))[2][0] == node.name
    return {
        "col": [("all_reduce", x)],
        "colm": [("all_gather", x), ("reduce_scatter", x)] if first_of_group else [],  # once per module
        "colq": ([("all_gather", x)] if gathers else []) + [("reduce_scatter", x)],
        "repg": [("all_gather", graph.value_bytes(name)) for name, lay in zip(ins, rule.inputs) if lay == Q],
        "rowq": [("reduce_scatter", out), ("all_gather", out)] if rule.output == Q else [],
        "reps": [("all_gather", out)],
        "vocabq": [("reduce_scatter", out), ("all_gather", out)],
        "gath": [("all_gather", x)],
        "scat": [("reduce_scatter", out), ("all_gather", out)],
        "slice": [("all_gather", out)],
        "seq": [],
    }[rule.kind]


def add_objective(model, terms: list[tuple]) -> None:
    model.Minimize(sum(var * round((compute + comm) * PS_PER_S) for var, compute, comm, _ in terms))


def _segment_cost(solver, terms: list[tuple]) -> SegmentCost:
    on = [(c, m, b) for var, c, m, b in terms if solver.Value(var)]
    return SegmentCost("", 1, sum(c for c, _, _ in on), sum(m for _, m, _ in on), sum(b for _, _, b in on))


# ---------------------------------------------------------------------------- sequence-parallel boundary


@dataclass(frozen=True)
class Boundary:
    """Layouts of the values crossing segments under sequence parallelism (module doc): a value is named by
    its representative's node (``canon``) when it belongs to a repeated block."""

    q_values: frozenset[str]  # values crossing segments that run Q
    crossing: frozenset[str]  # every value crossing segments
    scatter: dict = field(default_factory=dict)  # rest value -> (block module, seq dim): may enter it R→Q
    canon: dict = field(default_factory=dict)  # node of a repeated block -> the representative's node

    def layout(self, name: str) -> str:
        return Q if self.canon.get(name, name) in self.q_values else R

    @property
    def key(self) -> tuple:
        return tuple(sorted(self.q_values)), tuple(sorted(self.scatter))


def sp_boundary(graph: OpGraph, tp: int) -> Boundary:
    """Which crossing values are Q (module doc, "Values crossing segments"), once per graph, tp and proof."""
    return graph.derived(("tp_sp_boundary", tp, _refusal_key(graph, tp, True)), lambda: _solve_boundary(graph, tp))


def _solve_boundary(graph: OpGraph, tp: int) -> Boundary:
    canon, class_of, fixed = crossing_classes(graph)
    qdims, consumers = seq_dims(graph), consumer_map(graph)
    members: dict[int, list[str]] = {}
    for value, c in class_of.items():
        members.setdefault(c, []).append(value)
    candidates = {
        c for c, values in members.items() if c not in fixed and all(seq_ok(graph, v, qdims, tp) for v in values)
    }
    scatter = scatter_candidates(graph, tp, {v for v, c in class_of.items() if c in candidates})
    crossing = frozenset(class_of)
    while candidates:
        soft = {v: c for v, c in class_of.items() if c in candidates}
        probe = Boundary(frozenset(), crossing, scatter, canon)
        dropped: set[int] = set()
        for _, nodes, _ in segments(graph):
            built = segment_model(graph, nodes, consumers, tp, probe, soft)
            if not built.soft:
                continue
            built.model.Maximize(sum(built.soft.values()))
            solver = cp_model.CpSolver()
            solver.parameters.num_workers = 1
            status = solver.Solve(built.model)
            assert status == cp_model.OPTIMAL, f"TP sequence-parallel boundary: {solver.StatusName(status)}"
            dropped |= {c for c, b in built.soft.items() if not solver.Value(b)}
        if not dropped:
            break
        candidates -= dropped
    q_values = frozenset(v for v, c in class_of.items() if c in candidates)
    return Boundary(q_values, crossing, {v: s for v, s in scatter.items() if v in q_values}, canon)


def crossing_classes(graph: OpGraph) -> tuple[dict[str, str], dict[str, int], set[int]]:
    """(node -> representative node, crossing value -> its class, classes that must stay R). Every edge u → n
    whose ends lie in different block instances (or one in a block, one outside all) joins u with the value
    that n's representative reads in the same argument; model inputs and model outputs fix their class R."""
    canon = representatives(graph)
    instance = {name: b.path for b in graph.blocks for name in b.node_names}
    by_name, readers = graph._by_name(), consumer_map(graph)
    parent: dict[str, str] = {}

    def find(v: str) -> str:
        parent.setdefault(v, v)
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    fixed_values = set()
    for node in graph.nodes:
        for i, u in enumerate(activation_inputs(graph, node)):
            if u in by_name and instance.get(u, "") == instance.get(node.name, ""):
                continue
            if u not in by_name and node.name not in instance:
                continue  # a model input read outside blocks: the rest's own input, R
            rep_reads = activation_inputs(graph, by_name[canon.get(node.name, node.name)])[i]
            a, b = find(canon.get(rep_reads, rep_reads)), find(canon.get(u, u))
            parent[a] = b
            if u not in by_name:
                fixed_values.add(u)
    for node in graph.nodes:
        if node.shape and not readers.get(node.name) and canon.get(node.name, node.name) in parent:
            fixed_values.add(canon.get(node.name, node.name))
    roots = sorted({find(v) for v in list(parent)})
    index = {r: k for k, r in enumerate(roots)}
    class_of = {v: index[find(v)] for v in parent if v in by_name}
    fixed = {index[find(v)] for v in fixed_values}
    return canon, class_of, fixed


def scatter_candidates(graph: OpGraph, tp: int, q_candidates: set[str]) -> dict[str, tuple[str, int]]:
    """Values of the rest (outside all blocks) that may enter a block R and be sliced there to Q by
    ``scatter-seq-input`` on that block: every reader outside the rest is in that one block, Q is legal on
    the value, the proof did not refuse it (``value:scatter``), and it is the block's only such value (the
    style slices the block's first positional input)."""
    instance = {name: b.path for b in graph.blocks for name in b.node_names}
    qdims, readers = seq_dims(graph), consumer_map(graph)
    refused = proof_refusals(graph, tp, sp=True) or {}
    found: dict[str, tuple[str, int]] = {}
    for node in graph.nodes:
        if node.name in instance or node.name not in q_candidates or f"{node.name}:scatter" in refused:
            continue
        blocks = {instance[r] for r in readers.get(node.name, []) if r in instance}
        if len(blocks) == 1 and seq_ok(graph, node.name, qdims, tp):
            found[node.name] = (blocks.pop(), qdims[node.name])
    per_block: dict[str, int] = {}
    for block, _ in found.values():
        per_block[block] = per_block.get(block, 0) + 1
    return {v: bq for v, bq in found.items() if per_block[bq[0]] == 1}


def representatives(graph: OpGraph) -> dict[str, str]:
    """Node of a repeated block -> the same node of its block's representative."""
    by_path = {b.path: b for b in graph.blocks}
    out = {}
    for block in graph.blocks:
        rep = by_path[block.representative]
        out |= dict(zip(block.node_names, rep.node_names))
    return out


# ---------------------------------------------------------------------------- styles


def _default_styles(graph: OpGraph) -> tuple[dict[str, str], dict[str, str]]:
    """Every module that owns parameters starts replicated."""
    styles = {p.module_path: "replicate" for p in graph.params if not p.is_buffer}
    return styles, {}


def _record_styles(
    graph: OpGraph,
    choice: TPChoice,
    nodes: list[OpNode],
    rules: dict[str, Rule],
    path: str,
    sp: bool = False,
    scatters: dict | None = None,
) -> None:
    """Write the representative's styles (and reasons) for it and every block sharing its signature, and
    ``scatter-seq-input`` on each block that slices a value of the rest (``scatters``: value -> (block, dim))."""
    local: dict[str, tuple[str, str]] = {}
    gathered = _gathered_outputs(graph, nodes, rules)
    for node in nodes:
        op = op_name(node.target)
        if op not in LINEAR_OPS | EMBEDDING_OPS or not node.module_path:
            continue
        style = module_style(graph, node, rules, gathered)
        reason = _replicate_reason(graph, node, choice.tp) if style == "replicate" else ""
        local[node.module_path] = (style, reason or _whole_heads_reason(graph, node, nodes, style, choice.tp))
    local |= _param_module_styles(graph, nodes, rules, choice.tp, sp)
    for node in nodes:
        if rules[node.name].kind == "colm":
            owner, value, _ = module_gathers(graph)[node.name]
            local[owner] = (f"gather-seq-module-input-dim{seq_dims(graph)[value]}", "")
        elif rules[node.name].kind == "repg" and node.name in module_input_gathers(graph):
            value = module_input_gathers(graph)[node.name]
            local[node.module_path] = (f"gather-seq-input-dim{seq_dims(graph)[value]}", "")
    for target in _repeats(graph, path):
        for module, (style, reason) in local.items():
            name = target + module[len(path) :] if path else module
            choice.styles[name] = style
            if reason:
                choice.reasons[name] = reason
    for block, dim in (scatters or {}).values():
        choice.styles[block] = f"scatter-seq-input-dim{dim}"


def module_style(graph: OpGraph, node: OpNode, rules: dict[str, Rule], gathered: set[str]) -> str:
    """The style of the linear / embedding module running ``node`` by its chosen rule (``ir.decisions.TP_STYLES``;
    a Conv1D's also by its entry and exit views' rules)."""
    kind, q = rules[node.name].kind, seq_dims(graph)
    x = (activation_inputs(graph, node) or [""])[0]
    if is_conv1d(node):
        assert node.name not in gathered, f"{node.module_path}: a Conv1D has no gather style"
        entry, exit_ = conv1d_views(graph).get(node.name, (None, None))
        outer = activation_inputs(graph, graph.node(entry))[0] if entry else ""
        if kind == "colq":
            return f"conv1d-colwise-seq-input-dim{q[outer]}"
        if kind == "repg":
            return f"gather-seq-input-dim{q[outer]}"
        if kind == "rowq":
            return f"conv1d-rowwise-seq-output-dim{q[exit_]}"
        if kind == "rep" and exit_ in rules and rules[exit_].kind == "slice":
            return f"scatter-seq-output-dim{q[exit_]}"
        return CONV1D_STYLE_OF_RULE[kind]
    by_kind = {
        "colq": lambda: f"colwise{'-gather' if node.name in gathered else ''}-seq-input-dim{q[x]}",
        "rowq": lambda: f"rowwise-seq-output-dim{q[node.name]}",
        "repg": lambda: f"gather-seq-input-dim{q[x]}",
        "reps": lambda: f"scatter-seq-output-dim{q[node.name]}",
        "vocabq": lambda: f"vocab-parallel-embedding-seq-output-dim{q[node.name]}",
    }
    if kind in by_kind:
        return by_kind[kind]()
    style = STYLE_OF_RULE.get("col" if kind == "colm" else kind, "replicate")
    return "colwise-gather" if style == "colwise" and node.name in gathered else style


def _param_module_styles(
    graph: OpGraph, nodes: list[OpNode], rules: dict[str, Rule], tp: int, sp: bool = False
) -> dict:
    """Style and reason of each module with replicated parameters (norms, per-head norms, scales):
    ``sharded-input-dim{d}`` when its ops run on shards (d: the dim its input is sharded on: s(v) for S,
    q(v) for Q)."""
    dims, allowed = segment_rules(graph, nodes, tp, sp)
    out = {}
    for module, members in param_modules(graph, nodes).items():
        kinds = {rules[n.name].kind for n in members}
        if not param_module_fits(graph, module, members, allowed, dims):  # (a block owning a parameter itself)
            out[module] = ("replicate", REPLICATED_PARAMS_REASON)
        elif "shard" in kinds:
            out[module] = (f"sharded-input-dim{dims[module_inputs(graph, members)[0]]}", "")
        elif "seq" in kinds:
            out[module] = (f"sharded-input-dim{seq_dims(graph)[module_inputs(graph, members)[0]]}", "")
        else:
            out[module] = ("replicate", "its input is replicated in the cheapest layout assignment")
    return out


REPLICATED_PARAMS_REASON = (
    "its computation needs whole tensors where its input would be sharded (a norm, softmax or "
    "reduction over that dim, or an op with no sharding rule); replicated"
)


def _gathered_outputs(graph: OpGraph, nodes: list[OpNode], rules: dict[str, Rule]) -> set[str]:
    """Col linears whose S output some consumer reads as R (so the runtime gathers it)."""
    out = set()
    inside = {n.name for n in nodes}
    for node in nodes:
        for i, name in enumerate(activation_inputs(graph, node)):
            if name in inside and rules[name].output == S and rules[node.name].inputs[i] == R:
                out.add(name)
    return out | {n.name for n in nodes if rules[n.name].kind in ("col", "colq", "colm") and _leaves(graph, n, inside)}


def _leaves(graph: OpGraph, node: OpNode, inside: set[str]) -> bool:
    readers = consumer_map(graph).get(node.name, [])
    return not readers or any(r not in inside for r in readers)


NO_STORAGE_OPS = VIEW_OPS | MOVE_OPS | SINK_OPS | {"alias", "detach", "operator.getitem", "lift_fresh"}


def block_activation_fraction(graph: OpGraph, tp: int, chosen: dict[str, dict[str, Rule]]) -> float | None:
    """``TPChoice.block_activation_fraction`` from the chosen rules of the block segments."""
    whole = local = 0.0
    for block in graph.blocks:
        if block.path != block.representative or block.path not in chosen:
            continue
        repeats = sum(b.signature == block.signature for b in graph.blocks)
        for name, rule in chosen[block.path].items():
            node = graph.node(name)
            if node.shape and op_name(node.target) not in NO_STORAGE_OPS:
                size = graph.value_bytes(name) * repeats
                whole += size
                local += size / tp if rule.output in (S, Q) else size
            first = rule.kind != "colm" or module_gathers(graph)[name][2][0] == name  # a module gathers once
            if rule.kind in SEQ_GATHER_KINDS and rule.inputs[:1] == (Q,) and first:
                local += graph.value_bytes(activation_inputs(graph, node)[0]) * repeats
    return local / whole if whole else None


def _replicate_reason(graph: OpGraph, node: OpNode, tp: int) -> str:
    op = op_name(node.target)
    refusal = (
        linear_refusal(graph, node, tp)
        if op in LINEAR_OPS
        else tied_reason(graph, node) or style_module_refusal(node, EMBEDDING_TYPES, "nn.Embedding")
        if op in EMBEDDING_OPS
        else ""
    )
    refusal = refusal or proof_reason(graph, node, tp)
    return refusal or (
        "the cheapest layout assignment keeps it replicated: sharding saves less compute than the "
        "resharding communication it adds"
    )


def _whole_heads_reason(graph: OpGraph, node: OpNode, nodes: list[OpNode], style: str, tp: int) -> str:
    """Why a column-parallel linear's output is gathered whole ("" where nothing in the model's graph stops
    a shard: the prices chose it). The op that stopped the shard (``_shard_blocker``): before the linear,
    where its input stopped being shardable (why it is not row-parallel: attention's output projection
    after heads kept whole), else after it, the first op that cannot take its column shard; inside the module
    that calls the linear (its attention), where a block's own layout is decided."""
    if op_name(node.target) not in LINEAR_OPS or not style.startswith("colwise-gather"):
        return ""
    dims, allowed = segment_rules(graph, nodes, tp)
    scope = node.module_path.rpartition(".")[0]  # the module calling the linear (attention): the search stays in it
    inside = {n.name for n in nodes if n.module_path == scope or n.module_path.startswith(f"{scope}.")}
    x = activation_inputs(graph, node)[:1]
    blocker = _shard_blocker(graph, x, dims, allowed, inside, tp, forward=False) or _shard_blocker(
        graph, [node.name], dims, allowed, inside, tp, forward=True
    )
    return f"its output is gathered whole: {blocker}" if blocker else ""


def _shard_blocker(
    graph: OpGraph, start: list[str], dims: dict, allowed: dict, inside: set[str], tp: int, forward: bool
) -> str:
    """The nearest op of the segment where a sharded value meets an op that cannot take the shard: forward
    from ``start`` through ops that take it (or were left unchecked only because nothing fed them a shard),
    or backward from ``start`` through values that have no shard (stopping at norms, reductions and linears,
    whose inputs are whole in any layout) to the op that ended one. Described with its module and why."""
    by_name = graph._by_name()
    readers, seen, frontier = consumer_map(graph), set(start), [x for x in start if x in by_name]
    stops = NORM_OPS | REDUCE_OPS | LINEAR_OPS | EMBEDDING_OPS
    while frontier:
        node = by_name[frontier.pop(0)]
        if forward:
            nexts = [r for r in readers.get(node.name, []) if r in inside]
        elif dims.get(node.name) is not None or op_name(node.target) in stops:
            nexts = []
        else:
            nexts = [x for x in activation_inputs(graph, node) if x in inside and x in by_name]
        for other in (n for n in nexts if n not in seen):
            seen.add(other)
            candidate, shard_in = (graph.node(other), node.name) if forward else (node, other)
            if dims.get(shard_in) is not None and not _takes_shard(graph, candidate, allowed, tp):
                return _blocker_text(graph, candidate, shard_in, dims, tp)
            frontier.append(other)
    return ""


def _takes_shard(graph: OpGraph, node: OpNode, allowed: dict, tp: int) -> bool:
    """``node`` has a rule on shards, or lost it only because the model's check never fed it one."""
    unexercised = (proof_refusals(graph, tp) or {}).get(node.name, "").startswith(UNEXERCISED_PREFIX)
    kinds = {rule.kind for rule in allowed.get(node.name, ())}
    return bool(kinds & {"shard", "row", "col"}) or unexercised or op_name(node.target) in SINK_OPS


def _blocker_text(graph: OpGraph, node: OpNode, shard_in: str, dims: dict, tp: int) -> str:
    """``op`` in ``module`` and why it cannot run on a shard of ``shard_in`` (sharded on dims[shard_in])."""
    op, where = op_name(node.target), f"`{op_name(node.target)}` in {node.module_path or 'the root module'}"
    refused = (proof_refusals(graph, tp) or {}).get(node.name, "")
    in_shape = graph.value_meta(shard_in)[0]
    if dims.get(node.name) is not None and refused:
        return f"{where}: {refused}"
    if op in DIM_OPS:
        return (
            f"{where} splits it along the sharded dim (one linear computing several projections, e.g. "
            f"[q | k | v]: a column shard would hold a block of the columns, not each part's heads); replicated"
        )
    if op in VIEW_OPS:
        return f"{where} folds the sharded dim into another ({tuple(in_shape)} → {tuple(node.shape)}); replicated"
    if op in REDUCE_OPS | NORM_OPS:
        return f"{where} reduces over the sharded dim; replicated"
    if op in SDPA_OPS and any(
        len(graph.value_meta(m)[0]) == 4 and graph.value_meta(m)[0][1] != 1 for m in _masks(graph, node)
    ):
        shapes = ", ".join(str(graph.value_meta(m)[0]) for m in _masks(graph, node))
        return (
            f"{where}: its mask or bias ({shapes}) spans the heads, whole on every rank (a per-head bias such as "
            f"relative positions or ALiBi, computed outside the projections); replicated"
        )
    if op in ELEMENTWISE_OPS:
        others = [graph.value_meta(x)[0] for x in node.inputs if x != shard_in]
        return (
            f"{where} combines it with a tensor whole along the sharded dim ({', '.join(map(str, others))}: e.g. "
            f"a per-head bias computed outside the projections); replicated"
        )
    return f"{where} has no rule to compute on a shard; replicated"


def _masks(graph: OpGraph, node: OpNode) -> list[str]:
    """SDPA's inputs after q, k and v (its attention mask or bias)."""
    return activation_inputs(graph, node)[3:]


def _repeats(graph: OpGraph, path: str) -> list[str]:
    if not path:
        return [""]
    signature = next(b.signature for b in graph.blocks if b.path == path)
    return [b.path for b in graph.blocks if b.signature == signature]
