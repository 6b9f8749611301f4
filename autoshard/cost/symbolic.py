"""Symbolic cost: a plan's step time and memory per rank as sympy expressions.

Symbols (``SYMBOLS``): B global batch, s sequence length (tokens per sample), dp, tp, pp the
mesh degrees, b the micro-batch size, v virtual stages per pp rank; m = B/(dp·b) micro-batches
is substituted, so every expression is in these seven symbols only. Each named part of
``cost.parts.StepParts`` gets the scaling law it has in the cost model; its coefficient comes
from the plan's own priced figure (``_anchored``: value₀ · law / law(point₀)), so evaluating at
the plan's point gives the plan's predicted figures back, up to float rounding. With
h(t) = φ + (1−φ)/t the share of compute left per TP rank (φ: the FLOPs share of the ops the
plan's TP layout leaves replicated), P = (ψ + (1−ψ)/tp)/pp the rank's share of the parameters
(ψ: the replicated parameters), ring(n) = (n−1)/n, [x>1] an indicator::

    forward_s        = m·b·(f₁·s + f₂·s²)·h(tp)/pp     f₂/f₁: attention (s²) vs the rest (s), by FLOPs
    backward_s       = m·b·(g₁·s + g₂·s²)·h(tp)/pp     (2 × forward in the cost model)
    recompute_s      = m·b·(r₁·s + r₂·s²)·h_r(tp)/pp   0 without recompute
    host_s           = k·m/pp                          host overheads: per micro-batch on the rank's stages
    grad_accumulation_s = k·max(0, m − 1)·P / dp^[ZeRO ≥ 2, no pipeline]
    optimizer_s      = k·P / dp^[ZeRO ≥ 1]             (Adam is memory-bound on the local shard)
    tp_comm_s        = k·m·b·s·ring(tp)/pp             activations all-reduced per micro-batch
    p2p_s            = k·m·b·s·v·[pp>1]                 two boundary transfers per stage on the rank
    dp_comm_exposed_s = k·ring(dp)·P·X                  gradient size: constant in B and s;
                       X = 1 (DDP, once a step), m (FSDP without pipeline, per micro-batch),
                       2·a·m + g (pipeline ZeRO-3: 2m gathers of a bytes, a scatter of g bytes per param)
    bubble_s         = k·(pp − 1)/v · T_mb,   T_mb = (forward + backward + recompute + host + tp_comm + p2p)/m
                       (k ≤ 1: the fill and drain run at the other ranks' pace, ``cost.pipeline_step``;
                       about 1/3 under the zero-bubble schedules, whose weight gradients fill 2/3 of it;
                       below 0 where ranks share fewer cores and idle ones lend theirs)
    step_time_s      = Σ of the parts above

    params_bytes     = k·P / dp^[ZeRO = 3]      grads_bytes = k·P / dp^[ZeRO ≥ 2]
    optimizer_bytes  = k·P / dp^[ZeRO ≥ 1]
    activations_bytes = I·b·(a₁·s + a₂·s²)·A(tp)/pp,
                       A(t) = β + (1−β)·(10 + 24/t)/34 (Korthikanti et al.; 1 under full recompute);
                       with sequence parallelism β + (1−β)·κ/t, κ·1/t the layout's share at the plan
                       I in-flight micro-batches: 1 | m (GPipe) | min(m, pp) (1F1B; interleaved-zb and
                       zbv at m a multiple of pp) | min(m, pp + (pp−1)/v) (interleaved) | pp + 1/2 (dualpipev)
    transient_bytes  = k·b·s/tp                   (ZeRO-0/1: the loss's or a block's backward workspace)
                     = k·[dp>1]·(ψ + (1−ψ)/tp)   (ZeRO-2/3 without pipeline: the largest FSDP unit)
                     = k·ring(dp)·P              (ZeRO-2/3 pipeline: the stage's unsharded state)
    memory_peak_bytes = (Σ memory parts)·(1 + allocator slack)

**Context parallelism** (plans with cp > 1 carry the symbol cp; ``cost.context_parallel``): a rank
holds s/cp of each sample's tokens, so every s above reads s/cp, and the s² terms read s²·q(cp) with
q = (2cp − 1)/cp² for causal attention on contiguous chunks (the ring's lockstep waits for its last rank),
1/cp otherwise (head-tail chunks, where the plan's s is a multiple of 2cp, even the causal work out: the plan's
layout is kept for other values); activations' s² part reads s²/cp; dp reads dp·cp wherever parameters are
sharded or gradients reduced (ZeRO, the DP collectives, the FSDP transient); and::

    cp_comm_s        = k·m·b·(s/cp)/pp                 the ring's exposed exchange: what its blocks cannot hide is
                                                       mostly the last pass of each attention's dk, dv (s/cp
                                                       tokens), its gathers hidden behind the local block

**Host offload** (``cost.offload``; the anchored optimizer and accumulation laws above hold, on the host)::

    offload_s        = k·m·P / dp                       the host link's exposed copies of the rank's shard

(``time_expressions``, ``memory_expressions``; every k, f, g, r, a is a plan's figure over its law.)
A part that is zero at the plan's point only because of the point (tp = 1: no TP all-reduces;
pp = 1: no p2p; m = 1: no accumulation; dp = 1: no DP collectives) has no price to scale, so its
coefficient is the cost model's analytic one on the cluster's links (``_fallbacks``): Megatron's
4 all-reduces of each block's input per micro-batch on the intra-node link; 2 boundary transfers
per stage; the DP collectives fully exposed on the inter-node link (intra-node on one node).

**Held fixed** (the plan's, re-plan for a decision): the ZeRO stage, recompute mode and
schedule (and so whether there is a pipeline at all); the TP layout (φ, ψ); the stage cuts and
their imbalance (the slowest rank's share scales as 1/pp); the share of DP communication
hidden behind compute, the DDP bucket count and the flat vs two-level collective choice; the
links (latencies scale with the bandwidth terms); the attention/rest split of each part.
Changing B, s or b is exact up to roofline effects (weights read once per op, memory-bound
small ops); changing degrees far from the plan is an estimate.

Plans store the expressions as strings (``sympy.sstr``: deterministic for the same inputs);
``cost.expressions`` reads them back and evaluates them, without ``eval``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy

from autoshard.cost.memory import (
    COMPUTE_HEAVY_TARGETS,
    Precision,
    alternate_reruns,
    block_saved_bytes,
    non_block_saved_bytes,
)
from autoshard.cost.parts import StepParts
from autoshard.cost.rank_memory import ALLOCATOR_SLACK
from autoshard.cost.tables import CostTables
from autoshard.cost.tp import recompute_tp_comm, sharded_nodes, splits_param, tp_activation_fraction
from autoshard.ir.decisions import Decisions, TPChoice, cp_load_balanced
from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.plan import Memory
from autoshard.ir.topology import Cluster

SYMBOLS = {name: sympy.Symbol(name, positive=True) for name in ("B", "s", "dp", "tp", "pp", "b", "v", "cp")}


B, S, DP, TP, PP, MB, V, CP = SYMBOLS.values()


M = B / (DP * MB)  # micro-batches per step


TIME_PARTS = (
    "forward_s",
    "backward_s",
    "recompute_s",
    "grad_accumulation_s",
    "optimizer_s",
    "host_s",
    "tp_comm_s",
    "p2p_s",
    "dp_comm_exposed_s",
    "bubble_s",
    "ep_comm_s",
    "cp_comm_s",
    "offload_s",
)


COMPUTE_PARTS = TIME_PARTS[:6]


COMM_PARTS = ("tp_comm_s", "p2p_s", "dp_comm_exposed_s", "ep_comm_s", "cp_comm_s", "offload_s")


MEMORY_PARTS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "transient_bytes")


WHAT_IF_NAMES = {
    "global_batch": "B",
    "seq_len": "s",
    "microbatch_size": "b",
    "dp": "dp",
    "tp": "tp",
    "pp": "pp",
    "cp": "cp",
}


WHAT_IF_EXAMPLES = {"global_batch": 2048, "seq_len": 4096, "microbatch_size": 2, "dp": 8, "tp": 2, "pp": 2, "cp": 4}


QUADRATIC_TARGETS = ("aten.scaled_dot_product_attention", "aten._scaled_dot_product")


SNAP = 1e-9  # a coefficient this close to 1 is 1 (exact identities stay readable)


@dataclass(frozen=True)
class PlanPoint:
    """What the expressions need to know about the plan they describe."""

    symbols: dict[str, int]  # B, s, dp, tp, pp, b, v at the plan (and cp, with context parallelism)
    zero_stage: int
    recompute: str
    schedule: str

    @property
    def pipeline(self) -> bool:
        return self.symbols["pp"] > 1

    @property
    def cp(self) -> sympy.Expr:
        """The cp symbol in plans with context parallelism; 1 (no symbol) in the others, whose expressions
        stay as they were."""
        return CP if "cp" in self.symbols else sympy.Integer(1)

    @property
    def dp_cp(self) -> sympy.Expr:
        """The ranks holding the same parameters: dp, times cp with context parallelism."""
        return DP * self.cp

    def subs(self) -> dict[sympy.Symbol, sympy.Integer]:
        return {SYMBOLS[k]: sympy.Integer(v) for k, v in self.symbols.items()}


@dataclass(frozen=True)
class Shares:
    """Structural constants from the op graph and the plan's TP layout (module doc)."""

    attention: float  # FLOPs share of the s² ops
    recompute_attention: float  # the same over what recompute reruns
    replicated: float  # φ: FLOPs share left whole on every TP rank
    recompute_replicated: float  # φ_r
    replicated_params: float  # ψ
    activation_attention: float  # bytes share of saved activations that grow as s²
    outside_blocks: float  # β: share of saved activations that TP does not split
    causal: bool = False  # every attention is causal: a contiguous cp ring's last rank does (2cp − 1)/cp² of its work
    sequence_keep: float | None = None  # sequence parallelism: t·(a TP rank's share of a block's activations)


