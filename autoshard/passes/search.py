"""Search: price every candidate configuration and keep the fastest that fits.

Objective and constraint (per-rank memory M, device memory C)::

    minimise   step_time(c)            over candidates c
    subject to M(c) ≤ C                 (add_memory_constraint: ``fits``)

Ties break on lower peak memory, then lower ZeRO stage, then larger micro-batch, then less
recompute, so the same inputs always give the same plan. The candidate sets of this pass
are small (ZeRO stage × micro-batch × recompute), so it enumerates them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autoshard.cost.memory import precision_for_backend
from autoshard.cost.step import Config, choose_bucket_cap_mb, price
from autoshard.errors import AutoshardError
from autoshard.ir.graph import OpGraph
from autoshard.ir.plan import RECOMPUTE_MODES, Alternative, Predicted
from autoshard.ir.topology import Cluster

MAX_ALTERNATIVES = 8
GIB = 2**30


@dataclass(frozen=True)
class Priced:
    config: Config
    predicted: Predicted
    fits: bool


@dataclass(frozen=True)
class SearchResult:
    best: Priced
    alternatives: tuple[Alternative, ...]


def search(graph: OpGraph, cluster: Cluster, configs: list[Config], global_batch: int) -> SearchResult:
    priced = [price_config(graph, cluster, c, global_batch) for c in configs]
    feasible = sorted((p for p in priced if p.fits), key=_rank)
    if not feasible:
        raise AutoshardError(explain_infeasible(graph, cluster, priced))
    best = feasible[0]
    return SearchResult(best=best, alternatives=alternatives(best, priced, cluster))


def price_config(graph: OpGraph, cluster: Cluster, config: Config, global_batch: int) -> Priced:
    config = replace(config, ddp_bucket_cap_mb=choose_bucket_cap_mb(graph, cluster, config))
    predicted = price(graph, cluster, config, global_batch)
    return Priced(config, predicted, fits=predicted.memory_peak_bytes_per_rank <= cluster.device.memory_bytes)


def alternatives(best: Priced, priced: list[Priced], cluster: Cluster) -> tuple[Alternative, ...]:
    """The best runner-up of each ZeRO stage and recompute mode, then the next fastest."""
    others = sorted((p for p in priced if p is not best), key=_rank)
    chosen: list[Priced] = []
    for key in [("zero", z) for z in range(4)] + [("recompute", r) for r in RECOMPUTE_MODES]:
        match = next((p for p in others if _attr(p, key[0]) == key[1] and p not in chosen), None)
        if match is not None:
            chosen.append(match)
    chosen += [p for p in others if p not in chosen][: max(0, MAX_ALTERNATIVES - len(chosen))]
    chosen = sorted(chosen[:MAX_ALTERNATIVES], key=_rank)
    return tuple(_alternative(p, best, cluster) for p in chosen)


def why_not(p: Priced, best: Priced, cluster: Cluster) -> str:
    if not p.fits:
        over = p.predicted.memory_peak_bytes_per_rank - cluster.device.memory_bytes
        return f"does not fit: {over / GIB:.2f} GiB over the {cluster.device.memory_bytes / GIB:.1f} GiB per device"
    slower = p.predicted.step_time_s / best.predicted.step_time_s - 1.0
    if slower > 1e-9:
        part = _largest_gap(p.predicted, best.predicted)
        return f"{slower:.1%} slower ({part})"
    return "tie on time; the chosen plan needs less memory or is simpler"


def explain_infeasible(graph: OpGraph, cluster: Cluster, priced: list[Priced]) -> str:
    """Name the binding constraint, by how much it is missed, and what to change."""
    least = min(priced, key=lambda p: p.predicted.memory_peak_bytes_per_rank)
    need = least.predicted.memory_peak_bytes_per_rank
    have = cluster.device.memory_bytes
    c = least.config
    state = least.predicted.memory.params_bytes + least.predicted.memory.grads_bytes + least.predicted.memory.optimizer_bytes
    hints = []
    if c.zero_stage < 3:
        hints.append("allow --zero 3")
    if c.recompute != "full":
        hints.append("allow --recompute full")
    if c.microbatch_size > 1:
        hints.append("a smaller --microbatch-size")
    devices_needed = _devices_needed(graph, cluster, state, need, c.mesh.dp)
    hints.append(f"about {devices_needed} devices (--nodes {-(-devices_needed // cluster.devices_per_node)})")
    return (f"no plan fits in memory: the leanest ({c.mesh}, ZeRO-{c.zero_stage}, micro-batch {c.microbatch_size}, "
            f"recompute {c.recompute}) needs {need / GIB:.2f} GiB per rank but devices have {have / GIB:.2f} GiB "
            f"({(need - have) / GIB:.2f} GiB short); try {', '.join(hints)}")


def _devices_needed(graph: OpGraph, cluster: Cluster, state_bytes: int, need_bytes: int, dp: int) -> int:
    """Devices at which ZeRO-3 shards of the full model state leave room for the rest."""
    precision = precision_for_backend(cluster.backend)
    full_state = graph.param_count * (precision.param_bytes + precision.grad_bytes + precision.optimizer_bytes)
    rest = max(0, need_bytes - state_bytes)
    room = cluster.device.memory_bytes - rest
    if room <= 0:
        return cluster.world_size * 2
    return max(cluster.world_size + 1, -(-full_state // room))


def _alternative(p: Priced, best: Priced, cluster: Cluster) -> Alternative:
    c = p.config
    return Alternative(mesh=c.mesh, zero_stage=c.zero_stage, microbatch_size=c.microbatch_size,
                       recompute=c.recompute, schedule=c.schedule, predicted=p.predicted,
                       why_not=why_not(p, best, cluster))


def _largest_gap(worse: Predicted, best: Predicted) -> str:
    gaps = {
        "compute": worse.compute_s - best.compute_s,
        "exposed communication": worse.comm_exposed_s - best.comm_exposed_s,
        "pipeline bubble": worse.bubble_s - best.bubble_s,
    }
    name, gap = max(gaps.items(), key=lambda kv: kv[1])
    return f"+{gap * 1e3:.3g} ms {name}"


def _rank(p: Priced) -> tuple:
    c = p.config
    return (not p.fits, round(p.predicted.step_time_s, 12), p.predicted.memory_peak_bytes_per_rank,
            c.zero_stage, -c.microbatch_size, RECOMPUTE_MODES.index(c.recompute))


def _attr(p: Priced, key: str):
    return p.config.zero_stage if key == "zero" else p.config.recompute
