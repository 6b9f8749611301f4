"""The CP-SAT model of one segment: the layouts of ``passes.layouts.rules`` (and ``passes.layouts.sequence``) chosen at
the least compute and communication, solved once per block signature.

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

Sequence parallelism (``passes.layouts.sequence``): transitions add Q → Q (and G → G, H → H) only: the all-gathers
and reduce-scatters sit in the rules, i.e. in module hooks, where the runtime puts them. Values crossing segments
take the layouts of ``passes.layouts.boundary``. Prices (S the whole tensor's bytes):

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
attention's q, k, v cost three all-reduces where a col-module costs one reduce-scatter.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ortools.sat.python import cp_model

from autoshard.cost.comm import all_gather_s, allreduce_s, reduce_scatter_s
from autoshard.ir.decisions import SegmentCost
from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.names import op_name
from autoshard.ir.topology import DeviceSpec, LinkSpec
from autoshard.passes.layouts.allowed import param_module_fits, param_modules, params_only, refusal_key, segment_rules
from autoshard.passes.layouts.rules import (
    EMBEDDING_OPS,
    LAYOUTS,
    LINEAR_OPS,
    SEQ_KINDS,
    SP_LAYOUTS,
    G,
    H,
    P,
    Q,
    R,
    Rule,
    S,
    activation_inputs,
    is_conv1d,
)
from autoshard.passes.layouts.sequence import conv1d_views, module_gathers

if TYPE_CHECKING:  # annotations only
    from autoshard.passes.layouts.boundary import Boundary


PS_PER_S = 1e12  # CP-SAT needs integers: costs are in picoseconds
FWD_BWD_FACTOR = 3  # forward matmul + two backward matmuls (input and weight gradients)


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
    key = ("tp_segment_model", tp, tuple(n.name for n in nodes), refusal_key(graph, tp, sp)) + (
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
            of_params = params_only(graph, members)  # replicated in either case
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