def symbolic_cost(
    tables: CostTables, config: Decisions, global_batch: int, parts: StepParts, tp_choice: TPChoice | None = None
) -> dict[str, Any]:
    """The plan's ``symbolic`` field: expressions (as strings) of every part, anchored at ``parts``
    (``cost.parts.StepParts`` of ``config`` on ``tables``) and the plan's own symbol values."""
    graph, cluster, precision = tables.graph, tables.cluster, tables.precision
    mesh = config.mesh
    cp = {"cp": mesh.cp} if mesh.cp > 1 else {}  # written only with context parallelism
    point = PlanPoint(
        symbols={
            "B": global_batch,
            "s": graph.tokens_per_sample,
            "dp": mesh.dp,
            "tp": mesh.tp,
            "pp": mesh.pp,
            "b": config.microbatch_size,
            "v": config.virtual_stages,
            **cp,
        },
        zero_stage=config.zero_stage,
        recompute=_law_mode(config),
        schedule=config.schedule,
    )
    shares = graph_shares(graph, point, tp_choice)
    fallback = _fallbacks(graph, cluster, precision, point, parts, shares)
    times = time_expressions(parts, point, shares, fallback, precision)
    memory = memory_expressions(parts.memory, point, shares, fallback)
    per_sample = 3.0 * graph.flops_fwd / graph.batch_size  # the model's, whatever the plan: s and s² terms apart
    flops = _anchored(per_sample * (1 - shares.attention), S, point) + _anchored(
        per_sample * shares.attention, S**2, point
    )
    return {
        "symbols": dict(point.symbols),
        "step_time_s": _text(sum(times.values(), sympy.Integer(0))),
        "parts": {k: _text(e) for k, e in times.items()},
        "memory_peak_bytes": _text(sum(memory.values(), sympy.Integer(0)) * _number(1 + ALLOCATOR_SLACK)),
        "memory": {k: _text(e) for k, e in memory.items()},
        "model_flops_per_sample": _text(flops),
    }


