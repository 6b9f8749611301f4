"""Pricing a tensor-parallel layout handed to the cost model: the share of each unit a TP rank keeps.

With tp > 1 the op graph's layout (``ir.decisions.TPChoice``, solved for micro-batch b by the
passes and handed to ``CostTables.add_tp_layout``) runs some ops on shards: linears and
embeddings of a sharded style, and every op between a column-parallel linear and the
row-parallel one that reduces its output (``sharded_nodes``); norms, residual adds, dropouts on
the residual stream stay replicated, as in Megatron-LM without sequence parallelism. Per unit u
(``cost.units``)::

    f(u) = Σ_{n∈u} s(n)·t(n) / Σ_{n∈u} t(n),   s(n) = 1/tp on shards, 1 replicated   (``unit_tp_fractions``)
    c_tp = Σ_u f(u)·c(u)            (selective recompute: its rerun ops' own share)

T_tp is that layout's TP collectives per micro-batch (forward all-reduces of row-parallel
outputs, backward all-reduces of column-parallel input gradients), all exposed: they sit
between dependent matmuls. Full recompute runs the forward again, so T_tp ×
``FULL_RECOMPUTE_TP_COMM`` (the forward half of Megatron's four per layer); "alternate" (torchtitan's op-level
policy, which keeps only the reduce-scatters) the same without sequence parallelism, and with it T_tp ×
``ALTERNATE_SEQUENCE_TP_COMM`` (the two forward all-gathers of eight per layer: ``recompute_tp_comm``).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.cost.eager import MATMUL_2D_TARGETS
from autoshard.cost.memory import COMPUTE_HEAVY_TARGETS
from autoshard.cost.saved import MATMUL_OPS, WHOLE, RankShare, storage_of
from autoshard.cost.units import node_units
from autoshard.ir.decisions import SHARD_OUTPUT_STYLES, SHARDING_STYLES, TP_STYLES, TPChoice
from autoshard.ir.graph import OpGraph
from autoshard.ir.names import block_of, op_name

ROW_CONSTRUCTORS = ("RowwiseParallel", "Conv1DRowwiseParallel")  # weights split on the input features
FULL_RECOMPUTE_TP_COMM = 1.5  # full recompute repeats the forward TP all-reduces (half of them)
# "alternate" (torchtitan's op-level policy, ``runtime.selective``) keeps the reduce-scatters only: it repeats the
# forward all-reduces (half of the four per block, as full recompute) or, with sequence parallelism, the two forward
# all-gathers of the eight collectives per block (all-gather, reduce-scatter per region, and their backward twins)
ALTERNATE_SEQUENCE_TP_COMM = 1.25


def tp_activation_fraction(tp: int) -> float:
    """(10 + 24/t)/34: a TP block's activations over the unsharded ones (Korthikanti et al. 2022)."""
    return (10 + 24 / tp) / 34


@dataclass(frozen=True)
class TPCost:
    """A TP layout priced for one micro-batch size (see ``CostTables.tp_cost``)."""

    choice: TPChoice
    unit_fraction: tuple[float, ...]  # share of each unit's forward time left per rank (``unit_tp_fractions``)
    light_fraction: tuple[float, ...]  # the same over its non-matmul ops (what selective recompute reruns)
    comm_s: float  # TP collectives of one micro-batch (forward + backward)
    local_params: int  # parameters per rank: sharded modules' weights / tp
    largest_block_params: int  # the same, of the largest block (the largest FSDP unit)
    matmul_fraction: tuple[float, ...] = ()  # share of each unit's per-rank forward time in 2-D matmuls (async TP)


