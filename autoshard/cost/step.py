"""One training step of a configuration, priced as a sum of named parts.

Notation: mesh (dp, tp, pp) laid out (pp, dp, tp), tp innermost; m micro-batches of b samples
per dp replica; v virtual stages per pp rank; c = fwd + bwd + recompute of one micro-batch;
W the device's memory bandwidth; g bytes per gradient element.

Every step is a ``StepParts`` (``price_parts``), and ``Predicted`` sums it::

    step_time    = compute + comm_exposed + bubble
    compute      = forward + backward + recompute + grad_accumulation + optimizer + host
    comm_exposed = tp_comm + p2p + dp_exposed

    grad_accumulation = (m − 1)·3·g·Ψ_acc / W     (``grad_accumulation_s``: each micro-batch after
                        the first reads its gradients and the sum, writes the sum; Ψ_acc the rank's
                        parameters, / dp under FSDP without pipelining)
    optimizer         = 28 bytes · Ψ_opt / W      (``optimizer_step_s``: fp32 Adam, memory-bound)
    host              = m · Σ_u host(u)  +  m · U · h_fsdp  +  T_opt · h_opt

**Host** (``cluster.host``, measured by ``autoshard calibrate``; zero in the presets): the op
dispatch of every unit (``cost.units``, forward, backward, recompute), FSDP2's hooks and copies
per unit and micro-batch (U units: the blocks and the root; a pipeline stage is one unit), the
optimizer's loop over its T_opt parameter tensors (FSDP2's sharded DTensors cost more), and
with pipelining the schedule's bookkeeping per stage and micro-batch (in T_r below). ZeRO-1's
ZeroRedundancyOptimizer broadcasts each parameter tensor alone: T broadcasts' latencies.
On CPU ranks (gloo) collectives and compute share the cores (``hides_comm`` false): the bytes a
collective moves (copies and reductions on those cores) are never hidden; only its waiting is,
where it is issued ahead of compute: FSDP2's per-unit latencies U·C(0) hide behind the forward
(all-gathers) and backward (reduce-scatters, ZeRO-3's re-gathers), the first unit's never.

**Runtime** (``Runtime``): what executes the plan changes three things: the precision (bytes of
weights, gradients, optimizer state, activations), the attention kernel (``compute``: flash, or
scores materialized in HBM), and whether TP ranks scatter-gather pipeline boundaries. autoshard's
own programs are ``Runtime.for_cluster``; ``benchmarks/bench_megatron.py`` describes Megatron-LM.

**Without pipelining** (pp = 1; ``spmd_parts``)::

    forward + backward + recompute = m·c_tp        tp_comm = m·T_tp       p2p = bubble = 0
    dp_exposed = Σ_DP max(0, t_comm − t_compute it hides behind),
                 never less than the part that has nothing to hide behind

With tp > 1 the op graph's layout choice (``passes.tensor_parallel.choose_tp_styles``, made
for micro-batch b, see ``CostTables.tp_cost``) runs some ops on shards: linears and embeddings of
a sharded style, and every op between a column-parallel linear and the row-parallel one that
reduces its output (``sharded_nodes``); norms, residual adds, dropouts on the residual stream
stay replicated, as in Megatron-LM without sequence parallelism. Per unit u (``cost.units``)::

    f(u) = Σ_{n∈u} s(n)·t(n) / Σ_{n∈u} t(n),   s(n) = 1/tp on shards, 1 replicated   (``unit_tp_fractions``)
    c_tp = Σ_u f(u)·c(u)            (selective recompute: its rerun ops' own share)

T_tp is that choice's TP collectives per micro-batch (forward all-reduces of row-parallel
outputs, backward all-reduces of column-parallel input gradients), all exposed: they sit
between dependent matmuls. Full recompute runs the forward again, so T_tp ×
``FULL_RECOMPUTE_TP_COMM`` (the forward half of Megatron's four per layer).

DDP (ZeRO-0/1) all-reduces gradients in buckets of B bytes during the last micro-batch's
backward (``no_sync`` on the others); the last bucket is always exposed. ZeroRedundancy-
Optimizer (ZeRO-1) then broadcasts each rank's updated shard (an all-gather of the weights),
exposed. FSDP2 (ZeRO-2/3) all-gathers each block's weights before its forward (prefetched
behind the previous block's compute; the first is exposed) and reduce-scatters its gradients
after its backward (the last is exposed); ZeRO-3 gathers again for backward. Both do this
every micro-batch, one collective per unit (U = blocks + 1 latencies each way:
``per_unit_collectives_s``). DP collectives run on the dp group of rank 0 (ranks d·tp); a group that
spans n nodes with g members per node is priced as the cheaper of a flat ring on the NIC
share and the two-level form (``dp_collective_s``)::

    AR_2(S) = RS(S, g, intra) + AR(S/g, n, inter) + AG(S, g, intra)   (comm.hierarchical_allreduce_s)
    RS_2(S) = RS(S, g, intra) + RS(S/g, n, inter)         AG_2(S) = AG(S/g, n, inter) + AG(S, g, intra)

**With pipelining** (pp > 1; ``pipeline_parts``): stage s holds a run of units
(``cost.units``; cuts from ``passes.stage_cuts``) and lives on pp rank s mod pp. Per
micro-batch, rank r spends T_r = C_r + P_r + X_r: C_r the compute of its stages, X_r their TP
collectives, P_r two transfers (activation forward, gradient backward) of the boundary
activation entering each of its stages but the first (NUMBERS.md: b·s·h·bytes each way;
``boundary_transfer_s``)::

    step_time    = m · T_max + (Σ_r T_r − T_max)/v + grad_accumulation + optimizer + DP_exposed
    compute      = m · C_{r*} + grad_accumulation + optimizer      r* the slowest rank, T_max = T_{r*}
    comm_exposed = m · (X_{r*} + P_{r*}) + DP_exposed
    bubble       = (Σ_r T_r − T_max)/v    (GPipe / 1F1B: v = 1; interleaved 1F1B: v chunks;
                                           ranks sharing fewer cores: "Shared cores" below)

The bubble is the fill and the drain: the first micro-batch's forward and the last one's
backward pass through every other rank once (1/v of its work per chunk), while the slowest
rank's m slots set the steady state. With equal ranks it is NUMBERS.md's (p−1)/v · T; with
unequal ones (the embedding and the head make the end stages heavier) (p−1)/v · T_max would
charge every fill slot at the slowest rank's pace. The pipelined part m·T_max + bubble is at
least (m + (p−1)/v) · mean_r T_r, as the search's lower bound assumes: it is
(m − 1/v)·T_max + p·mean/v, and m ≥ 1/v, T_max ≥ mean. Against a timed run of the schedule
(``schedule.makespan_s``, tests): exact for GPipe; for 1F1B never below it, within a few
per cent typically and 25 % at most with stages up to 3× apart.

**Shared cores.** CPU ranks on one node share its cores: ``autoshard calibrate`` measures every
figure with all R ranks busy, min(1, C/R) of a core each (C = ``host.shared_cores``: the cores
over threads per rank). A pipeline rank idle in the fill, the drain or waiting on a peer lends
its core to the busy ones, so when C < R the pipelined part m·T_max + bubble is the schedule run
with processor sharing instead (``schedule.shared_makespan_s``: n ranks busy each progress at
min(1, C/n) / min(1, C/R) of their calibrated pace; F and B of a stage are its rank's compute
and, after it, its transfers and TP collectives as a wait that takes no core, both split by the
stages' compute). The bubble is then that span − m·T_max, which can be negative: on 4 ranks sharing 2
cores, pp = 4 and m = 4 a rank is busy half the time, and the others run twice as fast meanwhile.
Ranks of an SPMD step are busy and idle together (every collective spans them): no change there.

grad_accumulation and optimizer are priced on the rank with the most parameters.

TP × PP: each stage is split over tp as without pipelining (``pipeline_units``). The boundary
activation is whole on every TP rank; each TP rank sends its own copy to its peer in the next
stage, α + S/B on the pp link; a runtime that scatter-gathers (Megatron-LM, Narayanan et al.
§4.1) sends S/t per rank and all-gathers it on the TP link: p2p(S/t) + AG(S, t).

DP × PP is FSDP2 on each stage module (one unit): the stage's weights are gathered once and
kept unsharded until the last micro-batch, gradients accumulate unsharded and are reduce-
scattered once (``torch.distributed.pipelining`` turns resharding and gradient sync off
until the last backward). ZeRO-2: one all-gather and one reduce-scatter per step; ZeRO-3
gathers again around each micro-batch (2m all-gathers); DDP (ZeRO-0, Megatron-LM's
pipelines) one all-reduce after the flush. Nothing overlaps them: exposed.

**Memory** per rank (``memory_spmd`` / ``memory_pipeline``): model state by ZeRO stage over dp
(``memory.model_state_bytes``) of the rank's parameters (TP: sharded modules' weights / tp;
PP: its stages'); activations of one micro-batch times the micro-batches in flight
(``in_flight``): 1 without pipelining; GPipe m; 1F1B min(m, p − r) on rank r; interleaved
min(m, p − r + (p−1)/v) (Korthikanti et al.: p·(1 + (p−1)/(p·v)) on the first rank). With TP
a block keeps (10 + 24/t)/34 of its unsharded activations (Korthikanti et al., TP without
sequence parallelism); full recompute keeps the unsharded block inputs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from autoshard.cost import comm
from autoshard.cost.schedule import rank_orders, shared_makespan_s
from autoshard.cost.compute import ATTENTION_KERNELS, ComputeTime, model_flops_per_sample
from autoshard.cost.memory import (COMPUTE_HEAVY_TARGETS, Precision, model_state_bytes, precision_for_backend,
                                   precision_for_graph)
from autoshard.cost.profile import graph_signature, scaled_to
from autoshard.cost.units import Units, node_forward_s, node_units, stage_ranges, stage_units, unit_costs
from autoshard.ir.graph import OpGraph
from autoshard.ir.plan import Memory, Mesh, Predicted
from autoshard.ir.topology import Cluster, LinkSpec
from autoshard.passes.annotate import op_name
from autoshard.passes.blocks import block_of

ALLOCATOR_SLACK = 0.05  # caching-allocator fragmentation, a few % in practice (torch.cuda.memory_stats)
ADAM_BYTES_PER_PARAM = 28  # fp32 Adam step: read w, g, m, v (16 B), write w, m, v (12 B)
BUCKET_CAP_CHOICES_MB = (1.0, 5.0, 25.0, 100.0)  # DDP bucket sizes the cost model picks from
FULL_RECOMPUTE_TP_COMM = 1.5  # full recompute repeats the forward TP all-reduces (half of them)
CAPTURED_ELEM_BYTES = 4  # graphs are captured in fp32
SHARDED_STYLES = frozenset({"colwise", "colwise-gather", "rowwise", "conv1d-colwise", "conv1d-rowwise",
                            "vocab-parallel-embedding"})  # ParallelStyles whose op runs on 1/tp of the weight
SHARD_OUTPUT_STYLES = frozenset({"colwise", "conv1d-colwise"})  # ... and leaves its output sharded (S)
MIXED = "mixed"  # a configuration whose blocks recompute in different modes (Config.recompute_blocks)


def tp_activation_fraction(tp: int) -> float:
    """(10 + 24/t)/34: a TP block's activations over the unsharded ones (Korthikanti et al. 2022)."""
    return (10 + 24 / tp) / 34


