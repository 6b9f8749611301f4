"""What each op of a segment may run as at a degree tp: the rules of ``passes.layouts.rules`` (and with sequence
parallelism ``passes.layouts.sequence``), less what the TP proof refused, and which degrees divide the heads.

``op_rules`` gives an op's rules; ``allowed_rules`` keeps of them what the model's code was shown to compute on
shards (``proof_refusals``: ``OpGraph.tp_proofs``, written by ``passes.capturing.tp_proof``) and, for a module
with replicated parameters, what it can run as a whole (``param_module_fits``).

Divisibility (``check_divisibility``) is checked before the solve: tp must divide the query
heads and the KV heads of every attention; a violation is refused with the numbers and the
degrees that would work.

The TP proof (``passes.capturing.tp_proof``) checks the Q rules on the model's own code as it checks S
(``OpGraph.tp_proofs[f"{tp}sp"]``); a model whose code does not compute on sequence shards comes
out with R segments, ``TPChoice.sequence_parallel`` False.
"""

from __future__ import annotations

from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.names import op_name
from autoshard.passes.layouts.rules import (
    EMBEDDING_OPS,
    LAYOUTS,
    LINEAR_OPS,
    SDPA_OPS,
    SINK_OPS,
    P,
    Q,
    R,
    Rule,
    S,
    activation_inputs,
    embedding_can_split,
    linear_refusal,
    module_inputs,
    row_can_split,
    shard_dims,
    shard_rule_inputs,
)
from autoshard.passes.layouts.sequence import seq_dims, seq_rules

UNEXERCISED_PREFIX = "not run on a shard by the check"  # passes.capturing.tp_proof.UNEXERCISED

PROOF_DEGREES = range(2, 9)  # tp inside a node of up to 8 devices; each that divides the heads is checked
SP_REFUSED = "*sequence-parallel"  # a tp_proofs entry: the model's code refused every sequence-parallel layout


def op_rules(graph: OpGraph, node: OpNode, dims: dict, tp: int, sp: bool = False) -> list[Rule]:
    """The legal ways to run ``node`` (the table of ``passes.layouts.rules``' module doc); with ``sp`` also
    the sequence-parallel ones (``passes.layouts.sequence.seq_rules``)."""
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


def sp_available(graph: OpGraph, tp: int) -> bool:
    """Sequence parallelism can be considered: a token model, and the TP proof checked it at tp (module doc of
    ``passes.capturing.tp_proof``) without refusing it outright; a hand-built graph (never checked) may."""
    if graph.tokens_per_sample <= 1:
        return False
    refused = proof_refusals(graph, tp, sp=True)
    return refused is not None and SP_REFUSED not in refused


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


def segment_rules(graph: OpGraph, nodes: list[OpNode], tp: int, sp: bool = False) -> tuple[dict, dict[str, list[Rule]]]:
    """(s(v) per node, ``allowed_rules``) of a segment, once per graph, tp, sequence parallelism and proof:
    the search prices many micro-batch sizes, and each solve's styles read them again."""
    key = ("tp_rules", tp, tuple(n.name for n in nodes), refusal_key(graph, tp, sp)) + (("sp",) if sp else ())

    def compute():
        dims = shard_dims(graph, nodes, tp)
        return dims, allowed_rules(graph, nodes, dims, tp, sp)

    return graph.derived(key, compute)


def refusal_key(graph: OpGraph, tp: int, sp: bool) -> tuple | None:
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
    of_params = params_only(graph, members)
    if any(
        n.shape and n.name not in of_params and not any(r.kind in ("shard", "seq") for r in rules[n.name])
        for n in members
    ):
        return False
    names = {n.name for n in members}
    if any(n not in names for n in param_readers(graph).get(module, ())):
        return False
    return len(module_inputs(graph, members)) == 1


def params_only(graph: OpGraph, members: list[OpNode]) -> set[str]:
    """The members computed from parameters and constants alone (no activation reaches them)."""
    out: set[str] = set()
    for n in members:  # graph order: an op's inputs come before it
        if n.param_inputs and all(x in out for x in activation_inputs(graph, n)):
            out.add(n.name)
        elif not n.param_inputs and activation_inputs(graph, n) and all(x in out for x in activation_inputs(graph, n)):
            out.add(n.name)
    return out
