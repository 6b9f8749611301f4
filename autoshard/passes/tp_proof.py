"""TP proof: a sharded layout is accepted only where the model's own code computes it on a shard.

``passes.tensor_parallel`` propagates a sharded dim through the captured graph, whose sizes are
constants. The program does not run that graph: it runs the model's Python code on each rank's
local shards (``use_local_output=True``), and that code may have written a size as a constant
(OPT's ``q.view(bsz, -1, num_heads, head_dim)`` keeps all heads and folds the shard into the
sequence, silently) or read it from the tensor (Llama's ``view(*input_shape, -1, head_dim)``).
The graph alone cannot tell the two apart; running the code on shard-shaped tensors can.

For each degree t in 2..8 (``PROOF_DEGREES``) that divides the model's heads (``prove_degree``):

1. **The widest layout** (``widest_layout``): the layout model of ``passes.tensor_parallel`` per
   segment with the objective min Σ_n x[n, rep] over nodes that have another rule, i.e. as many
   ops as possible on shards, without the nodes refused so far.
2. **The local program** (``local_failures``): the model built on meta as capture builds it (folded
   likewise), every styled module (col, row, vocab-parallel) replaced by a stand-in that returns
   one tp rank's output shape (a col shard of the features, or the whole output where the style
   gathers or all-reduces), exported on the capture batch. A styled module runs its own code on
   DTensors at run time; the code between them runs on plain local tensors, and that is what is
   checked. Under the layout, node n should give its captured shape with dim s(n) divided by t
   where L(n) = S, and its captured shape elsewhere.
3. **Compare** node by node outside the styled modules (the two exports run the same code, so
   the same ops in the same order): a node whose inputs all had their expected shapes but whose own shape differs is
   refused (its code computes something else on a shard); ops that differ stop the comparison and
   refuse the first one; an export that raises refuses the ops of the innermost module that was
   running. A refusal in a repeated block refuses its representative's node (the solver decides
   per representative). Back to 1, at most ``MAX_ROUNDS`` times; then every shard is refused.
4. **Unexercised rules** are refused too: a shard rule of a non-linear op that the final widest
   layout did not use was never run on a shard, so the search may not pick it either.

What is proven: every op the search may run on shards gave, in the model's own code on shard-shaped
inputs, the shape the layout implies. The search may combine proven rules into another layout than
the widest; each op then still sees the input shapes it was checked with (a rule fixes its inputs'
layouts), so the argument carries over, unless an op's size arguments are read at run time from a
*different* tensor whose layout differs between the two (none of the zoo's models does this; the
zoo's tp2 programs are verified numerically). Per-head mixing that keeps shapes (a fused q|k|v split) is
refused by the propagation itself (``fused_split``, splits over the sharded dim). The result is
``OpGraph.tp_proofs[str(t)]``: node -> the reason it is refused; degrees not checked refuse all.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.nn as nn
from ortools.sat.python import cp_model

from autoshard.ir.decisions import TPChoice
from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.names import op_name
from autoshard.modelfile import ModelFile
from autoshard.passes.blocks import find_blocks
from autoshard.passes.capture import _module_of, _user_location, build_on_meta, export_module, target_name
from autoshard.passes.fold import fold_model, unfold
from autoshard.passes.tensor_parallel import (LINEAR_OPS, R, S, _default_styles, _record_styles, check_divisibility,
                                              consumer_map, segment_model, segments, shard_dims)

PROOF_DEGREES = range(2, 9)  # tp inside a node of up to 8 devices; each that divides the heads is checked
UNEXERCISED = "not run on a shard by the check of the model's code:"
MAX_ROUNDS = 6


def prove_tensor_parallel(model_file: ModelFile, graph: OpGraph) -> OpGraph:
    """``graph`` (captured, annotated, maybe folded) with ``tp_proofs`` for every degree it can take."""
    full = find_blocks(unfold(replace(graph, blocks=[])))
    graph.tp_proofs = {str(tp): prove_degree(model_file, graph, full, tp)
                       for tp in PROOF_DEGREES if not check_divisibility(full, tp)}
    return graph


def prove_degree(model_file: ModelFile, captured: OpGraph, full: OpGraph, tp: int) -> dict[str, str]:
    """Nodes refused at degree tp, with reasons (module doc, steps 1-4)."""
    refused: dict[str, str] = {}
    for _ in range(MAX_ROUNDS):
        full.tp_proofs = {str(tp): dict(refused)}
        layout = widest_layout(full, tp)
        if not any(rule.output == S for rule in layout.rules.values()):
            return refused | unexercised(full, tp, layout)  # nothing runs on shards: nothing to check
        failures = local_failures(model_file, captured, full, layout, tp)
        if not failures:
            return refused | unexercised(full, tp, layout)
        refused |= failures
    return {n.name: f"tp={tp}: the model's code did not match a sharded layout after {MAX_ROUNDS} attempts; "
                    f"replicated" for n in full.nodes}


class Layout:
    """The widest layout: per representative node its rule, per module its style, per node its s(n)."""

    def __init__(self, full: OpGraph, tp: int):
        self.rules: dict = {}
        self.allowed: dict = {}
        self.dims: dict = {}
        self.choice = TPChoice(tp, *_default_styles(full))
        self.rep_of = representatives(full)

    def output(self, name: str) -> str:
        rule = self.rules.get(self.rep_of.get(name, name))
        return rule.output if rule is not None else R

    def dim(self, name: str) -> int | None:
        return self.dims.get(self.rep_of.get(name, name))


def widest_layout(full: OpGraph, tp: int) -> Layout:
    """Step 1: per segment, as many ops on shards as the (refusal-filtered) rules allow."""
    layout = Layout(full, tp)
    consumers = consumer_map(full)
    for path, nodes, _ in segments(full):
        model, rules, pick, _ = segment_model(full, nodes, consumers, tp)
        model.Minimize(sum(xs[0] for name, xs in pick.items() if len(xs) > 1))
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        status = solver.Solve(model)
        assert status == cp_model.OPTIMAL, f"TP proof layout: {solver.StatusName(status)}"
        chosen = {name: rs[k] for name, rs in rules.items() for k in range(len(rs)) if solver.Value(pick[name][k])}
        layout.rules |= chosen
        layout.allowed |= rules
        layout.dims |= shard_dims(full, nodes, tp)
        _record_styles(full, layout.choice, nodes, chosen, path)
    return layout


def representatives(full: OpGraph) -> dict[str, str]:
    """Node of a repeated block -> the same node of its block's representative."""
    by_path = {b.path: b for b in full.blocks}
    out = {}
    for block in full.blocks:
        rep = by_path[block.representative]
        out |= dict(zip(block.node_names, rep.node_names))
    return out


