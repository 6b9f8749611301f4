"""Tensor parallelism: choose a per-module TP style by optimising tensor layouts on the OpGraph
(``choose_tp_styles``), and say why a module stays replicated.

``choose_tp_styles`` refuses a tp that does not divide the heads (``passes.layouts.allowed``), solves the
segment model (``passes.layouts.segment_model``) per block signature and for the ops outside blocks, with
sequence parallelism on the boundary of ``passes.layouts.boundary``, and writes the chosen rules as styles.

Styles: a col / row nn.Linear is colwise (colwise-gather when its S output is read as R) /
rowwise; a col / row transformers Conv1D (weight (in, out), y = x·W + b, seen as its views around
an ``addmm``) is conv1d-colwise / conv1d-rowwise (``runtime.tensor_parallel``'s Conv1D styles); the
sequence-parallel rules (``passes.layouts.sequence``) have styles of their own (``module_style``).

A module gathering its input keeps that whole input for its backward, one copy per gathering module or linear
(``TPChoice.block_activation_fraction`` counts it: ``block_activation_fraction``).
"""

from __future__ import annotations

from autoshard.errors import AutoshardError
from autoshard.ir.decisions import TPChoice
from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.names import op_name
from autoshard.ir.topology import DeviceSpec, LinkSpec
from autoshard.passes.layouts.allowed import (
    UNEXERCISED_PREFIX,
    check_divisibility,
    param_module_fits,
    param_modules,
    proof_reason,
    proof_refusals,
    segment_rules,
    sp_available,
    valid_degrees,
)
from autoshard.passes.layouts.boundary import sp_boundary
from autoshard.passes.layouts.rules import (
    DIM_OPS,
    ELEMENTWISE_OPS,
    EMBEDDING_OPS,
    EMBEDDING_TYPES,
    LINEAR_OPS,
    MOVE_OPS,
    NORM_OPS,
    REDUCE_OPS,
    SDPA_OPS,
    SEQ_GATHER_KINDS,
    SINK_OPS,
    VIEW_OPS,
    Q,
    R,
    Rule,
    S,
    activation_inputs,
    consumer_map,
    is_conv1d,
    linear_refusal,
    module_inputs,
    segments,
    style_module_refusal,
    tied_reason,
    uses_seq,
)
from autoshard.passes.layouts.segment_model import solve_segment
from autoshard.passes.layouts.sequence import conv1d_views, module_gathers, module_input_gathers, seq_dims

STYLE_OF_RULE = {"col": "colwise", "row": "rowwise", "vocab": "vocab-parallel-embedding", "rep": "replicate"}
CONV1D_STYLE_OF_RULE = {"col": "conv1d-colwise", "row": "conv1d-rowwise", "rep": "replicate"}


def choose_tp_styles(
    graph: OpGraph, tp: int, link: LinkSpec, device: DeviceSpec, sequence_parallel: bool = False
) -> TPChoice:
    """Solve the layout model (``passes.layouts.segment_model``) per block signature and for the ops outside
    blocks; with ``sequence_parallel`` the residual stream between blocks is sharded over the sequence (Q) where
    the model allows (``passes.layouts.sequence``, ``passes.layouts.boundary``), replicated elsewhere."""
    if tp < 1:
        raise AutoshardError(f"tp={tp} must be a positive integer")
    violations = check_divisibility(graph, tp)
    if violations:
        raise AutoshardError(
            f"tp={tp} cannot split this model: {'; '.join(violations)}; "
            f"fix: use tp in {valid_degrees(graph, up_to=max(tp, 8))}"
        )
    styles, reasons = default_styles(graph)
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
        record_styles(graph, choice, nodes, rules, path, sp, scatters)
        chosen[path] = rules
        choice.sequence_parallel |= bool(scatters) or any(uses_seq(r) for r in rules.values())
    choice.block_activation_fraction = block_activation_fraction(graph, tp, chosen)
    return choice


def default_styles(graph: OpGraph) -> tuple[dict[str, str], dict[str, str]]:
    """Every module that owns parameters starts replicated."""
    styles = {p.module_path: "replicate" for p in graph.params if not p.is_buffer}
    return styles, {}


def record_styles(
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
