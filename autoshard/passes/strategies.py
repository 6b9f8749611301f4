"""Strategies: the configurations the planner may choose from, with the user's pins applied.

A configuration fixes the mesh (dp, tp, pp), the ZeRO stage, the micro-batch size b (and so
the number of micro-batches m = B / (dp·b)), the recompute mode and, for pp > 1, the schedule
and virtual stages v. The space is what the runtime supports (``candidate_meshes``,
``mesh_configs``)::

    dp · tp · pp = world size,   B mod dp = 0
    tp | devices_per_node        (TP stays inside a node), check_divisibility(graph, tp) = ∅
    pp ≤ L blocks
    ZeRO: tp = pp = 1 → 0-3;  dp > 1 with tp or pp > 1 → 2, 3 (FSDP2 on dp);  dp = 1 → 0
    pp > 1: recompute none | selective | full, one mode for all blocks (``runtime.stage_recompute``;
            per-block mixed stays pp = 1's, ``passes.recompute``); m ≥ pp; schedule gpipe |
            1f1b (v = 1) | interleaved-1f1b (v = 2, L ≥ 2·pp, m mod max(1, ⌊m/pp⌋) = 0: torch's
            interleaved rounds)
    pp = 1: schedule none

Pins that fall outside it are refused with one line naming the fix; ``check_pins`` does the
checks that need no graph before capture (seconds on large models).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.errors import AutoshardError
from autoshard.ir.decisions import Decisions
from autoshard.ir.graph import OpGraph
from autoshard.ir.plan import RECOMPUTE_MODES, SCHEDULES, Mesh
from autoshard.ir.topology import Cluster
from autoshard.passes.stage_cuts import cut_refusals, max_stages
from autoshard.passes.tensor_parallel import check_divisibility

ZERO_STAGES = (0, 1, 2, 3)
MAX_MICROBATCH_CHOICES = 12  # the largest divisors of the per-rank batch are tried
# The largest global batch planned: 2^30 samples per step, ~10^5 times the largest in use (a few
# thousand sequences); divisors are found by trial division up to its square root (32,768 steps).
MAX_GLOBAL_BATCH = 2**30
PIPELINE_SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))  # (schedule, virtual stages)


@dataclass(frozen=True)
class Pins:
    """Decisions the user fixed by hand; None means "choose"."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    zero: int | None = None
    microbatch_size: int | None = None
    recompute: str | None = None
    schedule: str | None = None

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "microbatch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise AutoshardError(f"--{name.replace('_', '-')} {value} must be a positive integer")
        if self.zero is not None and self.zero not in ZERO_STAGES:
            raise AutoshardError(f"--zero {self.zero} must be 0, 1, 2 or 3")
        if self.recompute is not None and self.recompute not in RECOMPUTE_MODES:
            raise AutoshardError(f"--recompute {self.recompute} must be one of {', '.join(RECOMPUTE_MODES)}")
        if self.schedule is not None:
            object.__setattr__(self, "schedule", self.schedule.lower())
            if self.schedule not in SCHEDULES:
                raise AutoshardError(f"--schedule {self.schedule} must be one of {', '.join(SCHEDULES[1:])} "
                                     f"(or none, without pipeline stages)")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k for k, v in self.__dict__.items() if v is not None)

    @property
    def wants_pipeline(self) -> bool:
        return (self.pp or 1) > 1 or self.schedule not in (None, "none")


# ---------------------------------------------------------------------------- pins, before capture


def check_pins(pins: Pins, cluster: Cluster, global_batch: int) -> None:
    """Refuse pins outside what the runtime supports (module doc), before the model is captured."""
    check_global_batch(global_batch)
    _check_schedule(pins)
    _check_degrees(pins, cluster)
    if pins.dp is not None and global_batch % pins.dp:
        raise AutoshardError(_batch_message(global_batch, pins.dp))
    _check_zero(pins)


