"""The cost tables of one search: what runs the plan, per-unit costs, the TP layouts handed in.

**Runtime** (``Runtime``): what executes the plan changes four things: the precision (bytes of
weights, gradients, optimizer state, activations), the attention kernel (``compute``: flash, or
scores materialized in HBM), the kernels (``compute.KERNELS``: "eager", PyTorch's one kernel per op,
fp32 loss and foreach AdamW, ``cost.eager``; or "fused", the plain roofline), and whether TP ranks
scatter-gather pipeline boundaries. autoshard's own programs are ``Runtime.for_cluster``: eager on
GPUs (NCCL), fused on CPU ranks (gloo: their figures are measured by ``autoshard calibrate``, the
roofline with measured host time is what they were calibrated against);
``benchmarks/bench_megatron.py`` describes Megatron-LM (fused).

The host time per op: the cluster's measured ``HostOverheads`` where it has them; else, for eager
kernels on GPUs, ``cost.eager``'s published dispatch and launch figures (``Runtime.host_for``).

``CostTables`` holds what many decisions share, computed once per search: each micro-batch size
and recompute mode's per-unit costs (``cost.units``, scaled to the model's measured profile where
the cluster has one: ``cost.profile``), and the TP layouts the passes solved and handed in
(``add_tp_layout``), each priced once for its (tp, b) (``cost.tp.price_layout``). The tables
never solve a layout: ``tp_solve_link`` says on which link one is exact for micro-batch b.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from autoshard.cost import eager
from autoshard.cost.autocast import Autocast
from autoshard.cost.compute import ATTENTION_KERNELS, KERNELS
from autoshard.cost.float8 import Float8, float8_of
from autoshard.cost.memory import (
    MEGATRON_MIXED,
    Precision,
    pinned_precision,
    precision_for_backend,
    precision_for_graph,
)
from autoshard.cost.profile import graph_signature, scaled_to
from autoshard.cost.saved import WHOLE, RankShare
from autoshard.cost.tp import TPCost, price_layout, rank_share
from autoshard.cost.units import (
    Units,
    node_forward_s,
    unit_activation_bytes,
    unit_costs,
    unit_weight_grad_bytes,
)
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import MIXED, Decisions, TPChoice
from autoshard.ir.graph import OpGraph
from autoshard.ir.profile import ModelProfile
from autoshard.ir.topology import Cluster, HostOverheads, LinkSpec

CAPTURED_ELEM_BYTES = 4  # graphs are captured in fp32


@dataclass(frozen=True)
class Runtime:
    """What runs the plan, where that changes the price (module doc, "Runtime").

    ``for_cluster`` is autoshard's emitted program; other frameworks are described with the same
    fields (``benchmarks/bench_megatron.py`` describes Megatron-LM's to price its published rows).
    """

    precision: Precision
    attention: str = "flash"  # compute.ATTENTION_KERNELS
    p2p_scatter_gather: bool = False  # TP ranks send 1/t of a pipeline boundary each, then all-gather
    kernels: str = "fused"  # compute.KERNELS: "eager" (autoshard's programs on GPUs) or "fused"

    def __post_init__(self):
        assert self.attention in ATTENTION_KERNELS, self.attention
        assert self.kernels in KERNELS, self.kernels

    @property
    def optimizer_bytes_per_param(self) -> int:
        """Bytes AdamW moves per parameter it steps: torch's foreach step (eager), a fused step (fused)."""
        return eager.ADAMW_FOREACH_BYTES_PER_PARAM if self.kernels == "eager" else ADAM_FUSED_BYTES_PER_PARAM

    def autocast_for(self, fsdp2: bool) -> Autocast | None:
        """(autocast dtype, the dtype parameters are read in) where eager kernels run under autocast
        (``cost.autocast``), else None: fp32 weights under DDP (autocast casts them), the 16-bit
        param_dtype of FSDP2's MixedPrecisionPolicy where FSDP2's wrappers run (``fsdp2``: every tp or pp
        plan, ZeRO-2 and 3; ``ir.decisions.DPRuntime.fsdp2``)."""
        low = {"bf16-autocast": "bfloat16", "fp16-autocast": "float16"}.get(self.precision.name)
        if self.kernels != "eager" or low is None:
            return None
        return (low, low if fsdp2 else None)

    def host_for(self, cluster: Cluster) -> HostOverheads:
        """The cluster's measured host figures; unmeasured, eager kernels on GPUs take ``EAGER_GPU_HOST``."""
        if cluster.host.measured or self.kernels != "eager" or cluster.backend == "gloo":
            return cluster.host
        return EAGER_GPU_HOST

    @classmethod
    def for_cluster(cls, cluster: Cluster, graph: OpGraph | None = None, precision: str | None = None) -> Runtime:
        """autoshard's programs: bf16 autocast (nccl) or fp32 (gloo), torch SDPA, one copy per TP rank;
        a model with 16-bit parameters trains in their dtype (``memory.precision_for_backend``); ``precision``:
        the one ``--precision`` pins (``memory.pinned_precision``); eager kernels on GPUs, the fused roofline on
        CPU ranks (module doc)."""
        if precision is not None:
            precision = (
                precision_for_graph(cluster.backend, graph, precision)
                if graph is not None
                else pinned_precision(precision)
            )
        else:
            precision = (
                precision_for_graph(cluster.backend, graph)
                if graph is not None
                else precision_for_backend(cluster.backend)
            )
        return cls(precision, kernels="fused" if cluster.backend == "gloo" else "eager")

    @classmethod
    def named(cls, name: str, cluster: Cluster, graph: OpGraph | None = None, precision: str | None = None) -> Runtime:
        """The runtime called ``name`` (``RUNTIME_NAMES``): "autoshard" (the emitted programs,
        ``for_cluster``) or "megatron-lm" (Megatron-LM as its SC21 / 2022 papers ran: fp16 weights
        and gradients with fp32 Adam state, attention scores through HBM, pipeline boundaries
        scatter-gathered over the TP ranks), to price published configurations as they were run."""
        if name == "autoshard":
            return cls.for_cluster(cluster, graph, precision)
        if name == "megatron-lm":
            return cls(MEGATRON_MIXED, attention="materialized", p2p_scatter_gather=True, kernels="fused")
        raise AutoshardError(f"unknown runtime {name!r}; use one of {', '.join(RUNTIME_NAMES)}")


RUNTIME_NAMES = ("autoshard", "megatron-lm")  # Runtime.named
ADAM_FUSED_BYTES_PER_PARAM = 28  # fp32 Adam step in one kernel: read w, g, m, v (16 B), write w, m, v (12 B)
# eager PyTorch's host time per op on a GPU (cost.eager module doc, "Host": pytorch/pytorch#41383 and
# NVIDIA's "Getting Started with CUDA Graphs"); the rest not measured (0)
EAGER_GPU_HOST = replace(
    HostOverheads.none(),
    op_forward_us=eager.HOST_FORWARD_OP_US,
    op_backward_us=eager.HOST_BACKWARD_OP_US,
    source="published per-op dispatch and launch figures (cost.eager); not measured",
)


class CostTables:
    """Quantities shared by many decisions, computed once per search and cached; the TP layouts
    the passes hand in (``add_tp_layout``), priced once."""

    def __init__(self, graph: OpGraph, cluster: Cluster, runtime: Runtime | None = None):
        self.graph, self.cluster = graph, cluster
        self.runtime = runtime or Runtime.for_cluster(cluster, graph)
        self.precision = self.runtime.precision
        self._units: dict[tuple, Units] = {}
        self._tp: dict[tuple[int, int], TPCost] = {}
        self._memo: dict[tuple, Any] = {}
        self._layouts_from: CostTables | None = None  # a node group's tables: the whole cluster's (``group_tables``)

    def memo(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per ``key`` (for other passes' per-search quantities, e.g. stage cuts)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def config_units(self, config: Decisions) -> Units:
        """``units`` of a point; mixed recompute takes each block's figures from its mode."""
        b, recompute, autocast, compiled, float8, loss = self.unit_args(config)
        if recompute != MIXED:
            return self.units(b, recompute, autocast, compiled, float8, loss)
        key = (b, config.recompute_blocks, autocast, compiled) + ((float8,) if float8 else ()) + _loss_key(loss)
        if key not in self._units:
            self._units[key] = mixed_units(
                {m: self.units(b, m, autocast, compiled, float8, loss) for m in sorted(set(key[1]))}, key[1]
            )
        return self._units[key]

    def unit_args(self, config: Decisions) -> tuple[int, str, Autocast | None, bool, Float8 | None, bool]:
        """The ``units`` arguments of a point (with mixed recompute, its blocks' modes are ``recompute_blocks``)."""
        autocast = self.runtime.autocast_for(config.dp_runtime.fsdp2)
        return (
            config.microbatch_size,
            config.recompute,
            autocast,
            config.compile,
            self.float8_for(config),
            config.compile_loss,
        )

    def point_key(self, config: Decisions) -> tuple:
        """What one rank's units of a point are computed from: its ``units`` arguments, its blocks' recompute modes
        and its TP layout (``layout_key``). A memo of anything computed from a point's units or layout is keyed by
        all of it: a key naming fewer of the point's fields serves one point's figures to another."""
        return self.unit_args(config) + (config.recompute_blocks,) + layout_key(config)

    def float8_for(self, config: Decisions) -> Float8 | None:
        """(recipe, the linears it converts, the weights' cast share) of a point with float8 on (``cost.float8``),
        else None."""
        return float8_of(config, self.graph)

    def adopt_units(self, args: tuple, units: Units) -> None:
        """``units(*args)`` as another process computed it (``passes.planning.price_ahead.units_on_two_cores``)."""
        self._units.setdefault(_units_key(*args), units)

    def units(
        self,
        microbatch_size: int,
        recompute: str,
        autocast: Autocast | None = None,
        compiled: bool = False,
        float8: Float8 | None = None,
        compiled_loss: bool = False,
    ) -> Units:
        """Per-unit costs of one micro-batch (``autocast``: ``Runtime.autocast_for`` the plan; ``compiled``: its
        blocks compiled, ``cost.compiled``; ``float8``: ``float8_for`` the plan, ``cost.float8``;
        ``compiled_loss``: the loss compiled, ``cost.units``); scaled to the model's measured profile when the
        cluster has one for this graph (``cost.profile``)."""
        key = _units_key(microbatch_size, recompute, autocast, compiled, float8, compiled_loss)
        if key not in self._units:
            units = self._modelled_units(key, microbatch_size, recompute, autocast, compiled, float8, compiled_loss)
            measured = self.profile.totals(microbatch_size, recompute) if self.profile else None
            if measured and (compiled or float8 or compiled_loss):  # the profile times the eager model only
                eager = self._modelled_units(
                    _units_key(microbatch_size, recompute, autocast), microbatch_size, recompute, autocast
                )
                measured = variant_totals(measured, units, eager)
            self._units[key] = scaled_to(units, measured) if measured else units
        return self._units[key]

    def _modelled_units(self, key: tuple, microbatch_size: int, recompute: str, *variant) -> Units:
        """``unit_costs`` of the point, as the cost model prices it (before any profile), once per ``key``."""
        return self.memo(
            ("modelled_units", key),
            lambda: unit_costs(
                self.graph,
                microbatch_size,
                recompute,
                self.cluster.device,
                self.precision.activation_bytes,
                CAPTURED_ELEM_BYTES,
                self.runtime.attention,
                self.runtime.host_for(self.cluster),
                hides_comm(self.cluster),
                self.runtime.kernels,
                *variant,
            ),
        )

    @functools.cached_property
    def profile(self) -> ModelProfile | None:
        """The model's measured profile on this cluster, or None."""
        return self.cluster.profile_for(graph_signature(self.graph)) if self.cluster.profiles else None

    def tp_solve_link(self, tp: int, microbatch_size: int) -> LinkSpec:
        """The link on which a layout solved at the captured batch is exact for micro-batch b: with
        r = b/b₀ and e = a/captured, comm(S·r·e; α, B) = r·comm(S; α/r, B/e) and compute scales by r,
        so solving at the captured batch on the link (α/r, B/e) minimises r·(compute + comm) at b.
        α is each collective's own (``LinkSpec.collectives``, as calibrate fits them) plus what one issued
        between compute waits beyond it (``HostOverheads.collective_wait_us``)."""
        r = microbatch_size / self.graph.batch_size
        e = self.precision.activation_bytes / CAPTURED_ELEM_BYTES
        link = self.cluster.group_link(list(range(tp)))
        wait_us = self.cluster.host.collective_wait_us
        collectives = tuple((name, (lat + wait_us) / r, bw / e) for name, lat, bw in link.collectives)
        return LinkSpec(
            link.bandwidth_gbps / e,
            (link.latency_us + wait_us) / r,
            f"{link.source} (scaled to micro-batch)",
            collectives,
        )

    def has_tp_layout(
        self, tp: int, microbatch_size: float, sequence_parallel: bool = False, loss_parallel: bool = False
    ) -> bool:
        """Whether a layout for (tp, b, sequence parallelism asked for, loss parallelism asked for) was handed in."""
        return (tp, microbatch_size, sequence_parallel, loss_parallel) in self._tp

    def add_tp_layout(
        self,
        choice: TPChoice,
        microbatch_size: float,
        sequence_parallel: bool | None = None,
        loss_parallel: bool | None = None,
    ) -> TPCost:
        """Price the layout solved for micro-batch b (on ``tp_solve_link``) for every point of its
        (tp, b, sequence parallelism asked for, loss parallelism asked for: the choice's own unless given)
        (``cost.tp.price_layout``)."""
        times = node_forward_s(
            self.graph,
            microbatch_size,
            self.cluster.device,
            self.precision.activation_bytes,
            CAPTURED_ELEM_BYTES,
            self.runtime.attention,
            self.runtime.kernels,
            self.runtime.autocast_for(fsdp2=True),
        )  # tp runs on FSDP2's wrappers
        cost = price_layout(self.graph, choice, microbatch_size / self.graph.batch_size, times)
        asked = choice.sequence_parallel if sequence_parallel is None else sequence_parallel
        vocab = choice.loss_parallel if loss_parallel is None else loss_parallel
        self._tp[(choice.tp, microbatch_size, asked, vocab)] = cost
        return cost

    def group_tables(self, index: int) -> CostTables:
        """The tables of node group ``index`` of a heterogeneous cluster: its own device and links
        (``Cluster.group_clusters``), this search's runtime, and the TP layouts handed to these tables, priced again
        on its device (``tp_cost``). A pipeline stage's units are priced on the group its ranks are in."""

        def make() -> CostTables:
            sub = CostTables(self.graph, self.cluster.group_clusters[index], self.runtime)
            sub._layouts_from = self
            return sub

        return self.memo(("group_tables", index), make)

    def pp_rank_group(self, config: Decisions, pp_rank: int) -> int:
        """The node group that holds pipeline rank ``pp_rank``'s ranks (0 on a homogeneous cluster). The mesh
        offered on a heterogeneous cluster keeps each pp rank inside one group
        (``passes.planning.strategies.stages_fit_groups``)."""
        if not self.cluster.groups:
            return 0
        per_stage = config.mesh.world_size // config.mesh.pp
        first = pp_rank * per_stage
        group = self.cluster.rank_group(first)
        assert group == self.cluster.rank_group(first + per_stage - 1), "a pp rank spans two node groups"
        return group

    def for_pp_rank(self, config: Decisions, pp_rank: int) -> CostTables:
        """The tables pipeline rank ``pp_rank`` is priced on: its node group's, or these on a homogeneous cluster."""
        return self.group_tables(self.pp_rank_group(config, pp_rank)) if self.cluster.groups else self

    def tp_cost(
        self, tp: int, microbatch_size: float, sequence_parallel: bool = False, loss_parallel: bool = False
    ) -> TPCost:
        """The layout handed in for (tp, b, sequence parallelism, loss parallelism), priced (``add_tp_layout``)."""
        key = (tp, microbatch_size, sequence_parallel, loss_parallel)  # layout_key of a point
        if key not in self._tp and self._layouts_from is not None and key in self._layouts_from._tp:
            self.add_tp_layout(self._layouts_from._tp[key].choice, microbatch_size, sequence_parallel, loss_parallel)
        cost = self._tp.get((tp, microbatch_size, sequence_parallel, loss_parallel))
        if cost is None:
            raise LookupError(
                f"no TP layout for tp={tp}, micro-batch {microbatch_size}"
                f"{', sequence parallel' if sequence_parallel else ''}"
                f"{', loss parallel' if loss_parallel else ''} was handed to the cost "
                "tables; hand one with passes.planning.tp_layout.hand_tp_layout first"
            )
        return cost

    def layout_cost(self, config: Decisions) -> TPCost:
        """The TP layout ``config`` is priced with (its tp, micro-batch, sequence and loss parallelism)."""
        return self.tp_cost(config.mesh.tp, config.microbatch_size, config.sequence_parallel, config.loss_parallel)

    def rank_share(self, config: Decisions) -> RankShare:
        """What one TP rank of ``config``'s layout keeps of each saved tensor (``cost.tp.rank_share``)."""
        return (
            WHOLE
            if config.mesh.tp == 1
            else rank_share(self.graph, self.layout_cost(config).choice, in_stages=config.mesh.pp > 1)
        )

    def activation_units(self, config: Decisions, recompute: str | None = None) -> Units:
        """``config_units`` (or ``units`` in ``recompute`` for every block) with the saved, workspace and
        backward bytes of one TP rank: ``cost.saved``'s per-op rules on the layout's shards' shapes
        (``rank_share``); the units themselves without TP."""
        if recompute is None and config.recompute == MIXED:
            modes = config.recompute_blocks
            return mixed_units({m: self.activation_units(config, m) for m in sorted(set(modes))}, modes)
        recompute = recompute or config.recompute
        units = self.units(
            config.microbatch_size,
            recompute,
            self.runtime.autocast_for(config.dp_runtime.fsdp2),
            config.compile,
            self.float8_for(config),
            config.compile_loss,
        )
        if config.mesh.tp == 1:
            return units
        saved, workspace, backward = unit_activation_bytes(
            self.graph,
            config.microbatch_size,
            recompute,
            self.precision.activation_bytes,
            CAPTURED_ELEM_BYTES,
            self.runtime.kernels,
            self.rank_share(config),
            config.compile_loss,
        )
        return replace(units, saved_bytes=saved, workspace_bytes=workspace, backward_bytes=backward)

    def weight_grad_units(self, config: Decisions) -> tuple[int, ...]:
        """Per unit, one micro-batch's gradients a split backward keeps from its input pass to its weight pass, on
        one TP rank (``units.unit_weight_grad_bytes``)."""
        return unit_weight_grad_bytes(
            self.graph,
            config.microbatch_size,
            self.precision.activation_bytes,
            CAPTURED_ELEM_BYTES,
            self.rank_share(config),
        )


def mixed_units(by_mode: dict[str, Units], modes: tuple[str, ...]) -> Units:
    """Units whose block k recomputes in ``modes[k]``: its recompute time, saved activations and
    workspace from that mode's units (forward and backward are the same in every mode)."""
    base = by_mode[min(by_mode)]  # by name: a dict built from a set would make it the process's hash order's

    def pick(field_name: str) -> tuple:
        values = list(getattr(base, field_name))
        for k, mode in enumerate(modes):
            values[k + 1] = getattr(by_mode[mode], field_name)[k + 1]
        return tuple(values)

    return replace(
        base,
        recompute_s=pick("recompute_s"),
        saved_bytes=pick("saved_bytes"),
        workspace_bytes=pick("workspace_bytes"),
        host_recompute_s=pick("host_recompute_s"),
        backward_bytes=pick("backward_bytes") if base.backward_bytes else (),
    )


def hides_comm(cluster: Cluster) -> bool:
    """Whether collectives can run behind compute: on GPUs (own engines and streams), not on CPU
    ranks, where gloo's threads and the compute share the same cores."""
    return cluster.backend != "gloo"


def variant_totals(measured: tuple[float, float, float], variant: Units, eager: Units) -> tuple[float, float, float]:
    """The measured (forward, backward, recompute) totals of the eager model carried over to a variant of it
    (compiled blocks, float8 linears, the compiled loss), which the profile does not time: each total times the
    variant's modelled one over the eager model's, so the variant keeps the gain the cost model gives it::

        T_variant = T_measured · Σ_u (t + h)_variant(u) / Σ_u (t + h)_eager(u)     (t compute, h host, per unit u)"""

    def totals(units: Units) -> tuple[float, float, float]:
        zeros = (0.0,) * len(units.forward_s)
        return (
            sum(units.forward_s) + sum(units.host_forward_s or zeros),
            sum(units.backward_s) + sum(units.host_backward_s or zeros),
            sum(units.recompute_s) + sum(units.host_recompute_s or zeros),
        )

    return tuple(m * (v / e if e > 0 else 1.0) for m, v, e in zip(measured, totals(variant), totals(eager)))


def layout_key(config: Decisions) -> tuple:
    """What names a point's TP layout (``CostTables.tp_cost``): tp, micro-batch, sequence and loss parallelism."""
    return (config.mesh.tp, config.microbatch_size, config.sequence_parallel, config.loss_parallel)


def _units_key(
    microbatch_size: int,
    recompute: str,
    autocast: Autocast | None = None,
    compiled: bool = False,
    float8: Float8 | None = None,
    compiled_loss: bool = False,
) -> tuple:
    return (
        (microbatch_size, recompute, autocast)
        + ((True,) if compiled else ())
        + ((float8,) if float8 else ())
        + _loss_key(compiled_loss)
    )


def _loss_key(compiled_loss: bool) -> tuple:
    """What a units key adds for the compiled loss: nothing without it (keys as before)."""
    return ("compiled loss",) if compiled_loss else ()