def _law_mode(config: Decisions) -> str:
    """The recompute mode whose laws a plan's expressions follow: a mixed plan (some blocks full,
    some selective, some none) follows its most aggressive mode; its own figures anchor them."""
    if config.recompute != "mixed":
        return config.recompute
    return next(m for m in ("full", "selective") if m in config.recompute_blocks)


def time_expressions(
    parts: StepParts, point: PlanPoint, shares: Shares, fallback: dict[str, float], precision: Precision
) -> dict[str, sympy.Expr]:
    """Every time part (module doc), anchored at ``parts``."""
    h = _tp_share(shares.replicated)
    per_rank = MB * h / PP
    e = {
        "forward_s": _split(parts.forward_s, shares.attention, point, M * per_rank, _ring_work(point, shares)),
        "backward_s": _split(parts.backward_s, shares.attention, point, M * per_rank, _ring_work(point, shares)),
        "recompute_s": _split(
            parts.recompute_s,
            shares.recompute_attention,
            point,
            M * MB * _tp_share(shares.recompute_replicated) / PP,
            _ring_work(point, shares),
        ),
    }
    param_share = _param_share(shares.replicated_params)
    dp_cp = point.dp_cp
    accumulate_over = dp_cp if point.zero_stage >= 2 and not point.pipeline else 1  # ZeRO-1 sums whole
    accumulations = sympy.Max(0, M - 1) * param_share / accumulate_over
    e["grad_accumulation_s"] = _anchored(
        parts.grad_accumulation_s, accumulations, point, fallback["grad_accumulation_s"]
    )
    e["optimizer_s"] = _anchored(parts.optimizer_s, param_share / (dp_cp if point.zero_stage >= 1 else 1), point)
    e["host_s"] = _anchored(parts.host_s, M / PP, point)
    tokens = M * MB * S / point.cp  # a rank's tokens per step
    e["tp_comm_s"] = _anchored(parts.tp_comm_s, tokens * _ring(TP) / PP, point, fallback["tp_comm_s"])
    e["p2p_s"] = _anchored(parts.p2p_s, tokens * V * _more_than_one(PP), point, fallback["p2p_s"])
    e["dp_comm_exposed_s"] = _anchored(
        parts.dp_comm_exposed_s,
        _ring(dp_cp) * param_share * _dp_rounds(point, precision),
        point,
        fallback["dp_comm_exposed_s"],
    )
    if parts.ep_comm_s:  # expert parallelism's all-to-alls: the tokens of each micro-batch (absent without)
        e["ep_comm_s"] = _anchored(parts.ep_comm_s, tokens / PP, point)
    if parts.cp_comm_s:  # the ring's exposed exchange: what its blocks leave unhidden (absent without)
        e["cp_comm_s"] = _anchored(parts.cp_comm_s, tokens / PP, point)
    if parts.offload_s:  # host offload's exposed copies: the rank's shard, each micro-batch (absent without)
        e["offload_s"] = _anchored(parts.offload_s, M * param_share / dp_cp, point)
    per_microbatch = (
        sum(
            (
                e[k]
                for k in (
                    "forward_s",
                    "backward_s",
                    "recompute_s",
                    "host_s",
                    "tp_comm_s",
                    "p2p_s",
                    "ep_comm_s",
                    "cp_comm_s",
                )
                if k in e
            ),
            sympy.Integer(0),
        )
        / M
    )
    e["bubble_s"] = _anchored(parts.bubble_s, (PP - 1) / V * per_microbatch, point, 1.0)
    return e