def check_global_batch(global_batch: int) -> None:
    """A positive integer of at most ``MAX_GLOBAL_BATCH`` samples."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise AutoshardError(f"--global-batch {global_batch!r} must be a positive integer; fix: pass e.g. "
                             "--global-batch 256")
    if global_batch > MAX_GLOBAL_BATCH:
        digits = int(global_batch.bit_length() * math.log10(2)) + 1  # str() of 4300+ digits raises
        shown = f"{global_batch:,}" if digits <= 30 else f"(a number of {digits} digits)"
        raise AutoshardError(f"--global-batch {shown} is more than autoshard plans for ({MAX_GLOBAL_BATCH:,} = 2^30 "
                             "samples per step); fix: give the samples per optimizer step, e.g. --global-batch 2048")


def _check_schedule(pins: Pins) -> None:
    if pins.schedule == "none" and (pins.pp or 1) > 1:
        raise AutoshardError(f"--schedule none with --pp {pins.pp}: pipelines need one of "
                             f"{', '.join(SCHEDULES[1:])}; drop --schedule or pin one of those")
    if pins.schedule not in (None, "none") and pins.pp == 1:
        raise AutoshardError(f"--schedule {pins.schedule} needs pipeline stages but --pp 1 is pinned; "
                             f"drop --schedule or pin --pp 2 or more")


def _check_degrees(pins: Pins, cluster: Cluster) -> None:
    world, per_node = cluster.world_size, cluster.devices_per_node
    if pins.tp is not None and per_node % pins.tp:
        raise AutoshardError(f"--tp {pins.tp} must divide the {per_node} devices per node (tensor parallelism "
                             f"stays inside a node); use one of {', '.join(map(str, divisors(per_node)))}")
    pinned = {k: v for k, v in (("dp", pins.dp), ("tp", pins.tp), ("pp", pins.pp)) if v is not None}
    product = 1
    for v in pinned.values():
        product *= v
    what = " x ".join(f"--{k} {v}" for k, v in pinned.items())
    if len(pinned) == 3 and product != world:
        raise AutoshardError(f"{what} = {product} ranks, but the cluster has {world} devices; "
                             f"pin degrees whose product is {world}")
    if world % product:
        raise AutoshardError(f"{what} = {product} ranks does not divide the cluster's {world} devices; "
                             f"pin degrees whose product divides {world}")


def _check_zero(pins: Pins) -> None:
    split = (pins.tp or 1) > 1 or pins.wants_pipeline
    if pins.zero is None or not split:
        return
    if pins.zero == 1:
        raise AutoshardError("--zero 1 with tensor or pipeline parallelism is not supported; use --zero 2 or 3 "
                             "(FSDP2 over dp), or --zero 0 with dp=1")
    if pins.zero >= 2 and pins.dp == 1:
        raise AutoshardError(f"--zero {pins.zero} with --dp 1 has nothing to shard over; use --zero 0, or a larger --dp")
    if pins.zero == 0 and (pins.dp or 1) > 1:
        raise AutoshardError(f"--zero 0 with --dp {pins.dp} and tensor or pipeline parallelism is not supported; "
                             f"use --zero 2 or 3")


def _batch_message(global_batch: int, dp: int) -> str:
    near = max(dp, global_batch // dp * dp)
    return f"global batch {global_batch} is not divisible by dp={dp}; use --global-batch {near} or {near + dp}"


# ---------------------------------------------------------------------------- the space


def candidate_configs(graph: OpGraph, cluster: Cluster, global_batch: int, pins: Pins) -> list[Decisions]:
    """Every configuration that honours the pins, in a fixed order (for deterministic plans)."""
    check_pins(pins, cluster, global_batch)
    check_graph_pins(graph, cluster, pins)
    blocks = max_stages(graph)  # blocks a stage may begin at
    configs = [c for mesh in candidate_meshes(graph, cluster, global_batch, pins)
               for c in mesh_configs(mesh, global_batch, pins, blocks)]
    if not configs:
        raise AutoshardError(explain_no_config(graph, cluster, global_batch, pins))
    return configs


def check_graph_pins(graph: OpGraph, cluster: Cluster, pins: Pins) -> None:
    """The pins that need the captured graph: heads divisible by tp, at most one stage per block."""
    if pins.tp is not None and pins.tp not in legal_tp_degrees(graph, cluster):
        legal = ", ".join(map(str, legal_tp_degrees(graph, cluster)))
        raise AutoshardError(f"--tp {pins.tp} cannot split this model: {'; '.join(check_divisibility(graph, pins.tp))}; "
                             f"use --tp in {legal}")
    blocks = len(graph.blocks)
    if pins.pp is not None and pins.pp > max(1, blocks):
        raise AutoshardError(f"--pp {pins.pp} needs at least {pins.pp} blocks, the model has {blocks}; "
                             f"pin --pp {max(1, blocks)} or less")
    _check_cuts(graph, pins)
    if pins.schedule == "interleaved-1f1b" and pins.pp is not None and max_stages(graph) < 2 * pins.pp:
        raise AutoshardError(f"--schedule interleaved-1f1b puts 2 stages on each of --pp {pins.pp} ranks: needs "
                             f"{2 * pins.pp} blocks, the model has {blocks}; use 1f1b or --pp {max(1, blocks // 2)}")


def _check_cuts(graph: OpGraph, pins: Pins) -> None:
    """--pp (× 2 stages per rank with interleaved 1F1B) needs that many blocks a stage may begin at."""
    refusals = cut_refusals(graph)
    stages = (pins.pp or 1) * (2 if pins.schedule == "interleaved-1f1b" else 1)
    most = max_stages(graph, refusals)
    if refusals and stages > max(1, most):
        why = "; ".join(refusals[k] for k in sorted(refusals)[:2]) + ("; ..." if len(refusals) > 2 else "")
        fix = f"pin --pp {most} or less" if most > 1 else "pin --pp 1"
        raise AutoshardError(f"--pp {pins.pp} needs {stages} pipeline stages, but a stage can begin at only "
                             f"{max(1, most)} of this model's {len(graph.blocks)} blocks: {why}; {fix}")


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(√n) steps: each d ≤ √n that divides n, and n / d."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def legal_tp_degrees(graph: OpGraph, cluster: Cluster) -> list[int]:
    """tp that divides devices_per_node and the world, and splits every attention's heads."""
    return [t for t in divisors(cluster.devices_per_node)
            if cluster.world_size % t == 0 and not check_divisibility(graph, t)]