def price_layout(graph: OpGraph, choice: TPChoice, scale: float, times: list[float]) -> TPCost:
    """``choice`` solved for a micro-batch r = b/b₀ times the captured one, priced there: its
    collectives × r, each unit's shares left per rank (``unit_tp_fractions`` over the ops' forward
    seconds ``times`` at b), parameters per rank in all and of the largest block."""
    tp = choice.tp
    largest = max(graph.blocks, key=lambda b: b.param_count).path if graph.blocks else None
    by_block = local_params_by_block(graph, choice.sharded, tp)
    local = sum(by_block.values())
    block = by_block.get(largest, 0) if largest else local
    fractions = unit_tp_fractions(graph, choice.styles, tp, times)
    matmuls = unit_matmul_fractions(graph, choice.styles, tp, times)
    return TPCost(choice, *fractions, scale * choice.comm_s, local, block, matmuls)


def recompute_tp_comm(mode: str, sequence_parallel: bool) -> float:
    """TP collectives of a micro-batch over those without recompute, every block under ``mode``: full recompute
    repeats the forward ones; "alternate" the forward ones it does not keep (``ALTERNATE_SEQUENCE_TP_COMM``: the
    all-reduces without sequence parallelism, the all-gathers with it); selective keeps every collective."""
    if mode == "full" or (mode == "alternate" and not sequence_parallel):
        return FULL_RECOMPUTE_TP_COMM
    return ALTERNATE_SEQUENCE_TP_COMM if mode == "alternate" else 1.0


def tp_comm_factor(modes: tuple[str, ...], sequence_parallel: bool = False) -> float:
    """TP collectives of a micro-batch over those without recompute: each block's ``recompute_tp_comm`` (for the
    whole model), by the share of such blocks."""
    if not modes:
        return 1.0
    return 1.0 + sum(recompute_tp_comm(m, sequence_parallel) - 1.0 for m in modes) / len(modes)


def sharded_nodes(graph: OpGraph, styles: dict[str, str]) -> frozenset[str]:
    """The ops a TP layout runs on 1/tp of their data (``shard_flow``)."""
    return shard_flow(graph, styles)[0]


def shard_flow(graph: OpGraph, styles: dict[str, str]) -> tuple[frozenset[str], frozenset[str]]:
    """``_shard_flow``, once per set of styles of a graph: the search prices a layout's fractions and each
    rank's share of it many times (``unit_tp_fractions``, ``rank_share``), each a walk of every op."""
    key = ("shard_flow", _interned(frozenset(styles.items())))
    return graph.derived(key, lambda: _shard_flow(graph, styles))


def _shard_flow(graph: OpGraph, styles: dict[str, str]) -> tuple[frozenset[str], frozenset[str]]:
    """The ops a TP layout runs on 1/tp of their data: linears / embeddings of a sharded style, and
    every op reading a sharded (S) value; S values are a colwise linear's output and the outputs of
    ops reading one, up to the rowwise linear that reduces them (the layout model allows S only
    there: ``passes.layouts``). Norms, residual adds and the rest stay replicated.

    With sequence parallelism the tokens are split too: a style that leaves this rank's tokens (a row linear's
    reduce-scatter, a replicated linear's slice) splits its output, a block taking ``scatter-seq-input`` splits
    its input, and the ops reading them run on 1/tp up to a module that gathers the tokens back
    (``gather-seq-input``: its ops run whole).

    Returns (the ops run on 1/tp, the values each rank holds 1/tp of: a sharded op's output but that of
    a linear whose style leaves its output whole: all-reduced, or gathered)."""
    sharded: set[str] = set()
    split_values: set[str] = set()
    gathering = frozenset(p for p, s in styles.items() if s.startswith("gather-seq-input-dim"))
    scattered = _scattered_inputs(graph, styles)
    for node in graph.nodes:
        op = op_name(node.target)
        if op in ("linear", "addmm", "embedding") and node.module_path in styles:
            style = styles[node.module_path]
            if style in SHARDING_STYLES:
                sharded.add(node.name)
            if style in SHARD_OUTPUT_STYLES or (style in TP_STYLES and TP_STYLES[style].leaves_seq_shard):
                split_values.add(node.name)
        elif gathering and not gathering.isdisjoint(module_and_holders(node.module_path)):
            continue
        elif any(name in split_values for name in node.inputs) or (node.name,) in scattered:
            sharded.add(node.name)
            split_values.add(node.name)
    return frozenset(sharded), frozenset(split_values)