def memory_expressions(
    memory: Memory, point: PlanPoint, shares: Shares, fallback: dict[str, float]
) -> dict[str, sympy.Expr]:
    """Every memory part per rank (module doc), anchored at the plan's ``Memory``."""
    z = 2 if point.pipeline and point.zero_stage == 1 else point.zero_stage  # rank_memory.pipeline_zero
    param_share = _param_share(shares.replicated_params)
    e = {
        "params_bytes": _anchored(memory.params_bytes, param_share / (point.dp_cp if z >= 3 else 1), point),
        "grads_bytes": _anchored(memory.grads_bytes, param_share / (point.dp_cp if z >= 2 else 1), point),
        "optimizer_bytes": _anchored(memory.optimizer_bytes, param_share / (point.dp_cp if z >= 1 else 1), point),
    }
    beta = shares.outside_blocks
    per_rank = (
        _number(shares.sequence_keep) / TP
        if shares.sequence_keep is not None  # ≈ 1/t (sequence parallel)
        else tp_activation_fraction(TP)
    )
    kept = sympy.Integer(1) if point.recompute == "full" else _number(beta) + _number(1 - beta) * per_rank
    e["activations_bytes"] = _split(
        memory.activations_bytes, shares.activation_attention, point, in_flight(point) * MB * kept / PP, 1 / point.cp
    )
    if z < 2:  # the loss's fp32 gradients or a block's activation gradients (cost.rank_memory.spmd_moments)
        e["transient_bytes"] = _anchored(memory.transient_bytes, MB * S / (TP * point.cp), point)
    elif point.pipeline:
        e["transient_bytes"] = _anchored(memory.transient_bytes, _ring(point.dp_cp) * param_share, point)
    else:
        largest_unit = _more_than_one(point.dp_cp) * _tp_share(shares.replicated_params)
        e["transient_bytes"] = _anchored(memory.transient_bytes, largest_unit, point, fallback["transient_bytes"])
    return e