@dataclass(frozen=True)
class Runtime:
    """What runs the plan, where that changes the price (module doc, "Runtime").

    ``for_cluster`` is autoshard's emitted program; other frameworks are described with the same
    fields (``benchmarks/bench_megatron.py`` describes Megatron-LM's to price its published rows).
    """

    precision: Precision
    attention: str = "flash"  # compute.ATTENTION_KERNELS
    p2p_scatter_gather: bool = False  # TP ranks send 1/t of a pipeline boundary each, then all-gather

    def __post_init__(self):
        assert self.attention in ATTENTION_KERNELS, self.attention

    @classmethod
    def for_cluster(cls, cluster: Cluster, graph: OpGraph | None = None) -> Runtime:
        """autoshard's programs: bf16 autocast (nccl) or fp32 (gloo), torch SDPA, one copy per TP rank;
        a model with 16-bit parameters trains in their dtype (``memory.precision_for_backend``)."""
        return cls(precision_for_graph(cluster.backend, graph) if graph is not None
                   else precision_for_backend(cluster.backend))


@dataclass(frozen=True)
class Config:
    """One point of the search space."""

    mesh: Mesh
    zero_stage: int
    microbatch_size: int
    num_microbatches: int
    recompute: str = "none"  # none | selective | full | mixed (then ``recompute_blocks``)
    schedule: str = "none"
    virtual_stages: int = 1
    ddp_bucket_cap_mb: float = 25.0
    recompute_blocks: tuple[str, ...] = ()  # mixed: each block's mode, in block order (passes.recompute)

    @property
    def num_stages(self) -> int:
        return self.mesh.pp * self.virtual_stages

    def block_modes(self, blocks: int) -> tuple[str, ...]:
        """Each block's recompute mode."""
        return self.recompute_blocks if self.recompute == MIXED else (self.recompute,) * blocks


@dataclass(frozen=True)
class CommTime:
    total_s: float
    exposed_s: float


@dataclass(frozen=True)
class TPCost:
    """A TP layout choice priced for one micro-batch size (see ``CostTables.tp_cost``)."""

    choice: object  # passes.tensor_parallel.TPChoice
    unit_fraction: tuple[float, ...]  # share of each unit's forward time left per rank (``unit_tp_fractions``)
    light_fraction: tuple[float, ...]  # the same over its non-matmul ops (what selective recompute reruns)
    comm_s: float  # TP collectives of one micro-batch (forward + backward)
    local_params: int  # parameters per rank: sharded modules' weights / tp
    largest_block_params: int  # the same, of the largest block (the largest FSDP unit)