def module_and_holders(path: str) -> tuple[str, ...]:
    """``path`` and every module holding it ("a.b.c" -> "a", "a.b", "a.b.c"): p is one of them exactly when
    ``path == p or path.startswith(p + ".")``, so a set of module paths is tested against a node's module in a
    few lookups rather than a prefix test per module."""
    parts = path.split(".")
    return tuple(".".join(parts[: k + 1]) for k in range(len(parts)))


def rank_share(graph: OpGraph, choice: TPChoice, in_stages: bool = False) -> RankShare:
    """What one TP rank of ``choice`` keeps of each saved tensor (``cost.saved.RankShare``): the values the
    layout splits (``shard_flow``), and the matmuls of a replicated or column-parallel weight that read a
    split value, which keep it gathered whole (sequence parallelism); ``in_stages`` (pipeline stages,
    ``runtime.tensor_parallel_stages``): the linears of ``STAGE_COPYING_STYLES`` each keep their own copy of
    their input (but those reading a sequence-parallel module's gathered input); computed once per layout."""
    key = ("rank_share", choice.tp, styles_key(choice), in_stages)
    return graph.derived(key, lambda: _rank_share(graph, choice.styles, choice.tp, in_stages))


def styles_key(choice: TPChoice) -> frozenset[tuple[str, str]]:
    """``choice.styles`` as a memo key, made once per layout: the search reads it for every priced plan, and a
    126-block layout has about a thousand styles (a frozenset keeps its hash once computed; a tuple would be
    hashed again at every read). Styles are filled while the layout is solved (``passes.layouts.styles``) and read
    only after, so the key is kept with the dict it was made from."""
    made = choice.__dict__.get("_styles_key")
    if made is None or made[0] is not choice.styles or made[1] != len(choice.styles):
        made = (choice.styles, len(choice.styles), _interned(frozenset(choice.styles.items())))
        choice.__dict__["_styles_key"] = made
    return made[2]


_INTERNED_STYLES: dict[frozenset[tuple[str, str]], frozenset[tuple[str, str]]] = {}
INTERNED_STYLES_KEPT = 64  # distinct layouts remembered; a search hands in a few per (tp, micro-batch)


def _interned(key: frozenset[tuple[str, str]]) -> frozenset[tuple[str, str]]:
    """One object per distinct set of styles: the search makes a new ``TPChoice`` with the same styles for many
    points (each (tp, micro-batch) solved again, copies from the forked pricer), and a memo lookup whose key holds
    an equal but other frozenset compares its thousand items, where the same object compares by identity. Only
    the speed depends on it, so the table forgets everything when it grows past ``INTERNED_STYLES_KEPT``."""
    if len(_INTERNED_STYLES) >= INTERNED_STYLES_KEPT and key not in _INTERNED_STYLES:
        _INTERNED_STYLES.clear()
    return _INTERNED_STYLES.setdefault(key, key)


# Styles whose module reads its input through tp_copy (a clone) inside a pipeline stage
# (runtime.tensor_parallel_stages: Megatron's f before a column split), but inside a gather-seq-module-input module,
# whose gathered input its column linears read as it is
STAGE_COPYING_STYLES = frozenset({"colwise", "colwise-gather", "conv1d-colwise"})


