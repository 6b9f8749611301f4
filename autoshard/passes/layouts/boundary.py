"""The sequence-parallel boundary: which values crossing segments run sharded over the sequence (Q).

Values crossing segments (``sp_boundary``): crossing edges of the whole graph join the values at both
ends into classes (a representative block's input slot, the values every repeat feeds it, the
rest's values read by blocks and its reads of block outputs). A class is Q when every value in it has
a legal Q and every segment can run with it Q: per segment, CP-SAT maximises Σ b over boolean
boundary layouts b (1 = Q); a class that some segment leaves R is dropped and the segments are solved
again until none is (a fixed point; the prices play no part: with ``sequence_parallel=True`` the
residual stream is Q wherever the model allows). Model inputs and outputs stay R. A value of the rest
that is R but must enter a block as Q takes R→Q at that block's input (``scatter-seq-input-dim{q}``,
a slice; backward AG) when all its outside readers are in that one block, and one value per block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from autoshard.ir.graph import OpGraph
from autoshard.passes.layouts.allowed import proof_refusals, refusal_key
from autoshard.passes.layouts.rules import Q, R, activation_inputs, consumer_map, segments
from autoshard.passes.layouts.segment_model import segment_model
from autoshard.passes.layouts.sequence import seq_dims, seq_ok


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
    return graph.derived(("tp_sp_boundary", tp, refusal_key(graph, tp, True)), lambda: _solve_boundary(graph, tp))


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