class CostTables:
    """Quantities shared by many configurations, computed once per search and cached."""

    def __init__(self, graph: OpGraph, cluster: Cluster, runtime: Runtime | None = None):
        self.graph, self.cluster = graph, cluster
        self.runtime = runtime or Runtime.for_cluster(cluster, graph)
        self.precision = self.runtime.precision
        self._units: dict[tuple, Units] = {}
        self._tp: dict[tuple, TPCost] = {}
        self._memo: dict[tuple, object] = {}

    def memo(self, key: tuple, compute):
        """``compute()`` once per ``key`` (for other passes' per-search quantities, e.g. stage cuts)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def config_units(self, config: Config) -> Units:
        """``units`` of a configuration; mixed recompute takes each block's figures from its mode."""
        if config.recompute != MIXED:
            return self.units(config.microbatch_size, config.recompute)
        key = (config.microbatch_size, config.recompute_blocks)
        if key not in self._units:
            self._units[key] = mixed_units({m: self.units(config.microbatch_size, m) for m in set(key[1])}, key[1])
        return self._units[key]

    def units(self, microbatch_size: int, recompute: str) -> Units:
        """Per-unit costs of one micro-batch; scaled to the model's measured profile when the cluster
        has one for this graph (``cost.profile``)."""
        key = (microbatch_size, recompute)
        if key not in self._units:
            units = unit_costs(self.graph, microbatch_size, recompute, self.cluster.device,
                               self.precision.activation_bytes, CAPTURED_ELEM_BYTES, self.runtime.attention,
                               self.cluster.host, hides_comm(self.cluster))
            measured = self.profile.totals(microbatch_size, recompute) if self.profile else None
            self._units[key] = scaled_to(units, measured) if measured else units
        return self._units[key]

    @functools.cached_property
    def profile(self):
        """The model's measured profile on this cluster (``cost.profile.ModelProfile``), or None."""
        return self.cluster.profile_for(graph_signature(self.graph)) if self.cluster.profiles else None

    def tp_cost(self, tp: int, microbatch_size: int) -> TPCost:
        """The layout choice for micro-batch b, exact for it: with r = b/b₀ and e = a/captured,
        comm(S·r·e; α, B) = r·comm(S; α/r, B/e) and compute scales by r, so solving at the
        captured batch on the link (α/r, B/e) minimises r·(compute + comm) at b."""
        key = (tp, microbatch_size)
        if key not in self._tp:
            self._tp[key] = self._solve_tp(tp, microbatch_size)
        return self._tp[key]

    def _solve_tp(self, tp: int, microbatch_size: int) -> TPCost:
        from autoshard.passes.tensor_parallel import choose_tp_styles

        r = microbatch_size / self.graph.batch_size
        e = self.precision.activation_bytes / CAPTURED_ELEM_BYTES
        link = self.cluster.group_link(list(range(tp)))
        scaled = LinkSpec(link.bandwidth_gbps / e, link.latency_us / r, f"{link.source} (scaled to micro-batch)")
        choice = choose_tp_styles(self.graph, tp, scaled, self.cluster.device)
        largest = max(self.graph.blocks, key=lambda b: b.param_count).path if self.graph.blocks else None
        by_block = _local_params_by_block(self.graph, choice.sharded, tp)
        local = sum(by_block.values())
        block = by_block.get(largest, 0) if largest else local
        times = node_forward_s(self.graph, microbatch_size, self.cluster.device, self.precision.activation_bytes,
                               CAPTURED_ELEM_BYTES, self.runtime.attention)
        fractions = unit_tp_fractions(self.graph, choice.styles, tp, times)
        return TPCost(choice, *fractions, r * choice.comm_s, local, block)


def mixed_units(by_mode: dict[str, Units], modes: tuple[str, ...]) -> Units:
    """Units whose block k recomputes in ``modes[k]``: its recompute time, saved activations and
    workspace from that mode's units (forward and backward are the same in every mode)."""
    base = next(iter(by_mode.values()))

    def pick(field_name: str) -> tuple:
        values = list(getattr(base, field_name))
        for k, mode in enumerate(modes):
            values[k + 1] = getattr(by_mode[mode], field_name)[k + 1]
        return tuple(values)

    return replace(base, recompute_s=pick("recompute_s"), saved_bytes=pick("saved_bytes"),
                   workspace_bytes=pick("workspace_bytes"), host_recompute_s=pick("host_recompute_s"))


def sharded_nodes(graph: OpGraph, styles: dict[str, str]) -> set[str]:
    """The ops a TP layout runs on 1/tp of their data: linears / embeddings of a sharded style, and
    every op reading a sharded (S) value; S values are a colwise linear's output and the outputs of
    ops reading one, up to the rowwise linear that reduces them (the layout model allows S only
    there: ``passes.tensor_parallel``). Norms, residual adds and the rest stay replicated."""
    sharded: set[str] = set()
    split_values: set[str] = set()
    for node in graph.nodes:
        op = op_name(node.target)
        if op in ("linear", "addmm", "embedding") and node.module_path in styles:
            style = styles[node.module_path]
            if style in SHARDED_STYLES:
                sharded.add(node.name)
            if style in SHARD_OUTPUT_STYLES:
                split_values.add(node.name)
        elif any(name in split_values for name in node.inputs):
            sharded.add(node.name)
            split_values.add(node.name)
    return sharded


def unit_tp_fractions(graph: OpGraph, styles: dict[str, str], tp: int,
                      times: list[float]) -> tuple[tuple[float, ...], tuple[float, ...]]:
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