def pipeline_degrees(graph: OpGraph, world_size: int) -> list[int]:
    """pp > 1 dividing the world, at most one stage per block a stage may begin at (``stage_cuts``)."""
    return [p for p in divisors(world_size) if 1 < p <= max_stages(graph)]


def candidate_meshes(graph: OpGraph, cluster: Cluster, global_batch: int, pins: Pins) -> list[Mesh]:
    """(dp, tp, pp) honouring the pins: pure DP first, then tp ascending, then pp ascending."""
    world = cluster.world_size
    meshes = []
    for tp in legal_tp_degrees(graph, cluster):
        for pp in [1] + pipeline_degrees(graph, world // tp):
            dp = world // (tp * pp)
            if global_batch % dp or not _honours(Mesh(dp, tp, pp), pins):
                continue
            meshes.append(Mesh(dp=dp, tp=tp, pp=pp))
    return meshes


def _honours(mesh: Mesh, pins: Pins) -> bool:
    degrees = all(getattr(pins, a) in (None, getattr(mesh, a)) for a in ("dp", "tp", "pp"))
    schedule = pins.schedule is None or (pins.schedule == "none") == (mesh.pp == 1)
    return degrees and schedule


def mesh_configs(mesh: Mesh, global_batch: int, pins: Pins, blocks: int) -> list[Decisions]:
    """The configurations of one mesh (module doc), zero stage outermost."""
    per_rank = global_batch // mesh.dp
    zeros = [z for z in zero_stages(mesh) if pins.zero in (None, z)]
    recomputes = [r for r in RECOMPUTE_MODES if pins.recompute in (None, r)]
    out = []
    for schedule, v in schedule_choices(mesh, blocks, pins):
        for b in microbatch_sizes(per_rank, pins.microbatch_size, mesh.pp):
            m = per_rank // b
            if schedule == "interleaved-1f1b" and m % max(1, m // mesh.pp):
                continue
            out += [Decisions(mesh=mesh, zero_stage=z, microbatch_size=b, num_microbatches=m, recompute=r,
                           schedule=schedule, virtual_stages=v) for z in zeros for r in recomputes]
    return sorted(out, key=lambda c: (SCHEDULES.index(c.schedule), c.zero_stage,
                                      -c.microbatch_size, RECOMPUTE_MODES.index(c.recompute)))


def zero_stages(mesh: Mesh) -> tuple[int, ...]:
    if mesh.tp == 1 and mesh.pp == 1:
        return ZERO_STAGES
    return (2, 3) if mesh.dp > 1 else (0,)


def schedule_choices(mesh: Mesh, blocks: int, pins: Pins) -> list[tuple[str, int]]:
    if mesh.pp == 1:
        return [("none", 1)]
    return [(s, v) for s, v in PIPELINE_SCHEDULES
            if pins.schedule in (None, s) and blocks >= v * mesh.pp]


def microbatch_sizes(per_rank_batch: int, pinned: int | None, min_microbatches: int = 1) -> list[int]:
    """Divisors of the per-rank batch giving at least ``min_microbatches``, largest first."""
    divisors_ = [b for b in reversed(divisors(per_rank_batch)) if per_rank_batch // b >= min_microbatches]
    if pinned is not None:
        return [pinned] if pinned in divisors_ else []
    return divisors_[:MAX_MICROBATCH_CHOICES]


def explain_no_config(graph: OpGraph, cluster: Cluster, global_batch: int, pins: Pins) -> str:
    """Why the pins leave nothing to plan, with the fix."""
    meshes = candidate_meshes(graph, cluster, global_batch, pins)
    if not meshes:
        dps = sorted({cluster.world_size // (t * p) for t in legal_tp_degrees(graph, cluster)
                      for p in [1] + pipeline_degrees(graph, cluster.world_size // t)})
        if pins.dp is None and all(global_batch % dp for dp in dps):
            return _batch_message(global_batch, min(dps))
        return (f"no mesh (dp, tp, pp) of {cluster.world_size} devices honours the pins "
                f"{', '.join(pins.names)}; unpin --dp, --tp or --pp")
    if pins.microbatch_size is not None:
        mesh = meshes[0]
        per_rank = global_batch // mesh.dp
        need = f" and leave at least {mesh.pp} micro-batches for pp={mesh.pp}" if mesh.pp > 1 else ""
        near = max(d for d in divisors(per_rank) if d <= max(1, min(pins.microbatch_size, per_rank // mesh.pp)))
        return (f"--microbatch-size {pins.microbatch_size} does not divide the per-rank batch {per_rank}{need}; "
                f"pick a divisor such as {near}")
    return (f"the pins {', '.join(pins.names)} leave no configuration the runtime supports "
            f"(e.g. ZeRO-{pins.zero} with mesh {meshes[0]}); unpin one of them")
