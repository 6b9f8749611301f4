"""TP proof: a sharded layout is accepted only where the model's own code computes it on a shard.

``passes.layouts.rules`` propagates a sharded dim through the captured graph, whose sizes are
constants. The program does not run that graph: it runs the model's Python code on each rank's
local shards (``use_local_output=True``), and that code may have written a size as a constant
(OPT's ``q.view(bsz, -1, num_heads, head_dim)`` keeps all heads and folds the shard into the
sequence, silently) or read it from the tensor (Llama's ``view(*input_shape, -1, head_dim)``).
The graph alone cannot tell the two apart; running the code on shard-shaped tensors can.

For each degree t in 2..8 (``PROOF_DEGREES``) that divides the model's heads (``prove_degree``), or only those a
plan's cluster offers (``PlanRequest.tp_degrees``: t divides the devices per node; a degree a cached graph lacks
is proved when a later plan needs it and added to the cache entry, ``passes.capturing.front.capture_front``):

1. **The widest layout** (``widest_layout``): the layout model of ``passes.layouts.segment_model`` per
   segment with the objective min Σ_n x[n, rep] over nodes that have another rule, i.e. as many
   ops as possible on shards, without the nodes refused so far.
2. **The local program** (``local_failures``): the model built on meta as capture builds it (folded
   likewise), every styled module (col, row, vocab-parallel) given a stand-in forward that returns
   one tp rank's output shape (a col shard of the features, or the whole output where the style
   gathers or all-reduces), exported on the capture batch. A styled module runs its own code on
   DTensors at run time; the code between them runs on plain local tensors, and that is what is
   checked. Under the layout, node n should give its captured shape with dim s(n) divided by t
   where L(n) = S, and its captured shape elsewhere. The stood-in module keeps everything else, as
   ``parallelize_module`` does (its attributes, ``num_embeddings`` or ``in_features`` whole, its type and
   methods; its parameters are DTensors of the whole shape there, meta tensors of the whole shape here),
   and what the model's code does with those parameters outside the module is watched (``ParamWatch``):

       .device, .dtype, .requires_grad, .ndim, ...     the same on every rank and in both runtimes: allowed
       .shape, .size(), .numel(), ...                  the whole weight's under DTensor, one rank's slice
                                                       inside pipeline stages (local shards): refused
       an op on it (``F.linear(x, self.proj.weight)``,   a DTensor meeting the code's plain tensors, or one
       ``self.table.weight[:T]``) whose result is used   rank's slice taken for the whole: refused (an op whose
                                                       result is dropped, e.g. by a fused-kernel wrapper that
                                                       returns None without its kernel, is not)

   A refusal refuses the module's own op (so it stays replicated) and names the model's file:line and
   what it read (``_refuse_param_reads``); the round ends there.
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

**Loss parallelism** (``prove_loss_parallel``, ``OpGraph.loss_parallel_proof``): the loss computed on the
output projection's vocabulary shards is the one-process loss where the model's output is the projection's
logits after elementwise ops only (each on a shard is its own slice of the whole), and the loss is the model
file's default cross-entropy on them (torch's ``loss_parallel`` computes that exactly: the max, Σ exp and the
target logit reduced over the shards). At run time the loss must come back a DTensor (``runtime.train_step``
``local_loss``): a loss that never read the sharded logits is refused there.

**Sequence parallelism** (``prove_sequence_parallel``, ``OpGraph.tp_proofs[f"{t}sp"]``): the same steps
on the widest layout with the Q layouts of ``passes.layouts.sequence`` (the residual stream sharded over
the sequence where the boundary fixed point allows it). It starts from degree t's refusals, kept for the
rules that touch S or P only (``node:kind`` entries: the Q rules are what this run checks). The local
program also stands in for the sequence-parallel styles of linears (a gather multiplies the sequence
dim of the module's output by t, a reduce-scatter or a slice divides it), and where a style's hook
changes a module's input it runs the same change (``_ScatterHook``: a block's first positional input
sliced; ``_GatherHook``: a module's first tensor argument gathered; custom ops the comparison skips);
a node with L(n)=Q should give its shape with q(n) divided by t. A refusal names a rule (``node:kind``):

    a node whose shape is wrong, its inputs right:     its own Q rule; if it has none (e.g.
                                                         ``arange(x.shape[1])`` reading the size of a
                                                         sequence shard), the nearest split or gather of
                                                         the tokens before it in graph order
    an export that raises (``_refuse_raised``):         the first module call that saw a wrong shape
                                                         decides: entered with a wrong input, the rule
                                                         of that input's producer as above; returned a
                                                         wrong output, its gathers, else its splits, else
                                                         the nearest one before it; none, the running
                                                         module (``_refuse_module_seq``)
    nothing to blame                                     sequence parallelism at that degree

Step 4 refuses every Q rule (and every block scatter) the final widest layout did not use: a Q rule is
a module hook or a per-token op whose neighbours' sizes the code may read, so only what ran is trusted.
A widest layout without any Q, or ``MAX_ROUNDS`` failed rounds, refuse sequence parallelism at that
degree (``passes.layouts.allowed.SP_REFUSED``).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from functools import partial

import torch
import torch.nn as nn
from ortools.sat.python import cp_model

from autoshard.ir.decisions import TPChoice
from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.names import op_name
from autoshard.modelfile import ModelFile
from autoshard.passes.capturing.blocks import find_blocks
from autoshard.passes.capturing.capture import (
    build_on_meta,
    export_module,
    module_of,
    target_name,
    user_location,
)
from autoshard.passes.capturing.fold import fold_model, unfold
from autoshard.passes.capturing.tp_stand_ins import (
    SCATTER_INPUT,
    SEQ_HOOKS,
    STAND_INS,
    ParamWatch,
    is_proof_hook,
    live_param_uses,
    stand_in_shards,
)
from autoshard.passes.forked import Forked
from autoshard.passes.layouts.allowed import (
    PROOF_DEGREES,
    SP_REFUSED,
    UNEXERCISED_PREFIX,
    check_divisibility,
    proof_key,
)
from autoshard.passes.layouts.boundary import representatives, sp_boundary
from autoshard.passes.layouts.loss import output_projection
from autoshard.passes.layouts.rules import (
    EMBEDDING_OPS,
    LINEAR_OPS,
    SEQ_GATHER_KINDS,
    SEQ_SOURCE_KINDS,
    SINK_OPS,
    Q,
    R,
    S,
    consumer_map,
    segments,
    shard_dims,
    uses_seq,
)
from autoshard.passes.layouts.segment_model import segment_model
from autoshard.passes.layouts.sequence import module_gathers, seq_dims
from autoshard.passes.layouts.styles import default_styles, record_styles

UNEXERCISED = UNEXERCISED_PREFIX + " of the model's code:"
MAX_ROUNDS = 6


def prove_tensor_parallel(
    model_file: ModelFile, graph: OpGraph, degrees=PROOF_DEGREES, parallel: bool = False
) -> OpGraph:
    """``graph`` (captured, annotated, maybe folded) with ``tp_proofs`` for each of ``degrees`` it can take (every
    degree by default; a plan proves the ones its cluster offers, ``unproven_degrees``), with and without
    sequence parallelism, beside those it already has. Each degree's proof is its own: the order and the
    other degrees proved change none of them, so with ``parallel`` the degrees after the first are proved in
    forked children meanwhile (``_each_degree``)."""
    full = find_blocks(unfold(replace(graph, blocks=[])))
    proofs = dict(graph.tp_proofs or {})
    todo = [tp for tp in degrees if tp in PROOF_DEGREES and not check_divisibility(full, tp)]
    for tp, (base, seq) in zip(todo, _each_degree(model_file, graph, full, todo, parallel)):
        proofs[proof_key(tp)], proofs[proof_key(tp, True)] = base, seq
    graph.tp_proofs = dict(sorted(proofs.items(), key=lambda kv: _proof_order(kv[0])))
    if graph.loss_parallel_proof is None:
        graph.loss_parallel_proof = prove_loss_parallel(model_file, graph)
    return graph


def prove_loss_parallel(model_file: ModelFile, graph: OpGraph) -> str:
    """Why the loss is not shown to be cross-entropy on the output projection's logits through elementwise ops
    only ("" where it is; ``OpGraph.loss_parallel_proof``, module doc "Loss parallelism"): the graph's output
    is the logits (``passes.layouts.loss.output_projection``), the model file keeps the default loss, and its
    targets are integer classes with one dimension fewer than the logits (``modelfile.default_loss`` then takes
    ``F.cross_entropy``, which torch's ``loss_parallel`` computes on vocabulary shards)."""
    _, why = output_projection(graph)
    if why:
        return why
    if getattr(model_file.module, "loss_fn", None) is not None:
        return "the model file's own loss_fn is not shown to be the default cross-entropy on the logits"
    try:
        _, targets = model_file.example_batch(graph.batch_size)  # the batch size capture drew
    except Exception as exc:  # noqa: BLE001 (a draw that fails here refuses loss parallelism only)
        return f"the example batch could not be drawn again to check the targets ({type(exc).__name__})"
    if not isinstance(targets, torch.Tensor) or targets.dtype.is_floating_point:
        return "the targets are not integer classes: the default loss is not cross-entropy"
    if targets.dim() + 1 != len(graph.nodes[-1].shape):
        return "the targets do not have one dimension fewer than the logits: the default loss is not cross-entropy"
    return ""


def prove_both(model_file: ModelFile, captured: OpGraph, full: OpGraph, tp: int) -> tuple[dict, dict]:
    """Degree tp's refusals without and with sequence parallelism (the second starts from the first)."""
    base = prove_degree(model_file, captured, full, tp)
    return base, prove_sequence_parallel(model_file, captured, full, tp, base)


def _each_degree(
    model_file: ModelFile, captured: OpGraph, full: OpGraph, degrees: list[int], parallel: bool
) -> list[tuple[dict, dict]]:
    """``prove_both`` of each degree, in order. With ``parallel`` (a process that may fork: the capture's own
    child, ``passes.capturing.front``) every degree after the first is proved in a forked child while this
    process proves the first: each proof is an export of the model on meta, one core each (a 2-core machine
    proves tp 2, 4 and 8 in about half the time). A child that fails or dies answers nothing and its degree is
    proved again here, so an error is raised as in one process."""
    if not parallel or len(degrees) < 2 or threading.active_count() > 1:  # forking a threaded process is unsafe
        return [prove_both(model_file, captured, full, tp) for tp in degrees]
    children: dict[int, Forked | None] = {}
    try:
        for tp in degrees[1:]:
            children[tp] = Forked.start(partial(prove_both, model_file, captured, full, tp))
        results = [prove_both(model_file, captured, full, degrees[0])]
        for tp in degrees[1:]:  # one not forked (memory, process limits), failed or dead: proved here
            answer = children[tp].result() if children[tp] is not None else None
            results.append(answer if answer is not None else prove_both(model_file, captured, full, tp))
    finally:
        for child in children.values():
            if child is not None:
                child.stop()
    return results


def _proof_order(key: str) -> tuple[int, bool]:
    """Degrees ascending, each without then with sequence parallelism (the order a whole proof writes)."""
    return int(key.removesuffix("sp")), key.endswith("sp")


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
    return {
        n.name: f"tp={tp}: the model's code did not match a sharded layout after {MAX_ROUNDS} attempts; replicated"
        for n in full.nodes
    }


def prove_sequence_parallel(
    model_file: ModelFile, captured: OpGraph, full: OpGraph, tp: int, base: dict[str, str]
) -> dict[str, str]:
    """Rules refused at degree tp with sequence parallelism (module doc, "Sequence parallelism")."""
    if full.tokens_per_sample <= 1:
        return {SP_REFUSED: "not a token model (tokens_per_sample = 1): no sequence to shard"}
    refused = {f"{name}:{kind}": why for name, why in base.items() for kind in S_KINDS}
    for _ in range(MAX_ROUNDS):
        full.tp_proofs = {proof_key(tp, True): dict(refused)}
        layout = widest_layout(full, tp, sp=True)
        if not layout.runs_seq:
            return refused | {SP_REFUSED: f"tp={tp}: no value of the model can be sharded over its sequence"}
        failures = local_failures(model_file, captured, full, layout, tp)
        if not failures:
            return refused | unexercised(full, tp, layout)
        refused |= failures
        if SP_REFUSED in failures:
            return refused
    return refused | {
        SP_REFUSED: f"tp={tp}: the model's code did not match a sequence-parallel layout after {MAX_ROUNDS} attempts"
    }


S_KINDS = ("col", "row", "vocab", "shard", "colq", "rowq")  # rules that make, read or reduce S: degree t's verdict


class Layout:
    """The widest layout: per representative node its rule, per module its style, per node its s(n) and q(n)."""

    def __init__(self, full: OpGraph, tp: int, sp: bool = False):
        self.rules: dict = {}
        self.allowed: dict = {}
        self.dims: dict = {}
        self.choice = TPChoice(tp, *default_styles(full))
        self.rep_of = representatives(full)
        self.sp = sp
        self.qdims = seq_dims(full) if sp else {}
        self.scatters: dict = {}  # rest value -> (block, seq dim) sliced at that block's input
        self.boundary = None

    def output(self, name: str) -> str:
        rule = self.rules.get(self.rep_of.get(name, name))
        return rule.output if rule is not None else R

    def dim(self, name: str) -> int | None:
        return self.dims.get(self.rep_of.get(name, name))

    def qdim(self, name: str) -> int | None:
        return self.qdims.get(self.rep_of.get(name, name))

    @property
    def runs_seq(self) -> bool:
        return bool(self.scatters) or any(uses_seq(r) for r in self.rules.values())


def widest_layout(full: OpGraph, tp: int, sp: bool = False) -> Layout:
    """Step 1: per segment, as many ops on shards as the (refusal-filtered) rules allow; with ``sp`` on the
    sequence-parallel boundary (``passes.layouts.boundary.sp_boundary``), preferring any rule to a replicated one."""
    layout = Layout(full, tp, sp)
    consumers = consumer_map(full)
    layout.boundary = boundary = sp_boundary(full, tp) if sp else None
    for path, nodes, _ in segments(full):
        built = segment_model(full, nodes, consumers, tp, boundary)
        model, rules, pick = built.model, built.rules, built.pick
        if sp:  # replicated rules cost 4; a linear's own gather 1 where its module may gather once instead
            model.Minimize(
                sum(
                    _widest_weight(full, n, r) * x
                    for n in nodes
                    if len(pick[n.name]) > 1 and op_name(n.target) not in SINK_OPS
                    for x, r in zip(pick[n.name], rules[n.name])
                )
            )
        else:
            model.Minimize(sum(xs[0] for name, xs in pick.items() if len(xs) > 1))
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        status = solver.Solve(model)
        assert status == cp_model.OPTIMAL, f"TP proof layout: {solver.StatusName(status)}"
        chosen = {name: rs[k] for name, rs in rules.items() for k in range(len(rs)) if solver.Value(pick[name][k])}
        scatters = {v: boundary.scatter[v] for v, t in built.scatters.items() if solver.Value(t)}
        layout.rules |= chosen
        layout.allowed |= rules
        layout.dims |= shard_dims(full, nodes, tp)
        layout.scatters |= scatters
        record_styles(full, layout.choice, nodes, chosen, path, sp, scatters)
    return layout


REPLICATED_KINDS = frozenset({"rep", "repg", "reps"})  # compute on whole tensors


def _widest_weight(full: OpGraph, node: OpNode, rule) -> int:
    """The sequence-parallel widest layout's price of a rule: replicated 4; a per-linear gather 1 where the module
    above may gather once (``module_gathers``: one collective, and the module's code reads whole shapes); 0."""
    if rule.kind in REPLICATED_KINDS:
        return 4
    return 1 if rule.kind == "colq" and node.name in module_gathers(full) else 0


def unexercised(full: OpGraph, tp: int, layout: Layout) -> dict[str, str]:
    """Step 4: shard rules of non-linear ops that the widest layout left unused; with sequence parallelism
    every unused Q rule and block scatter instead (module doc)."""
    if layout.sp:
        return _unexercised_seq(full, tp, layout)
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


def _unexercised_seq(full: OpGraph, tp: int, layout: Layout) -> dict[str, str]:
    out = {}
    for name, rules in layout.allowed.items():
        node, chosen = full.node(name), layout.rules[name]
        for rule in rules:
            if uses_seq(rule) and rule.kind != chosen.kind:
                where = node.module_path or "the root"
                out[f"{name}:{rule.kind}"] = (
                    f"{UNEXERCISED} {op_name(node.target)} in {where} by its {rule.kind} "
                    f"rule (sequence parallel) at tp={tp}"
                )
    for value in layout.boundary.scatter if layout.boundary is not None else {}:
        if value not in layout.scatters:
            out[f"{value}:scatter"] = f"{UNEXERCISED} {value} sliced at its block's input at tp={tp}"
    return out


# ---------------------------------------------------------------------------- the local program


def local_failures(model_file: ModelFile, captured: OpGraph, full: OpGraph, layout: Layout, tp: int) -> dict[str, str]:
    """Steps 2-3: representative nodes whose code gives another shape on shards, with reasons."""
    model = build_on_meta(model_file)
    if captured.fold is not None:
        fold_model(model)
    watch = ParamWatch(stand_in_shards(model, layout.choice.styles, tp))
    watch.around_forward(model)
    inputs = tuple(t.to("meta") for t in model_file.example_batch(captured.batch_size)[0])
    stack: list[str] = []
    events: list[tuple[str, str, tuple[int, ...]]] = []
    with _module_stack(model, stack, events):
        try:
            program = export_module(model, inputs, model_file.spec)
        except Exception as exc:  # the code cannot run on shards at all: refuse where it stopped
            return _refuse_param_reads(full, layout, watch.reads, tp) or _refuse_raised(
                captured, full, layout, stack[-1] if stack else "", events, tp, exc
            )
    misused = _refuse_param_reads(full, layout, watch.reads, tp, live_param_uses(program, watch.params))
    if misused:  # the shapes after such a read say nothing more: check again without those modules' shards
        return misused
    local = [n for n in program.graph.nodes if n.op == "call_function" and not is_proof_hook(n)]
    return compare_shapes(captured, full, layout, local, tp)


def _refuse_raised(
    captured: OpGraph, full: OpGraph, layout: Layout, running: str, events: list, tp: int, exc: BaseException
) -> dict[str, str]:
    """The export raised in module ``running``. Without sequence parallelism: that module's shardable ops. With
    it, the first module call of the run that already saw a wrong shape places the blame (``_first_wrong``): a
    module entered with a wrong input blames that input's producer (``_seq_refusal``), a module that returned a
    wrong output its own splits and gathers; else the running module (``_refuse_module_seq``)."""
    if not layout.sp:
        return _refuse_module(full, layout, running, tp, exc)
    kind, path, producer = _first_wrong(captured, layout, events, tp)
    if kind == "enter":
        rep = layout.rep_of.get(producer, producer)
        return _seq_refusal(
            full,
            layout,
            rep,
            f"{_raised(exc, path, tp)} (its input {producer} has another shape than the layout needs)",
        )
    if kind == "leave":
        return _refuse_module(full, layout, path, tp, exc, located=True)
    finished = [p for k, p, _ in events if k == "leave"]
    return _refuse_module(full, layout, running, tp, exc, point=_last_finished_inside(running, finished))


def _first_wrong(captured: OpGraph, layout: Layout, events: list, tp: int) -> tuple[str, str, str]:
    """("enter", module, producer of its input) or ("leave", module, "") for the first module call whose input
    (as it arrived, before the style hooks) or output (stand-ins left out) has no shape the layout expects;
    ("", "", "") if none."""
    styled = {p for p, s in layout.choice.styles.items() if s in STAND_INS}
    readers, by_name = consumer_map(captured), captured._by_name()
    for kind, path, shape in events:
        if not path or (kind == "leave" and _inside(path, styled)):
            continue
        members = _members(captured, path)
        names = {n.name for n in members}
        if kind == "enter":
            outer = [x for x in dict.fromkeys(x for n in members for x in n.inputs) if x in by_name and x not in names]
            expected = {_arriving_shape(by_name[x], path, layout, tp) for x in outer}
            if outer and shape not in expected:
                return kind, path, outer[0]
        else:
            out = {
                expected_shape(n, layout, tp)
                for n in members
                if n.shape and (not readers.get(n.name) or any(r not in names for r in readers[n.name]))
            }
            if out and shape not in out:
                return kind, path, ""
    return "", "", ""


def _arriving_shape(producer: OpNode, path: str, layout: Layout, tp: int) -> tuple[int, ...]:
    """The shape ``producer``'s value has when it reaches module ``path``: its layout's, changed by the hooks of
    the modules around ``path`` that it enters (a block's scatter divides the tokens, a module's gather
    multiplies them); ``path``'s own hooks run after the recording one."""
    shape = list(expected_shape(producer, layout, tp))
    parts = path.split(".")
    for k in range(1, len(parts)):
        outer = ".".join(parts[:k])
        style = layout.choice.styles.get(outer, "")
        if _inside(producer.module_path, {outer}) or not style.startswith(SEQ_HOOKS):
            continue
        d = int(style.rsplit("dim", 1)[1])
        if d < len(shape):
            shape[d] = shape[d] // tp if style.startswith(SCATTER_INPUT) else shape[d] * tp
    return tuple(shape)


def _members(captured: OpGraph, path: str) -> list[OpNode]:
    by_module = captured.derived("tp_proof_members", lambda: {})
    if path not in by_module:
        by_module[path] = [n for n in captured.nodes if _inside(n.module_path, {path})]
    return by_module[path]


def _raised(exc: BaseException, module: str, tp: int) -> str:
    root = exc.__cause__ or exc
    first = (str(root).strip().splitlines() or [""])[0][:120]
    return f"the model's code fails on a tp={tp} shard in {module or 'the root'} ({type(root).__name__}: {first})"


def _last_finished_inside(module: str, finished: list[str]) -> str:
    """The last submodule of ``module`` that returned before the export raised ("" if none)."""
    inner = [path for path in finished if path != module and (not module or _inside(path, {module}))]
    return inner[-1] if inner else ""


def _refuse_param_reads(
    full: OpGraph, layout: Layout, reads: list, tp: int, live: dict[str, set[str]] | None = None
) -> dict[str, str]:
    """{the module's own op (its representative): reason} for each stood-in module whose parameter the model's
    code read outside it in a way the shard does not support: its size (the whole tensor's under DTensor, one
    rank's slice inside pipeline stages), or a computation (at run time a DTensor meeting the code's plain
    tensors, or one rank's slice taken for the whole weight) whose result the program uses (``live``: those
    parameters and the ops that use them; None when the export raised, when every computation counts). The
    reason names the first size read, else the call that made a live op (by its name), else the first call."""

    def rank(read) -> int:
        param, what, kind, _ = read
        return 0 if kind == "size" else 1 if live and what in live.get(param, ()) else 2

    out: dict[str, str] = {}
    for param, what, kind, where in sorted(reads, key=rank):
        if kind == "compute" and live is not None and param not in live:
            continue
        module = param.rpartition(".")[0]
        if kind == "size":
            why = (
                f"{where} reads {param}.{what} outside {module}, which tp={tp} shards: its size is the whole "
                f"weight's under DTensor but one rank's slice inside pipeline stages; replicated"
            )
        else:
            why = (
                f"{where} computes {what} on {param} outside {module}, which tp={tp} shards: only the module's "
                f"own forward runs on the shard (elsewhere a DTensor would meet plain tensors); replicated"
            )
        for n in full.nodes:
            if n.module_path == module and op_name(n.target) in LINEAR_OPS | EMBEDDING_OPS:
                out.setdefault(layout.rep_of.get(n.name, n.name), why)
    return out


def compare_shapes(captured: OpGraph, full: OpGraph, layout: Layout, local: list, tp: int) -> dict[str, str]:
    """Step 3 on the two exports' nodes, in order, outside the styled modules (their stand-ins give the
    expected shape by construction, so their outputs count as matched)."""
    styled = {p for p, s in layout.choice.styles.items() if s in STAND_INS}
    ours = [n for n in captured.nodes if not _inside(n.module_path, styled)]
    matched = {n.name for n in captured.nodes if _inside(n.module_path, styled)}
    theirs = [n for n in local if not _inside(module_of(n)[0], styled)]
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
    """The captured shape with s(n) divided by tp where the layout shards n (a gathered col keeps it whole), and
    q(n) divided by tp where it shards n over the sequence."""
    shape = list(node.shape)
    dim, out = layout.dim(node.name), layout.output(node.name)
    gathered = layout.choice.styles.get(node.module_path) == "colwise-gather"
    if out == S and dim is not None and not gathered:
        shape[dim] //= tp
    elif out == Q and layout.qdim(node.name) is not None:
        shape[layout.qdim(node.name)] //= tp
    return tuple(shape)


def _shape(fx_node) -> tuple[int, ...]:
    val = fx_node.meta.get("val")
    first = next((t for t in torch.utils._pytree.tree_leaves(val) if isinstance(t, torch.Tensor)), None)
    return tuple(int(d) for d in first.shape) if first is not None else ()


def _refusal(full: OpGraph, layout: Layout, node: OpNode, tp: int, what: str) -> dict[str, str]:
    """{representative node: reason}, named after the representative (the node the search decides); with
    sequence parallelism {rule: reason} (``_seq_refusal``)."""
    rep = layout.rep_of.get(node.name, node.name)
    where = full.node(rep).module_path or "the root"
    why = f"{op_name(node.target)} in {where} {what} at tp={tp}; its input stays replicated"
    return _seq_refusal(full, layout, rep, why) if layout.sp else {rep: why}


def _seq_refusal(full: OpGraph, layout: Layout, rep: str, why: str) -> dict[str, str]:
    """What a sequence-parallel failure at ``rep`` refuses (module doc table): its own Q rule, else the nearest Q
    source before it, else its own rule, else sequence parallelism."""
    rule = layout.rules.get(rep)
    if rule is not None and uses_seq(rule):
        return {f"{rep}:{rule.kind}": why}
    edge = _nearest_edge(full, layout, rep)
    if edge:
        return {edge: f"{why} (it reads the size of a tensor whose tokens are split or gathered upstream)"}
    if rule is not None and rule.kind != "rep":
        return {f"{rep}:{rule.kind}": why}
    return {SP_REFUSED: why}


def _seq_edges(full: OpGraph, layout: Layout) -> list[tuple[int, str]]:
    """(graph position, ``node:kind`` or ``value:scatter``) of every place the layout splits the tokens
    (a reduce-scatter, a slice, a block's scatter) or gathers them, in graph order."""
    order = _order(full)
    found = [
        (order[name], f"{name}:{rule.kind}")
        for name, rule in layout.rules.items()
        if rule.kind in SEQ_SOURCE_KINDS | SEQ_GATHER_KINDS and name in order
    ]
    found += [(order[v], f"{v}:scatter") for v in layout.scatters if v in order]
    return sorted(found)


def _nearest_edge(full: OpGraph, layout: Layout, rep: str) -> str:
    """The split or gather of the tokens the layout runs closest before ``rep`` ("" if none)."""
    before = _order(full).get(rep, 0)
    found = [key for at, key in _seq_edges(full, layout) if at < before]
    return found[-1] if found else ""


def _order(full: OpGraph) -> dict[str, int]:
    return full.derived("tp_proof_order", lambda: {n.name: i for i, n in enumerate(full.nodes)})


def _refuse_module(
    full: OpGraph, layout: Layout, module: str, tp: int, exc: BaseException, located: bool = False, point: str = ""
) -> dict[str, str]:
    """Every op that could run on shards inside ``module`` (all of them when no module was running); with
    sequence parallelism one split or gather of the tokens (``_refuse_module_seq``)."""
    root = exc.__cause__ or exc
    first = (str(root).strip().splitlines() or [""])[0][:120]
    where = user_location(root)
    why = (
        f"the model's code fails on a tp={tp} shard in {module or 'the root'} ({type(root).__name__}: {first}"
        f"{' at ' + where if where else ''}); replicated"
    )
    inside = [n for n in full.nodes if not module or n.module_path == module or n.module_path.startswith(module + ".")]
    if layout.sp:
        return _refuse_module_seq(full, layout, inside, why, located, point)
    out = {
        layout.rep_of.get(n.name, n.name): why
        for n in inside
        if _can_shard(layout.allowed.get(layout.rep_of.get(n.name, n.name), ()))
    }
    if not out:  # the failure is outside every op that can shard: nothing can be trusted at this degree
        out = {name: why for name, rules in layout.allowed.items() if _can_shard(rules)}
    return out


def _refuse_module_seq(
    full: OpGraph, layout: Layout, inside: list[OpNode], why: str, located: bool, point: str
) -> dict[str, str]:
    """The export raised (module doc, "Sequence parallelism"), in the order tried:

    located (a finished module's output was already wrong; ``inside`` its nodes): its gathers of the tokens
        (its code read a size on the split side and used it on the gathered one), else its splits, else the
        nearest split or gather before it;
    else (``inside`` the raising module, ``point`` its last submodule that returned): the per-token rules of
        its own code after that point (the ops running when it raised), else its gathers before the point,
        else its nearest split before the point, else the nearest split or gather before the module.
    Nothing to blame: sequence parallelism is refused."""
    order, reps = _order(full), [layout.rep_of.get(n.name, n.name) for n in inside]
    if not reps:
        return {SP_REFUSED: why}
    start = min(order.get(r, 0) for r in reps)
    stop = max(
        (
            order.get(layout.rep_of.get(n.name, n.name), 0)
            for n in full.nodes
            if point and _inside(n.module_path, {point})
        ),
        default=start - 1,
    )
    names = set(reps)
    edges = [(at, key) for at, key in _seq_edges(full, layout) if key.split(":")[0] in names]
    gathers = [key for at, key in edges if key.split(":")[1] in SEQ_GATHER_KINDS and (located or at <= stop)]
    splits = [key for at, key in edges if key.split(":")[1] not in SEQ_GATHER_KINDS and (located or at <= stop)]
    styled = {p for p, s in layout.choice.styles.items() if s in STAND_INS}
    running = [
        f"{r}:seq"
        for r in dict.fromkeys(reps)
        if order.get(r, 0) > stop
        and layout.rules.get(r) is not None
        and layout.rules[r].kind == "seq"
        and not _inside(full.node(r).module_path, styled)
    ]
    upstream = _nearest_edge(full, layout, min(reps, key=lambda r: order.get(r, 0)))
    tries = [gathers, splits[:1], [upstream]] if located else [running, gathers, splits[-1:], [upstream]]
    pick = next((keys for keys in tries if any(keys)), [])
    note = " (a split or gather of the tokens there: sequence parallel)"
    return {key: why + note for key in pick if key} or {SP_REFUSED: why}


def _can_shard(rules) -> bool:
    return any(r.kind != "rep" for r in rules)


class _module_stack:
    """Within the block, ``stack`` holds the paths of the modules whose forward is running, and ``events`` each
    call's ("enter", path, shape of its first tensor argument as it arrived, before other pre-hooks) and
    ("leave", path, shape of the first tensor of its output), in the order they happened."""

    def __init__(self, model: nn.Module, stack: list[str], events: list | None = None):
        self.model, self.stack, self.handles = model, stack, []
        self.events = events if events is not None else []

    def __enter__(self):
        for path, module in self.model.named_modules():
            self.handles.append(
                module.register_forward_pre_hook(partial(self._enter, path), prepend=True, with_kwargs=True)
            )
            self.handles.append(module.register_forward_hook(self._leave))
        return self

    def _enter(self, path: str, module, args, kwargs) -> None:
        self.stack.append(path)
        self._record("enter", path, (args, kwargs))

    def _leave(self, module, args, output) -> None:  # None: the output is kept as it is
        self._record("leave", self.stack.pop(), output)

    def _record(self, kind: str, path: str, value) -> None:
        first = next((t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)), None)
        if first is not None:
            self.events.append((kind, path, tuple(int(d) for d in first.shape)))

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