def _rank_share(graph: OpGraph, styles: dict[str, str], tp: int, in_stages: bool = False) -> RankShare:
    sharded, split = shard_flow(graph, styles)
    storage = {storage_of(graph, name) for name in split}
    gathers, own = set(), set()
    for node in graph.nodes:
        if op_name(node.target) not in MATMUL_OPS or not node.param_inputs:
            continue
        style = TP_STYLES.get(styles.get(node.module_path, ""))
        if style is not None and style.constructor in ROW_CONSTRUCTORS:
            continue  # a row-parallel weight reads its split input as it is
        if any(storage_of(graph, i) in storage for i in node.inputs if i not in graph.placeholder_params):
            gathers.add(node.name)
            if style is not None and any(k == "input_layouts" and v.startswith("Shard") for k, v in style.arguments):
                own.add(node.name)
    gathering = tuple(p + "." for p, s in styles.items() if s.startswith("gather-seq-module-input-dim"))
    copies = frozenset(
        node.name
        for node in graph.nodes
        if in_stages
        and op_name(node.target) in MATMUL_OPS
        and node.param_inputs
        and styles.get(node.module_path) in STAGE_COPYING_STYLES
        and not node.module_path.startswith(gathering)  # they read their module's gathered input as it is
    )
    partial, gathered_out = _collective_outputs(graph, styles)
    return RankShare(
        tp,
        frozenset(storage | split),
        frozenset(sharded),
        frozenset(gathers),
        frozenset(own),
        copies,
        partial,
        gathered_out,
    )


def _collective_outputs(graph: OpGraph, styles: dict[str, str]) -> tuple[frozenset[str], frozenset[str]]:
    """(the matmuls of a row-parallel weight: their local output is a whole-shaped partial sum, reduced after;
    the matmuls of a colwise-gather weight: their split output is all-gathered whole after)."""
    partial, gathered = set(), set()
    for node in graph.nodes:
        if op_name(node.target) not in MATMUL_OPS or not node.param_inputs:
            continue
        style = TP_STYLES.get(styles.get(node.module_path, ""))
        if style is None or not style.shards_weight:
            continue
        if style.constructor in ROW_CONSTRUCTORS:
            partial.add(node.name)
        elif style.output == "replicated":
            gathered.add(node.name)
    return frozenset(partial), frozenset(gathered)


def _scattered_inputs(graph: OpGraph, styles: dict[str, str]) -> set[tuple[str]]:
    """(node,) for the ops of a block with ``scatter-seq-input`` that read its sliced input: the first value
    its ops read from outside it."""
    out: set[tuple[str]] = set()
    for block in (p for p, s in styles.items() if s.startswith("scatter-seq-input-dim")):
        inside = [n for n in graph.nodes if n.module_path == block or n.module_path.startswith(block + ".")]
        names = {n.name for n in inside}
        outer = (x for n in inside for x in n.inputs if x not in names and x not in graph.placeholder_params)
        first = next(outer, None)
        out |= {(n.name,) for n in inside if first in n.inputs}
    return out