def unexercised(full: OpGraph, tp: int, layout: Layout) -> dict[str, str]:
    """Step 4: shard rules of non-linear ops that the widest layout left unused."""
    out = {}
    linear_modules = {n.module_path for n in full.nodes if op_name(n.target) in LINEAR_OPS}
    for name, rules in layout.allowed.items():
        node = full.node(name)
        if not any(r.kind == "shard" for r in rules) or layout.rules[name].kind == "shard":
            continue
        if node.module_path in linear_modules:  # a styled module's own ops run on DTensors, not checked here
            continue
        out[name] = f"{UNEXERCISED} {op_name(node.target)} in {node.module_path or 'the root'} at tp={tp}; replicated"
    return out


# ---------------------------------------------------------------------------- the local program


def local_failures(model_file: ModelFile, captured: OpGraph, full: OpGraph, layout: Layout,
                   tp: int) -> dict[str, str]:
    """Steps 2-3: representative nodes whose code gives another shape on shards, with reasons."""
    model = build_on_meta(model_file)
    if captured.fold is not None:
        fold_model(model)
    stand_in_shards(model, layout.choice.styles, tp)
    inputs = tuple(t.to("meta") for t in model_file.example_batch(captured.batch_size)[0])
    stack: list[str] = []
    with _module_stack(model, stack):
        try:
            program = export_module(model, inputs, model_file.spec)
        except Exception as exc:  # the code cannot run on shards at all: refuse where it stopped
            return _refuse_module(full, layout, stack[-1] if stack else "", tp, exc)
    local = [n for n in program.graph.nodes if n.op == "call_function"]
    return compare_shapes(captured, full, layout, local, tp)


def stand_in_shards(model: nn.Module, styles: dict[str, str], tp: int) -> None:
    """Each styled module replaced (in place) by a ``_ShardStandIn`` giving its tp-rank output shape.

    A styled module runs its own code on DTensors (global shapes, DTensor's own sharding rules), so it
    is not what is checked here; what is checked is the code *between* styled modules, which runs on
    plain local tensors."""
    for path, style in styles.items():
        if style not in STAND_IN_OUT:
            continue
        try:
            module = model.get_submodule(path)
        except AttributeError:  # a layer that folding removed
            continue
        features = module.weight.shape[STAND_IN_OUT[style][0]]
        parent, _, child = path.rpartition(".")
        local = features // tp if STAND_IN_OUT[style][1] else features
        (model.get_submodule(parent) if parent else model).register_module(child, _ShardStandIn(local, style))


STAND_IN_OUT = {  # style -> (weight dim of the output features, whether the output is a shard)
    "colwise": (0, True), "colwise-gather": (0, False), "rowwise": (0, False),
    "conv1d-colwise": (1, True), "conv1d-rowwise": (1, False), "vocab-parallel-embedding": (1, False),
}