def in_flight(point: PlanPoint) -> sympy.Expr:
    """Micro-batches whose activations the first pp rank holds at its peak (``cost.rank_memory.in_flight``)."""
    if not point.pipeline:
        return sympy.Integer(1)
    return {
        "gpipe": M,
        "1f1b": sympy.Min(M, PP),
        "interleaved-zb": sympy.Min(M, PP),
        "zbv": sympy.Min(M, PP),
        "dualpipev": PP + sympy.Rational(1, 2),
    }.get(point.schedule, sympy.Min(M, PP + (PP - 1) / V))


def _dp_rounds(point: PlanPoint, precision: Precision) -> sympy.Expr:
    """X of the module doc: how DP communication repeats within a step."""
    if point.zero_stage <= 1:
        return sympy.Integer(1)
    if not point.pipeline:
        return M
    if point.zero_stage == 3:
        return 2 * precision.activation_bytes * M + precision.grad_bytes
    return sympy.Integer(1)


def _split(
    value: float, quadratic_share: float, point: PlanPoint, law: sympy.Expr, quadratic_cp: sympy.Expr = sympy.Integer(1)
) -> sympy.Expr:
    """value·(1−α) scaled by law·s/cp plus value·α scaled by law·s²·q: the s and s² terms apart (a cp
    rank holds s/cp tokens; q its share of the s² work or bytes, 1 without context parallelism)."""
    linear = _anchored(value * (1 - quadratic_share), law * S / point.cp, point)
    return linear + _anchored(value * quadratic_share, law * S**2 * quadratic_cp, point)


def _ring_work(point: PlanPoint, shares: Shares) -> sympy.Expr:
    """A cp rank's share of the attention work (``cost.context_parallel``): (2cp − 1)/cp² for causal
    attention on contiguous chunks (the ring's lockstep waits for the last rank), 1/cp otherwise (head-tail
    chunks even out the causal work: the plan's layout, ``cp_load_balanced`` at its s and cp, is the one the
    expressions keep for other values); 1 without cp."""
    if "cp" not in point.symbols:
        return sympy.Integer(1)
    balanced = cp_load_balanced(point.symbols["s"], point.symbols["cp"])
    return (2 * CP - 1) / CP**2 if shares.causal and not balanced else 1 / CP


def _anchored(value: float, law: sympy.Expr, point: PlanPoint, fallback: float = 0.0) -> sympy.Expr:
    """value · law / law(point): the law with the plan's own price as its coefficient. Where the law
    vanishes at the plan's point there is nothing to scale: ``fallback`` is the coefficient."""
    at = float(law.xreplace(point.subs()))
    k = value / at if at else fallback
    if k == 0:
        return sympy.Integer(0)
    return law if abs(k - 1) < SNAP else _number(k) * law


def _tp_share(replicated: float) -> sympy.Expr:
    """h(tp) = φ + (1−φ)/tp."""
    return _number(replicated) + _number(1 - replicated) / TP


def _param_share(replicated: float) -> sympy.Expr:
    """P = (ψ + (1−ψ)/tp)/pp."""
    return _tp_share(replicated) / PP