def unit_tp_fractions(
    graph: OpGraph, styles: dict[str, str], tp: int, times: list[float]
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per unit u: Σ_{n∈u} s(n)·t(n) / Σ_{n∈u} t(n), s(n) = 1/tp for ``sharded_nodes`` and 1 for the
    others (module doc); over all of u's ops, then over its non-matmul ops only."""
    sharded = sharded_nodes(graph, styles)
    count = len(graph.blocks) + 2
    whole, local = [[0.0] * count for _ in range(2)], [[0.0] * count for _ in range(2)]  # [all ops, light ops]
    for node, u, t in zip(graph.nodes, node_units(graph), times):
        kinds = (0,) if node.target.startswith(COMPUTE_HEAVY_TARGETS) else (0, 1)
        for k in kinds:
            whole[k][u] += t
            local[k][u] += t / tp if node.name in sharded else t
    all_ops, light_ops = (tuple(lo / wh if wh else 1.0 for lo, wh in zip(local[k], whole[k])) for k in (0, 1))
    return all_ops, light_ops


def unit_matmul_fractions(graph: OpGraph, styles: dict[str, str], tp: int, times: list[float]) -> tuple[float, ...]:
    """Per unit u: Σ_{n∈u, n a 2-D matmul} s(n)·t(n) / Σ_{n∈u} s(n)·t(n), the share of a TP rank's forward time
    in 2-D matmuls (``cost.async_tp``: what the TP collectives overlap with); s(n) as ``unit_tp_fractions``."""
    sharded = sharded_nodes(graph, styles)
    count = len(graph.blocks) + 2
    matmul, total = [0.0] * count, [0.0] * count
    for node, u, t in zip(graph.nodes, node_units(graph), times):
        local = t / tp if node.name in sharded else t
        total[u] += local
        matmul[u] += local if node.target.startswith(MATMUL_2D_TARGETS) else 0.0
    return tuple(m / t if t else 0.0 for m, t in zip(matmul, total))


def local_params_by_block(graph: OpGraph, sharded: dict[str, str], tp: int) -> dict[str | None, int]:
    """Parameters per TP rank of every block (None: outside blocks), in one pass: sharded modules'
    weights / tp; a row-parallel bias stays whole (RowwiseParallel replicates it). Once per (styles, tp) of a
    graph (the search reads it for every layout it prices and every unit's share); a copy, so callers may keep
    or change theirs."""
    key = ("local_params_by_block", _interned(frozenset(sharded.items())), tp)
    return dict(graph.derived(key, lambda: _local_params_by_block(graph, sharded, tp)))


def _local_params_by_block(graph: OpGraph, sharded: dict[str, str], tp: int) -> dict[str | None, int]:
    totals: dict[str | None, int] = {}
    for p in graph.params:
        if not p.is_buffer:
            split = splits_param(sharded.get(p.module_path), p.name)
            block = block_of(p.module_path)
            totals[block] = totals.get(block, 0) + (p.numel // tp if split else p.numel)
    return totals


def splits_param(style: str | None, param_name: str) -> bool:
    """Whether a parameter of a module in ``style`` (None: replicated) is split over the TP ranks:
    every one of a sharded module but a row-parallel bias (RowwiseParallel replicates it); for the
    sequence-parallel styles the ones their ``TP_STYLES`` row shards (gather / scatter hooks on a replicated
    module shard none)."""
    row = TP_STYLES.get(style) if style is not None else None
    if row is not None and row.sequence_parallel:
        return param_name.rsplit(".", 1)[-1] in row.param_shard_dims
    return style is not None and not (style == "rowwise" and param_name.endswith(".bias"))


def local_param_count(graph: OpGraph, sharded: dict[str, str], tp: int, block: str | None = None) -> int:
    """Parameters per TP rank, of ``block`` only if given (``local_params_by_block``)."""
    totals = local_params_by_block(graph, sharded, tp)
    return totals.get(block, 0) if block is not None else sum(totals.values())


def block_input_shares(graph: OpGraph, share: RankShare) -> tuple[float, ...]:
    """Per block: the part of the activation entering it that one TP rank holds, over the whole: its own inputs
    (as ``Block.input_bytes`` counts them: the values from outside that no other block reads, else the largest
    one) on the rank (``RankShare.value_bytes``) over their whole bytes. 1/tp where the layout leaves the residual
    stream sharded over the sequence (sequence parallelism: a pipeline boundary there sends 1/tp of the tokens,
    ``runtime.tensor_parallel_stages``), 1 elsewhere (the stream whole on every TP rank)."""
    inputs = {b.path: _external_inputs(graph, b.node_names) for b in graph.blocks}
    readers: dict[str, set[str]] = {}
    for path, names in inputs.items():
        for name in names:
            readers.setdefault(name, set()).add(path)
    shares = []
    for block in graph.blocks:
        names = inputs[block.path]
        own = [n for n in names if readers[n] == {block.path}]
        if not own and names:
            own = [max(names, key=lambda n: WHOLE.value_bytes(graph, n, 1.0))]
        whole = sum(WHOLE.value_bytes(graph, n, 1.0) for n in own)
        shares.append(sum(share.value_bytes(graph, n, 1.0) for n in own) / whole if whole else 1.0)
    return tuple(shares)


def _external_inputs(graph: OpGraph, node_names: tuple[str, ...]) -> list[str]:
    """The activations a block reads from outside it: other nodes' outputs and the user's inputs, no parameters
    (``passes.capturing.blocks``' rule)."""
    inside = set(node_names)
    users = set(graph.input_names)
    names = (x for n in node_names for x in graph.node(n).inputs if x not in inside)
    return list(dict.fromkeys(x for x in names if x in users or x not in graph.placeholders))