class _ShardStandIn(nn.Module):
    """Output of one tp rank's styled module: (*x.shape[:-1], features), or (*ids.shape, features) for an
    embedding."""

    def __init__(self, features: int, style: str):
        super().__init__()
        self.features, self.embedding = features, style == "vocab-parallel-embedding"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = tuple(x.shape) if self.embedding else tuple(x.shape[:-1])
        dtype = torch.get_default_dtype() if self.embedding else x.dtype
        return torch.zeros(*lead, self.features, dtype=dtype, device=x.device)


def compare_shapes(captured: OpGraph, full: OpGraph, layout: Layout, local: list, tp: int) -> dict[str, str]:
    """Step 3 on the two exports' nodes, in order, outside the styled modules (their stand-ins give the
    expected shape by construction, so their outputs count as matched)."""
    styled = {p for p, s in layout.choice.styles.items() if s in STAND_IN_OUT}
    ours = [n for n in captured.nodes if not _inside(n.module_path, styled)]
    matched = {n.name for n in captured.nodes if _inside(n.module_path, styled)}
    theirs = [n for n in local if not _inside(_module_of(n)[0], styled)]
    failures: dict[str, str] = {}
    for i, node in enumerate(ours):
        if i >= len(theirs) or node.target != target_name(theirs[i].target):
            return _refusal(full, layout, node, tp, "runs other ops on a shard than on the whole model") | failures
        expected, actual = expected_shape(node, layout, tp), _shape(theirs[i])
        if expected == actual:
            matched.add(node.name)
        elif all(x in matched or x not in captured._by_name() for x in node.inputs):
            why = f"gives shape {list(actual)} on a shard where the layout needs {list(expected)} (a size written as a constant?)"
            failures = _refusal(full, layout, node, tp, why) | failures  # a block's first failure names it
    return failures


def _inside(path: str, modules: set[str]) -> bool:
    return any(path == m or path.startswith(m + ".") for m in modules)


def expected_shape(node: OpNode, layout: Layout, tp: int) -> tuple[int, ...]:
    """The captured shape with s(n) divided by tp where the layout shards n (a gathered col keeps it whole)."""
    shape = list(node.shape)
    dim = layout.dim(node.name)
    gathered = layout.choice.styles.get(node.module_path) == "colwise-gather"
    if layout.output(node.name) == S and dim is not None and not gathered:
        shape[dim] //= tp
    return tuple(shape)


def _shape(fx_node) -> tuple[int, ...]:
    val = fx_node.meta.get("val")
    first = next((t for t in torch.utils._pytree.tree_leaves(val) if isinstance(t, torch.Tensor)), None)
    return tuple(int(d) for d in first.shape) if first is not None else ()


def _refusal(full: OpGraph, layout: Layout, node: OpNode, tp: int, what: str) -> dict[str, str]:
    """{representative node: reason}, named after the representative (the node the search decides)."""
    rep = layout.rep_of.get(node.name, node.name)
    where = full.node(rep).module_path or "the root"
    return {rep: f"{op_name(node.target)} in {where} {what} at tp={tp}; its input stays replicated"}


def _refuse_module(full: OpGraph, layout: Layout, module: str, tp: int, exc: BaseException) -> dict[str, str]:
    """Every op that could run on shards inside ``module`` (all of them when no module was running)."""
    root = exc.__cause__ or exc
    first = (str(root).strip().splitlines() or [""])[0][:120]
    where = _user_location(root)
    why = (f"the model's code fails on a tp={tp} shard in {module or 'the root'} ({type(root).__name__}: {first}"
           f"{' at ' + where if where else ''}); replicated")
    inside = [n for n in full.nodes if not module or n.module_path == module or n.module_path.startswith(module + ".")]
    out = {layout.rep_of.get(n.name, n.name): why for n in inside
           if _can_shard(layout.allowed.get(layout.rep_of.get(n.name, n.name), ()))}
    if not out:  # the failure is outside every op that can shard: nothing can be trusted at this degree
        out = {name: why for name, rules in layout.allowed.items() if _can_shard(rules)}
    return out


def _can_shard(rules) -> bool:
    return any(r.kind != "rep" for r in rules)


class _module_stack:
    """Within the block, ``stack`` holds the paths of the modules whose forward is running."""

    def __init__(self, model: nn.Module, stack: list[str]):
        self.model, self.stack, self.handles = model, stack, []

    def __enter__(self):
        for path, module in self.model.named_modules():
            self.handles.append(module.register_forward_pre_hook(partial(self._enter, path)))
            self.handles.append(module.register_forward_hook(self._leave))
        return self

    def _enter(self, path: str, module, args) -> None:
        self.stack.append(path)

    def _leave(self, module, args, output) -> None:  # None: the output is kept as it is
        self.stack.pop()

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