def _ring(n: sympy.Symbol) -> sympy.Expr:
    return (n - 1) / n


def _more_than_one(x: sympy.Symbol) -> sympy.Expr:
    return sympy.Piecewise((0, sympy.Eq(x, 1)), (1, True))


def _number(x: float) -> sympy.Expr:
    """A float coefficient; exact 0 and 1 stay integers so expressions stay short."""
    if x == 0 or x == 1:
        return sympy.Integer(int(x))
    return sympy.Float(x)


def _text(expr: sympy.Expr) -> str:
    return sympy.sstr(expr, order="lex")


def graph_shares(graph: OpGraph, point: PlanPoint, tp_choice: TPChoice | None = None) -> Shares:
    """α, φ, ψ, β of the module doc, from the op graph and the plan's TP layout."""
    s0 = point.symbols["s"]
    quadratic = {n.name for n in graph.nodes if _is_quadratic(graph, n, s0)}
    in_block = {n for blk in graph.blocks for n in blk.node_names}
    rerun = [
        n
        for n in graph.nodes
        if n.name in in_block and (point.recompute == "full" or not n.target.startswith(COMPUTE_HEAVY_TARGETS))
    ]
    sharded = _sharded_nodes(graph, tp_choice)
    rerun_weight = (lambda n: n.flops) if point.recompute == "full" else (lambda n: n.bytes_written)
    return Shares(
        attention=_share(graph.nodes, lambda n: n.flops, lambda n: n.name in quadratic),
        recompute_attention=_share(rerun, rerun_weight, lambda n: n.name in quadratic),
        replicated=_share(graph.nodes, lambda n: n.flops, lambda n: n.name not in sharded, default=1.0),
        recompute_replicated=_share(rerun, rerun_weight, lambda n: n.name not in sharded, default=1.0),
        replicated_params=_replicated_params(graph, tp_choice),
        activation_attention=_share(
            _kept_nodes(graph, point.recompute, in_block), lambda n: n.bytes_written, lambda n: n.name in quadratic
        ),
        outside_blocks=_outside_share(graph, point.recompute),
        causal=_all_causal(graph),
        sequence_keep=_sequence_keep(tp_choice),
    )


def _sequence_keep(tp_choice: TPChoice | None) -> float | None:
    """t times the layout's share of a block's activations per TP rank, under sequence parallelism."""
    if tp_choice is None or not tp_choice.sequence_parallel or tp_choice.block_activation_fraction is None:
        return None
    return tp_choice.block_activation_fraction * tp_choice.tp


def _all_causal(graph: OpGraph) -> bool:
    """Every scaled-dot-product attention has a causal mask (``is_causal``), and there is one."""
    attentions = [n for n in graph.nodes if n.target.startswith(QUADRATIC_TARGETS)]
    return bool(attentions) and all(n.attrs.get("is_causal") for n in attentions)


def _share(nodes, weight, chosen, default: float = 0.0) -> float:
    total = sum(weight(n) for n in nodes)
    return sum(weight(n) for n in nodes if chosen(n)) / total if total else default


def _is_quadratic(graph: OpGraph, node: OpNode, s0: int) -> bool:
    """Attention: an SDPA op, or an op producing or reading a (batch, heads, s, s) score tensor."""
    if s0 <= 1:
        return False
    if node.target.startswith(QUADRATIC_TARGETS):
        return True
    shapes = [node.shape] + [_shape(graph, i) for i in node.inputs if i not in graph.placeholder_params]
    return any(len(sh) >= 4 and tuple(sh[-2:]) == (s0, s0) for sh in shapes)


def _shape(graph: OpGraph, name: str) -> tuple[int, ...]:
    try:
        return tuple(graph.value_meta(name)[0])
    except KeyError:
        return ()


def _sharded_nodes(graph: OpGraph, tp_choice: TPChoice | None) -> set[str]:
    """The ops the plan's TP layout runs on 1/tp of their data; with no layout (tp = 1), the ideal
    Megatron one: every matmul-class op (norms, residuals and the rest stay whole)."""
    if tp_choice is not None:
        return sharded_nodes(graph, tp_choice.styles)
    return {n.name for n in graph.nodes if n.target.startswith(COMPUTE_HEAVY_TARGETS)}