def _local_params_by_block(graph: OpGraph, sharded: dict[str, str], tp: int) -> dict[str | None, int]:
    """Parameters per TP rank of every block (None: outside blocks), in one pass: sharded modules'
    weights / tp; a row-parallel bias stays whole (RowwiseParallel replicates it)."""
    totals: dict[str | None, int] = {}
    for p in graph.params:
        if not p.is_buffer:
            style = sharded.get(p.module_path)
            split = style is not None and not (style == "rowwise" and p.name.endswith(".bias"))
            block = block_of(p.module_path)
            totals[block] = totals.get(block, 0) + (p.numel // tp if split else p.numel)
    return totals


def local_param_count(graph: OpGraph, sharded: dict[str, str], tp: int, block: str | None = None) -> int:
    """Parameters per TP rank, of ``block`` only if given (``_local_params_by_block``)."""
    totals = _local_params_by_block(graph, sharded, tp)
    return totals.get(block, 0) if block is not None else sum(totals.values())


def dp_group_ranks(mesh: Mesh) -> list[int]:
    """Ranks of the DP group of rank 0; the mesh is laid out (pp, dp, tp), tp innermost."""
    return [d * mesh.tp for d in range(mesh.dp)]


def pp_group_ranks(mesh: Mesh) -> list[int]:
    """Ranks of the PP group of rank 0: stage s on pp rank s mod pp."""
    return [k * mesh.dp * mesh.tp for k in range(mesh.pp)]


def stage_ranks(mesh: Mesh, stage: int) -> tuple[int, ...]:
    """Global ranks holding pipeline stage ``stage``: pp rank r = stage mod pp, all its dp × tp."""
    r = stage % mesh.pp
    return tuple(r * mesh.dp * mesh.tp + i for i in range(mesh.dp * mesh.tp))


def in_flight(schedule: str, m: int, pp: int, v: int, pp_rank: int) -> float:
    """Micro-batches whose activations rank ``pp_rank`` holds at its peak (module doc)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved-1f1b":
        return min(float(m), pp - pp_rank + (pp - 1) / v)
    return float(min(m, pp - pp_rank))


# ---------------------------------------------------------------------------- entry point


@dataclass(frozen=True)
class StepParts:
    """One step's time by named part (seconds); the fields add up to ``step_time_s`` (module doc).

    Pipelines: the compute parts are the slowest pp rank's (it sets the pace)."""

    forward_s: float
    backward_s: float
    recompute_s: float
    grad_accumulation_s: float
    optimizer_s: float
    tp_comm_s: float  # TP collectives, exposed: they sit between dependent matmuls
    p2p_s: float  # pipeline sends and receives, exposed
    dp_comm_exposed_s: float
    bubble_s: float
    dp_comm_total_s: float  # hidden or not (not part of the step time)
    memory: Memory
    host_s: float = 0.0  # host overheads not hidden by the device (module doc, "Host")

    @property
    def compute_s(self) -> float:
        return (self.forward_s + self.backward_s + self.recompute_s + self.grad_accumulation_s + self.optimizer_s
                + self.host_s)

    @property
    def comm_exposed_s(self) -> float:
        return self.tp_comm_s + self.p2p_s + self.dp_comm_exposed_s

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.comm_exposed_s + self.bubble_s


def price(graph: OpGraph, cluster: Cluster, config: Config, global_batch: int, tables: CostTables | None = None,
          cuts: tuple[int, ...] | None = None) -> Predicted:
    """Predicted step time, memory and throughput of ``config`` (module doc); pipelines need ``cuts``."""
    tables = tables or CostTables(graph, cluster)
    return _predicted(tables, config, global_batch, price_parts(tables, config, cuts))


def price_parts(tables: CostTables, config: Config, cuts: tuple[int, ...] | None = None) -> StepParts:
    """The step's time by part (``StepParts``) and its peak memory; pipelines need ``cuts``."""
    if config.mesh.pp > 1:
        assert cuts is not None and len(cuts) == config.num_stages - 1, "a pipeline is priced with its stage cuts"
        return pipeline_parts(tables, config, cuts)
    return spmd_parts(tables, config)


def price_spmd(tables: CostTables, config: Config, global_batch: int) -> Predicted:
    """pp = 1: DP (ZeRO 0-3) and TP (module doc)."""
    return _predicted(tables, config, global_batch, spmd_parts(tables, config))


def spmd_parts(tables: CostTables, config: Config) -> StepParts:
    graph, cluster, precision = tables.graph, tables.cluster, tables.precision
    micro, tp_comm_s, local = spmd_microbatch(tables, config)
    m = config.num_microbatches
    dp = dp_comm_time(graph, cluster, config, micro, precision, local)
    units = tables.config_units(config)
    tensors = param_tensors(graph)
    optimizer_s, optimizer_host = optimizer_parts(tables, config, local, tensors)
    tp_host_s = sum(tp_host_per_unit_s(tables, config))
    host_s = m * (sum(units.host_s) + tp_host_s) + \
        m * fsdp_host_s(cluster, config, len(graph.blocks) + 1, local, precision) + \
        optimizer_host + dp_host_s(cluster, config, tensors)
    return StepParts(
        forward_s=m * micro.forward_s, backward_s=m * micro.backward_s, recompute_s=m * micro.recompute_s,
        grad_accumulation_s=grad_accumulation_s(local, config, precision, cluster),
        optimizer_s=optimizer_s, tp_comm_s=m * tp_comm_s, p2p_s=0.0,
        dp_comm_exposed_s=dp.exposed_s, bubble_s=0.0, dp_comm_total_s=dp.total_s,
        memory=memory_spmd(tables, config, local), host_s=host_s)


def spmd_microbatch(tables: CostTables, config: Config) -> tuple[ComputeTime, float, int]:
    """(compute of one micro-batch per rank, its TP communication, parameters per rank)."""
    units = tables.config_units(config)
    if config.mesh.tp == 1:
        ones = (1.0,) * len(units.forward_s)
        return _compute_time(units, ones, ones), 0.0, tables.graph.param_count
    tp = tables.tp_cost(config.mesh.tp, config.microbatch_size)
    modes = config.block_modes(len(tables.graph.blocks))
    return _compute_time(units, *_fractions(tp, modes)), tp.comm_s * tp_comm_factor(modes), tp.local_params


def tp_comm_factor(modes: tuple[str, ...]) -> float:
    """TP collectives of a micro-batch over those without recompute: full recompute repeats a
    block's forward ones (FULL_RECOMPUTE_TP_COMM for the whole model), by the share of such blocks."""
    if not modes:
        return 1.0
    return 1.0 + (FULL_RECOMPUTE_TP_COMM - 1.0) * sum(m == "full" for m in modes) / len(modes)


def _fractions(tp: TPCost, modes: tuple[str, ...]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(forward, recompute) share per unit left per TP rank: a selective block reruns its light ops."""
    rerun = [tp.light_fraction[u] if 0 < u <= len(modes) and modes[u - 1] == "selective" else tp.unit_fraction[u]
             for u in range(len(tp.unit_fraction))]
    return tp.unit_fraction, tuple(rerun)


def _compute_time(units: Units, fraction: tuple[float, ...], recompute_fraction: tuple[float, ...]) -> ComputeTime:
    fwd = sum(f * x for f, x in zip(units.forward_s, fraction))
    bwd = sum(f * x for f, x in zip(units.backward_s, fraction))
    return ComputeTime(fwd, bwd, sum(f * x for f, x in zip(units.recompute_s, recompute_fraction)))


def optimizer_step_s(local_params: float, config: Config, cluster: Cluster) -> float:
    """Adam is memory-bound: bytes of the local shard of state over memory bandwidth."""
    shards = config.mesh.dp if config.zero_stage >= 1 else 1
    return local_params / shards * ADAM_BYTES_PER_PARAM / (cluster.device.memory_bandwidth_gbps * 1e9)


def hides_comm(cluster: Cluster) -> bool:
    """Whether collectives can run behind compute: on GPUs (own engines and streams), not on CPU
    ranks, where gloo's threads and the compute share the same cores."""
    return cluster.backend != "gloo"


def param_tensors(graph: OpGraph) -> int:
    """Parameter tensors of the model (not buffers; a tied one once)."""
    return sum(not p.is_buffer for p in graph.params)


def fsdp_host_s(cluster: Cluster, config: Config, units: int, params: float, precision: Precision) -> float:
    """FSDP2's host time per micro-batch over ``units`` units holding ``params`` parameters:
    U·a + c·MiB(params) (``HostOverheads``: per unit, and per MiB copied in and out); 0 without FSDP."""
    if config.mesh.dp == 1 or config.zero_stage < 2:
        return 0.0
    host, z3 = cluster.host, config.zero_stage == 3
    per_unit_us = host.fsdp_unit_zero3_us if z3 else host.fsdp_unit_zero2_us
    per_mib_us = host.fsdp_zero3_us_per_mib if z3 else host.fsdp_zero2_us_per_mib
    return (units * per_unit_us + per_mib_us * params * precision.param_bytes / 2**20) * 1e-6


def tp_host_per_unit_s(tables: CostTables, config: Config) -> tuple[float, ...]:
    """DTensor's host time per micro-batch in each unit: its modules of a sharded style × tp_module_us."""
    count = len(tables.graph.blocks) + 2
    if config.mesh.tp == 1 or not tables.cluster.host.tp_module_us:
        return (0.0,) * count
    sharded = tables.tp_cost(config.mesh.tp, config.microbatch_size).choice.sharded
    unit_of = {}
    for node, u in zip(tables.graph.nodes, node_units(tables.graph)):
        unit_of.setdefault(node.module_path, u)
    per_unit = [0.0] * count
    for path, style in sharded.items():
        if style in SHARDED_STYLES and path in unit_of:
            per_unit[unit_of[path]] += tables.cluster.host.tp_module_us * 1e-6
    return tuple(per_unit)


def dp_host_s(cluster: Cluster, config: Config, tensors: int) -> float:
    """DDP's hooks on the synchronising micro-batch, and ZeroRedundancyOptimizer's step, per tensor."""
    if config.mesh.dp == 1 or config.zero_stage >= 2:
        return 0.0
    host = cluster.host
    return tensors * (host.ddp_tensor_us + (host.zero1_tensor_us if config.zero_stage == 1 else 0.0)) * 1e-6


def optimizer_parts(tables: CostTables, config: Config, local_params: float, tensors: int) -> tuple[float, float]:
    """(optimizer_s, its host time): the model's measured AdamW step (``cost.profile``) over the rank's
    share of the parameters where there is one and the parameters are plain tensors; else the
    memory-bound formula and the per-tensor loop."""
    profile, cluster = tables.profile, tables.cluster
    sharded = config.mesh.dp > 1 and config.zero_stage >= 2
    if profile is not None and profile.optimizer_s and not sharded:
        shards = config.mesh.dp if config.zero_stage == 1 else 1
        return profile.optimizer_s * local_params / tables.graph.param_count / shards, 0.0
    return optimizer_step_s(local_params, config, cluster), optimizer_host_s(cluster, config, tensors)


def optimizer_host_s(cluster: Cluster, config: Config, tensors: int) -> float:
    """The optimizer's loop over its parameter tensors: T·h_opt (FSDP2: sharded tensors; ZeRO-1:
    each rank steps T/dp of them)."""
    host = cluster.host
    if config.mesh.dp > 1 and config.zero_stage >= 2:
        return tensors * host.sharded_optimizer_tensor_us * 1e-6
    shards = config.mesh.dp if config.zero_stage == 1 else 1
    return tensors / shards * host.optimizer_tensor_us * 1e-6


def grad_accumulation_s(local_params: float, config: Config, precision: Precision, cluster: Cluster) -> float:
    """(m − 1)·3·g·Ψ_acc / W: every micro-batch after the first adds its gradients to the sum (read both,
    write the sum; g bytes each). Ψ_acc: the rank's parameters, / dp where FSDP keeps the sum sharded
    (ZeRO-2/3 without pipelining; with pipelining the stage's gradients accumulate unsharded)."""
    shards = config.mesh.dp if config.zero_stage >= 2 and config.mesh.pp == 1 else 1
    moved = (config.num_microbatches - 1) * 3 * precision.grad_bytes * local_params / shards
    return moved / (cluster.device.memory_bandwidth_gbps * 1e9)


def memory_spmd(tables: CostTables, config: Config, local_params: int) -> Memory:
    precision, tp = tables.precision, config.mesh.tp
    p, g, o = model_state_bytes(local_params, config.zero_stage, config.mesh.dp, precision)
    units = tables.config_units(config)
    keep = tp_activation_fraction(tp)
    modes = config.block_modes(len(units.saved_bytes) - 2)
    blocks_kept = sum(saved * (1.0 if mode == "full" else keep) for saved, mode in zip(units.saved_bytes[1:-1], modes))
    acts = blocks_kept + units.saved_bytes[0] + units.saved_bytes[-1] + max(units.workspace_bytes) * keep
    return Memory.from_parts(ALLOCATOR_SLACK, params_bytes=p, grads_bytes=g, optimizer_bytes=o,
                             activations_bytes=int(acts), transient_bytes=transient_bytes(tables, config))


def transient_bytes(tables: CostTables, config: Config) -> int:
    """ZeRO-3: the unit being used and the one prefetched, unsharded, and one unit's gradients."""
    precision = tables.precision
    unit = fsdp_unit_params(tables, config) * precision.param_bytes
    if config.zero_stage == 3 and config.mesh.dp > 1:
        return 2 * unit + unit * precision.grad_bytes // precision.param_bytes
    if config.zero_stage == 2 and config.mesh.dp > 1:
        return unit * precision.grad_bytes // precision.param_bytes
    return 0


def fsdp_unit_params(tables: CostTables, config: Config) -> int:
    """Largest FSDP unit (a block) per rank: its weights, TP-sharded where the plan shards them."""
    graph = tables.graph
    if config.mesh.tp > 1:
        return tables.tp_cost(config.mesh.tp, config.microbatch_size).largest_block_params
    return max((b.param_count for b in graph.blocks), default=graph.param_count)


# ---------------------------------------------------------------------------- data parallel


def dp_comm_time(graph: OpGraph, cluster: Cluster, config: Config, micro: ComputeTime, precision: Precision,
                 params: float | None = None) -> CommTime:
    """DP collectives of one step (module doc); ``params`` per rank, default Ψ/(tp·pp)."""
    if config.mesh.dp == 1:
        return CommTime(0.0, 0.0)
    params = graph.param_count / (config.mesh.tp * config.mesh.pp) if params is None else params
    if config.zero_stage <= 1:
        return _ddp_comm(cluster, params, config, micro, precision, param_tensors(graph))
    return _fsdp_comm(graph, cluster, params, config, micro, precision)


def dp_collective_s(kind: str, size_bytes: float, mesh: Mesh, cluster: Cluster) -> float:
    """``kind`` ∈ {allreduce, reduce_scatter, all_gather} over the dp group: flat ring on the
    group's link, or the two-level form when that is cheaper (module doc)."""
    link, g = dp_group_shape(cluster, mesh)
    flat = {"allreduce": comm.allreduce_s, "reduce_scatter": comm.reduce_scatter_s,
            "all_gather": comm.all_gather_s}[kind](size_bytes, mesh.dp, link)
    n = mesh.dp // g
    if n == 1 or g == 1 or mesh.dp % g:
        return flat
    intra = cluster.intra_node
    if kind == "allreduce":
        two_level = comm.hierarchical_allreduce_s(size_bytes, g, n, intra, link)
    elif kind == "reduce_scatter":
        two_level = comm.reduce_scatter_s(size_bytes, g, intra) + comm.reduce_scatter_s(size_bytes / g, n, link)
    else:
        two_level = comm.all_gather_s(size_bytes / g, n, link) + comm.all_gather_s(size_bytes, g, intra)
    return min(flat, two_level)


@functools.lru_cache(maxsize=256)
def dp_group_shape(cluster: Cluster, mesh: Mesh) -> tuple[LinkSpec, int]:
    """(the dp group's link, its members on one node); cached: group_link walks the topology graph."""
    ranks = dp_group_ranks(mesh)
    return cluster.group_link(ranks), sum(cluster.node_of(r) == 0 for r in ranks)


@functools.lru_cache(maxsize=256)
def pp_link(cluster: Cluster, mesh: Mesh) -> LinkSpec:
    """The link between consecutive pipeline stages (pp ranks 0 and 1)."""
    return cluster.group_link(pp_group_ranks(mesh)[:2])


def choose_bucket_cap_mb(graph: OpGraph, cluster: Cluster, config: Config, tables: CostTables | None = None) -> float:
    """The DDP bucket size (from BUCKET_CAP_CHOICES_MB) with the least exposed communication."""
    if config.zero_stage >= 2 or config.mesh.dp == 1 or config.mesh.pp > 1:
        return config.ddp_bucket_cap_mb
    tables = tables or CostTables(graph, cluster)
    micro, _, local = spmd_microbatch(tables, config)

    def exposed(cap_mb: float) -> float:
        trial = replace(config, ddp_bucket_cap_mb=cap_mb)
        return dp_comm_time(graph, cluster, trial, micro, tables.precision, local).exposed_s

    return min(BUCKET_CAP_CHOICES_MB, key=lambda cap: (exposed(cap), cap))


def _ddp_comm(cluster: Cluster, params: float, config: Config, micro: ComputeTime, precision: Precision,
              tensors: int = 1) -> CommTime:
    mesh = config.mesh
    grad_bytes = params * precision.grad_bytes
    buckets = max(1, math.ceil(grad_bytes / (config.ddp_bucket_cap_mb * 2**20)))
    per_bucket_s = dp_collective_s("allreduce", grad_bytes / buckets, mesh, cluster)
    allreduce_total_s = buckets * per_bucket_s
    hidden_s = micro.backward_s if hides_comm(cluster) else 0.0
    exposed_s = max(allreduce_total_s - hidden_s, per_bucket_s)
    if config.zero_stage == 1:  # ZeroRedundancyOptimizer broadcasts the updated shards
        gather_s = zero1_gather_s(params * precision.param_bytes, tensors, mesh, cluster)
        return CommTime(allreduce_total_s + gather_s, exposed_s + gather_s)
    return CommTime(allreduce_total_s, exposed_s)


def zero1_gather_s(size_bytes: float, tensors: int, mesh: Mesh, cluster: Cluster) -> float:
    """ZeroRedundancyOptimizer's all-gather of the updated weights is one broadcast per parameter
    tensor from the rank that owns it: an all-gather's bytes, and T − 1 more broadcast latencies,
    (T − 1)·(dp − 1)·α_broadcast. It issues them all at once (async), so where ``calibrate`` measured
    what a tensor costs as issued (``host.zero1_tensor_us``, in ``dp_host_s``) that replaces the formula."""
    gather_s = dp_collective_s("all_gather", size_bytes, mesh, cluster)
    if cluster.host.zero1_tensor_us > 0:
        return gather_s
    link, _ = dp_group_shape(cluster, mesh)
    latency_us = link.for_collective("broadcast").latency_us
    return gather_s + max(0.0, (tensors - 1) * (mesh.dp - 1) * latency_us * 1e-6)


def per_unit_collectives_s(kind: str, total_bytes: float, units: int, mesh: Mesh, cluster: Cluster) -> float:
    """FSDP2 runs one collective per unit, each paying the group's latency: U · C(S / U) for S bytes
    over U units (exact for equal units; the α-β forms are affine in S, so unequal units move only
    which of the flat and two-level forms is cheaper)."""
    return units * dp_collective_s(kind, total_bytes / units, mesh, cluster)


def _fsdp_comm(graph: OpGraph, cluster: Cluster, params: float, config: Config, micro: ComputeTime,
               precision: Precision) -> CommTime:
    mesh, units = config.mesh, max(1, len(graph.blocks)) + 1
    gather_s = per_unit_collectives_s("all_gather", params * precision.activation_bytes, units, mesh, cluster)
    scatter_s = per_unit_collectives_s("reduce_scatter", params * precision.grad_bytes, units, mesh, cluster)
    regather_s = gather_s if config.zero_stage == 3 else 0.0
    fwd_s, bwd_s = micro.forward_s, micro.backward_s + micro.recompute_s
    if hides_comm(cluster):
        fwd_exposed = max(gather_s - fwd_s, gather_s / units)
        bwd_exposed = max(regather_s + scatter_s - bwd_s, scatter_s / units)
    else:  # CPU ranks: only the waiting hides (module doc)
        gather_wait = per_unit_collectives_s("all_gather", 0.0, units, mesh, cluster)
        scatter_wait = per_unit_collectives_s("reduce_scatter", 0.0, units, mesh, cluster)
        regather_wait = gather_wait if config.zero_stage == 3 else 0.0
        fwd_exposed = gather_s - gather_wait + max(gather_wait - fwd_s, gather_wait / units)
        bwd_exposed = regather_s + scatter_s - regather_wait - scatter_wait + \
            max(regather_wait + scatter_wait - bwd_s, scatter_wait / units)
    m = config.num_microbatches
    return CommTime(m * (gather_s + regather_s + scatter_s), m * (fwd_exposed + bwd_exposed))


# ---------------------------------------------------------------------------- pipeline


@dataclass(frozen=True)
class RankLoad:
    """One pp rank's per-micro-batch work and its memory."""

    forward_s: float
    backward_s: float
    recompute_s: float
    p2p_s: float  # pipeline sends and receives of its stages' boundaries
    tp_comm_s: float  # its stages' TP collectives
    params: int
    memory: Memory
    host_s: float = 0.0  # its stages' host time (ops, schedule, FSDP hooks), not hidden by the device
    tensors: int = 0  # parameter tensors of its stages

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s + self.host_s

    @property
    def time_s(self) -> float:
        return self.compute_s + self.p2p_s + self.tp_comm_s


def price_pipeline(tables: CostTables, config: Config, global_batch: int, cuts: tuple[int, ...]) -> Predicted:
    """pp > 1 (module doc): the slowest rank sets the pace; the worst rank's memory is the peak."""
    return _predicted(tables, config, global_batch, pipeline_parts(tables, config, cuts))


def pipeline_parts(tables: CostTables, config: Config, cuts: tuple[int, ...]) -> StepParts:
    cluster, precision = tables.cluster, tables.precision
    loads = rank_loads(tables, config, cuts)
    slowest = max(loads, key=lambda r: r.time_s)
    m, v = config.num_microbatches, config.virtual_stages
    params = max(r.params for r in loads)
    dp = pipeline_dp_comm(cluster, config, params, precision)
    optimizer_s, optimizer_host = optimizer_parts(tables, config, params, max(r.tensors for r in loads))
    host_s = m * slowest.host_s + optimizer_host + cluster.host.pipeline_step_us * 1e-6
    span_s = pipeline_span_s(tables, config, cuts, loads)
    return StepParts(
        forward_s=m * slowest.forward_s, backward_s=m * slowest.backward_s,
        recompute_s=m * slowest.recompute_s, grad_accumulation_s=grad_accumulation_s(params, config, precision, cluster),
        optimizer_s=optimizer_s, tp_comm_s=m * slowest.tp_comm_s,
        p2p_s=m * slowest.p2p_s, dp_comm_exposed_s=dp.exposed_s,
        bubble_s=span_s - m * slowest.time_s,
        dp_comm_total_s=dp.total_s, memory=max((r.memory for r in loads), key=lambda mem: mem.peak_bytes),
        host_s=host_s)


def pipeline_span_s(tables: CostTables, config: Config, cuts: tuple[int, ...], loads: list[RankLoad]) -> float:
    """The pipelined part of the step: m·T_max + (Σ_r T_r − T_max)/v (module doc); on a host whose
    ranks share fewer cores (``shared_cores``), the schedule run with processor sharing."""
    m, v = config.num_microbatches, config.virtual_stages
    times = [r.time_s for r in loads]
    cores = shared_cores(tables.cluster, config.mesh)
    if cores is None:
        return m * max(times) + (sum(times) - max(times)) / v
    forward, backward, forward_wait, backward_wait = stage_action_times(tables, config, cuts, loads)
    orders = rank_orders(config.schedule, config.mesh.pp, m, v)
    return shared_makespan_s(orders, len(forward), forward, backward, config.mesh.dp * config.mesh.tp, cores,
                             forward_wait, backward_wait)


def shared_cores(cluster: Cluster, mesh: Mesh) -> float | None:
    """C when the mesh's R ranks sit on one node that runs only C < R of them at full speed at once
    (CPU ranks: ``HostOverheads.shared_cores``); None when every rank has its own core or device."""
    cores, ranks = cluster.host.shared_cores, mesh.dp * mesh.tp * mesh.pp
    if not cores or ranks <= cores or ranks > cluster.devices_per_node:
        return None
    return cores


def stage_action_times(tables: CostTables, config: Config, cuts: tuple[int, ...], loads: list[RankLoad]
                       ) -> tuple[list[float], list[float], list[float], list[float]]:
    """(F work, B work, F wait, B wait) seconds of one micro-batch on each stage: its rank's compute
    (with host time) and its transfers and TP collectives (``RankLoad``) shared among the rank's
    stages by their compute, and within a stage between forward and backward + recompute the same way."""
    units, _ = pipeline_units(tables, config)
    ranges = stage_ranges(cuts, units.blocks)
    parts = []
    for rng in ranges:
        idx = stage_units(rng, units.blocks)
        parts.append((sum(units.forward_s[u] for u in idx),
                      sum(units.backward_s[u] + units.recompute_s[u] for u in idx)))
    pp = config.mesh.pp
    rank_compute = [sum(f + b for f, b in parts[r::pp]) for r in range(pp)]
    out: tuple[list[float], ...] = ([], [], [], [])
    for s, (f, b) in enumerate(parts):
        load, total = loads[s % pp], rank_compute[s % pp]
        work, wait = (load.compute_s / total, (load.p2p_s + load.tp_comm_s) / total) if total else (0.0, 0.0)
        for column, value in zip(out, (f * work, b * work, f * wait, b * wait)):
            column.append(value)
    return out


def rank_loads(tables: CostTables, config: Config, cuts: tuple[int, ...]) -> list[RankLoad]:
    units, tp_comm = pipeline_units(tables, config)
    tp_host = tp_host_per_unit_s(tables, config)
    ranges = stage_ranges(cuts, units.blocks)
    loads = []
    for r in range(config.mesh.pp):
        mine = [(s, ranges[s]) for s in range(r, len(ranges), config.mesh.pp)]
        idx = [u for s, rng in mine for u in stage_units(rng, units.blocks)]
        p2p = sum(2 * boundary_transfer_s(tables, config, units.boundary_bytes[i]) for s, (i, _) in mine if s > 0)
        params = sum(units.params[u] for u in idx)
        acts = in_flight(config.schedule, config.num_microbatches, config.mesh.pp, config.virtual_stages, r) * \
            sum(units.saved_bytes[u] for u in idx) + max(units.workspace_bytes[u] for u in idx)
        host_s = sum(units.host_s[u] + tp_host[u] for u in idx) + \
            len(mine) * tables.cluster.host.pipeline_microbatch_us * 1e-6 \
            + fsdp_host_s(tables.cluster, config, len(mine), params, tables.precision)  # FSDP2: a unit per stage
        loads.append(RankLoad(sum(units.forward_s[u] for u in idx), sum(units.backward_s[u] for u in idx),
                              sum(units.recompute_s[u] for u in idx), p2p,
                              sum(tp_comm[u] for u in idx), params,
                              memory_pipeline(tables.precision, config, params, acts), host_s,
                              sum(units.tensors[u] for u in idx)))
    return loads


def boundary_transfer_s(tables: CostTables, config: Config, size_bytes: float) -> float:
    """One pipeline boundary of S bytes, one way: each TP rank sends its whole copy to its peer,
    α + S/B on the pp link; or, with the runtime's scatter-gather (Narayanan et al. §4.1), 1/t of it,
    then the t receivers all-gather: p2p(S/t) + AG(S, t) on the TP link."""
    link, tp = pp_link(tables.cluster, config.mesh), config.mesh.tp
    if not tables.runtime.p2p_scatter_gather or tp == 1:
        return comm.p2p_s(size_bytes, link)
    return comm.p2p_s(size_bytes / tp, link) + comm.all_gather_s(size_bytes, tp, tp_link(tables.cluster, tp))


@functools.lru_cache(maxsize=64)
def tp_link(cluster: Cluster, tp: int) -> LinkSpec:
    """The link of the TP group of rank 0 (ranks 0 .. tp − 1)."""
    return cluster.group_link(list(range(tp)))


def pipeline_units(tables: CostTables, config: Config) -> tuple[Units, tuple[float, ...]]:
    """``tp_sharded_units``, once per (micro-batch, recompute, tp) in a search."""
    key = ("pipeline_units", config.microbatch_size, config.recompute, config.mesh.tp)
    return tables.memo(key, lambda: tp_sharded_units(tables, config))


def tp_sharded_units(tables: CostTables, config: Config) -> tuple[Units, tuple[float, ...]]:
    """The units of one micro-batch as one TP rank of a stage sees them, and each unit's TP comm.

    With tp = t > 1 (the layout choice of ``CostTables.tp_cost``): per unit u, forward and
    recompute × their shares left per rank (``unit_tp_fractions``; selective recompute: of the
    light ops), parameters × local(u)/params(u) (sharded weights / t), a block's
    saved activations and workspace × (10 + 24/t)/34; TP collectives of a block are its
    segment's, those of the ops outside blocks are split evenly over prefix and suffix. They
    sit between dependent matmuls, so they count with the compute of the unit (exposed).
    """
    units = tables.units(config.microbatch_size, config.recompute)
    tp = config.mesh.tp
    if tp == 1:
        return units, (0.0,) * len(units.forward_s)
    cost = tables.tp_cost(tp, config.microbatch_size)
    (f, f_recompute), keep = _fractions(cost, config.block_modes(units.blocks)), tp_activation_fraction(tp)
    share = _unit_param_share(tables.graph, cost.choice.sharded, tp)
    blocks = [1.0] + [keep] * units.blocks + [1.0]
    sharded = replace(
        units,
        forward_s=tuple(x * k for x, k in zip(units.forward_s, f)),
        backward_s=tuple(x * k for x, k in zip(units.backward_s, f)),
        recompute_s=tuple(x * k for x, k in zip(units.recompute_s, f_recompute)),
        params=tuple(round(n * k) for n, k in zip(units.params, share)),
        saved_bytes=tuple(round(x * k) for x, k in zip(units.saved_bytes, blocks)),
        workspace_bytes=tuple(round(x * k) for x, k in zip(units.workspace_bytes, blocks)))
    return sharded, _unit_tp_comm(tables.graph, cost, tp_comm_factor(config.block_modes(units.blocks)))


def _unit_param_share(graph: OpGraph, sharded: dict[str, str], tp: int) -> tuple[float, ...]:
    """Per unit: parameters left per TP rank over all its parameters (blocks each; the rest pooled)."""
    local = _local_params_by_block(graph, sharded, tp)
    per_block = [local.get(b.path, 0) / max(1, b.param_count) for b in graph.blocks]
    in_blocks = sum(b.param_count for b in graph.blocks)
    local_blocks = sum(local.get(b.path, 0) for b in graph.blocks)
    rest = graph.param_count - in_blocks
    rest_share = (local_param_count(graph, sharded, tp) - local_blocks) / rest if rest else 1.0
    return (rest_share, *per_block, rest_share)


def _unit_tp_comm(graph: OpGraph, cost: TPCost, factor: float) -> tuple[float, ...]:
    """Per unit: TP collectives of one micro-batch (``TPCost.comm_s`` is their sum over units)."""
    total = sum(s.comm_s * s.repeats for s in cost.choice.segments)
    scale = cost.comm_s * factor / total if total else 0.0
    by_path = {s.path: s.comm_s * scale for s in cost.choice.segments}
    rest = by_path.get("", 0.0) / 2
    return (rest, *(by_path.get(b.representative, 0.0) for b in graph.blocks), rest)


def memory_pipeline(precision: Precision, config: Config, params: int, activations: float) -> Memory:
    p, g, o = model_state_bytes(params, config.zero_stage, config.mesh.dp, precision)
    return Memory.from_parts(ALLOCATOR_SLACK, params_bytes=p, grads_bytes=g, optimizer_bytes=o,
                             activations_bytes=int(activations),
                             transient_bytes=int(pipeline_transient_per_param(precision, config) * params))


def pipeline_transient_per_param(precision: Precision, config: Config) -> float:
    """FSDP on a stage keeps the gradients (and ZeRO-3's gathered weights) unsharded all step."""
    dp = config.mesh.dp
    if dp == 1 or config.zero_stage < 2:
        return 0.0
    spread = 1 - 1 / dp
    return precision.grad_bytes * spread + (precision.param_bytes * spread if config.zero_stage == 3 else 0.0)


def state_bytes_per_param(precision: Precision, config: Config) -> float:
    """Weights, gradients, optimizer state and FSDP transients per parameter of a stage."""
    dp = config.mesh.dp
    p, g, o = precision.param_bytes, precision.grad_bytes, precision.optimizer_bytes
    z = config.zero_stage
    state = p / (dp if z >= 3 else 1) + g / (dp if z >= 2 else 1) + o / (dp if z >= 1 else 1)
    return state + pipeline_transient_per_param(precision, config)


def pipeline_dp_comm(cluster: Cluster, config: Config, params: int, precision: Precision) -> CommTime:
    """Per stage over dp, all exposed: FSDP ZeRO-2 one gather + one scatter per step, ZeRO-3 2m gathers;
    DDP (ZeRO-0, as Megatron-LM's pipelines) one all-reduce of the gradients after the flush,
    ZeRO-1 that and an all-gather of the updated weights."""
    if config.mesh.dp == 1:
        return CommTime(0.0, 0.0)
    if config.zero_stage <= 1:
        total = dp_collective_s("allreduce", params * precision.grad_bytes, config.mesh, cluster)
        if config.zero_stage == 1:
            total += dp_collective_s("all_gather", params * precision.param_bytes, config.mesh, cluster)
        return CommTime(total, total)
    gather_s = dp_collective_s("all_gather", params * precision.activation_bytes, config.mesh, cluster)
    scatter_s = dp_collective_s("reduce_scatter", params * precision.grad_bytes, config.mesh, cluster)
    gathers = 2 * config.num_microbatches if config.zero_stage == 3 else 1
    total = gathers * gather_s + scatter_s
    return CommTime(total, total)


# ---------------------------------------------------------------------------- result


def _predicted(tables: CostTables, config: Config, global_batch: int, parts: StepParts) -> Predicted:
    graph, cluster = tables.graph, tables.cluster
    step_s = parts.step_time_s
    flops = global_batch * model_flops_per_sample(graph)
    return Predicted(
        step_time_s=step_s,
        compute_s=parts.compute_s,
        comm_exposed_s=parts.comm_exposed_s,
        bubble_s=parts.bubble_s,
        memory_peak_bytes_per_rank=parts.memory.peak_bytes,
        memory=parts.memory,
        tokens_per_s=global_batch * graph.tokens_per_sample / step_s,
        samples_per_s=global_batch / step_s,
        mfu=flops / (step_s * config.mesh.world_size * cluster.device.peak_tflops * 1e12),
        comm_total_s=parts.tp_comm_s + parts.p2p_s + parts.dp_comm_total_s,
    )