def _replicated_params(graph: OpGraph, tp_choice: TPChoice | None) -> float:
    """ψ: the share of parameters whole on every TP rank (a row-parallel bias stays whole)."""
    if tp_choice is not None:
        styles = tp_choice.sharded
    else:
        heavy = {n.module_path for n in graph.nodes if n.target.startswith(COMPUTE_HEAVY_TARGETS)}
        styles = {m: "colwise" for m in heavy}
    params = [p for p in graph.params if not p.is_buffer]
    whole = sum(p.numel for p in params if not splits_param(styles.get(p.module_path), p.name))
    total = sum(p.numel for p in params)
    return whole / total if total else 1.0


def _kept_nodes(graph: OpGraph, recompute: str, in_block: set[str]) -> list[OpNode]:
    """The ops whose outputs stay saved for backward under the recompute mode (``cost.memory``)."""
    if recompute == "none":
        return list(graph.nodes)
    if recompute == "selective":
        return [n for n in graph.nodes if n.name not in in_block or n.target.startswith(COMPUTE_HEAVY_TARGETS)]
    if recompute == "alternate":
        again = alternate_reruns(graph)
        return [
            n
            for n in graph.nodes
            if n.name not in in_block or (n.target.startswith(COMPUTE_HEAVY_TARGETS) and n.name not in again)
        ]
    return [n for n in graph.nodes if n.name not in in_block]


def _outside_share(graph: OpGraph, recompute: str) -> float:
    """β: saved activations outside the blocks over all saved activations."""
    outside = non_block_saved_bytes(graph)
    total = outside + sum(block_saved_bytes(graph, blk, recompute) for blk in graph.blocks)
    return outside / total if total else 1.0


def _fallbacks(
    graph: OpGraph, cluster: Cluster, precision: Precision, point: PlanPoint, parts: StepParts, shares: Shares
) -> dict[str, float]:
    """Coefficients of the parts whose law vanishes at the plan's point (module doc)."""
    p = point.symbols
    a, g, w = precision.activation_bytes, precision.grad_bytes, precision.param_bytes
    bandwidth = cluster.device.memory_bandwidth_gbps * 1e9
    intra = cluster.intra_node.bandwidth_gbps * 1e9
    outer = (cluster.inter_node if cluster.nodes > 1 else cluster.intra_node).bandwidth_gbps * 1e9
    share0 = (shares.replicated_params + (1 - shares.replicated_params) / p["tp"]) / p["pp"]
    state_dp = p["dp"] * p.get("cp", 1) if point.zero_stage >= 3 else 1
    local = parts.memory.params_bytes * state_dp / w  # the rank's parameters
    per_token = sum(blk.input_bytes for blk in graph.blocks) * a / 4 / (graph.batch_size * max(1, p["s"]))
    recompute_factor = recompute_tp_comm(point.recompute, False)  # the fallback's four all-reduces per block
    if point.zero_stage <= 1:  # all-reduce (2(n−1)/n) of the gradients, ZeRO-1 a gather of the weights
        dp_bytes = 2 * g + (w if point.zero_stage == 1 else 0)
    elif point.pipeline and point.zero_stage == 3:  # X = 2·a·m + g carries the bytes
        dp_bytes = 1
    else:  # gather (twice under ZeRO-3) and reduce-scatter
        dp_bytes = a * (2 if point.zero_stage == 3 and not point.pipeline else 1) + g
    largest = max((blk.param_count for blk in graph.blocks), default=graph.param_count)
    unit_bytes = (2 * w + g) if point.zero_stage == 3 else g
    return {
        "grad_accumulation_s": 3 * g * local / (bandwidth * share0),
        "tp_comm_s": 8 * per_token * recompute_factor / intra,  # 4 all-reduces of 2(t−1)/t·S per block
        "p2p_s": 2 * per_token / max(1, len(graph.blocks)) / outer,
        "dp_comm_exposed_s": dp_bytes * local / (outer * share0),
        "transient_bytes": unit_bytes * largest,
    }
