"""The search space: every configuration that honours the pins (``candidate_configs``), from ``strategies``'
enumeration after ``pin_checks``' checks, or one line saying why none does (``explain_no_config``).
"""

from __future__ import annotations

from autoshard.errors import AutoshardError
from autoshard.ir.decisions import (
    OFFLOAD_CPU,
    ZERO_BUBBLE_SCHEDULES,
    Decisions,
    compile_loss_refusal,
    compile_runs,
    offload_refusal,
)
from autoshard.ir.graph import OpGraph
from autoshard.ir.pins import Pins
from autoshard.ir.topology import Cluster
from autoshard.passes.planning.pin_checks import batch_message, check_graph_pins, check_pins, interleaved_v
from autoshard.passes.planning.stage_cuts import cut_refusals, max_stages
from autoshard.passes.planning.strategies import (
    batch_coupling_refusal,
    candidate_meshes,
    divisors,
    float8_choices,
    fp16_runs,
    hidden_backward_refusal,
    honours_cuts,
    keeps_batch_whole,
    legal_tp_degrees,
    loss_parallel_refusal,
    mesh_configs,
    microbatch_refusal,
    pipeline_degrees,
    split_backward_graph_refusal,
    with_offload_choices,
)


def candidate_configs(graph: OpGraph, cluster: Cluster, global_batch: int, pins: Pins) -> list[Decisions]:
    """Every configuration that honours the pins, in a fixed order (for deterministic plans)."""
    check_pins(pins, cluster, global_batch)
    check_graph_pins(graph, cluster, pins)
    blocks, refusals = max_stages(graph), cut_refusals(graph)  # blocks a stage may begin at, and why not
    split_backward = not split_backward_graph_refusal(graph)  # zero-bubble schedules train this model right
    experts = tuple(g.experts for g in graph.experts)
    float8s = float8_choices(graph, cluster, pins)
    configs = [
        o
        for mesh in candidate_meshes(graph, cluster, global_batch, pins)
        for c in mesh_configs(mesh, global_batch, pins, blocks, cluster, experts, float8s, graph.loss_parallel_proof)
        for o in with_offload_choices(c, pins, cluster)
        if honours_cuts(c, pins, len(graph.blocks), refusals)
        and (split_backward or c.schedule not in ZERO_BUBBLE_SCHEDULES)
        and (not graph.batch_coupling or keeps_batch_whole(c))
        and not hidden_backward_refusal(graph, c.zero_stage)
        and (pins.precision != "fp16" or fp16_runs(c))
    ]  # loss scaling: _check_precision
    if not configs:
        raise AutoshardError(explain_no_config(graph, cluster, global_batch, pins))
    return configs


def explain_no_config(graph: OpGraph, cluster: Cluster, global_batch: int, pins: Pins) -> str:
    """Why the pins leave nothing to plan, with the fix."""
    if graph.batch_coupling:
        return batch_coupling_refusal(graph, pins)
    if hidden_backward_refusal(graph, pins.zero_stage or 0):
        return hidden_backward_refusal(graph, pins.zero_stage)
    meshes = candidate_meshes(graph, cluster, global_batch, pins)
    if not meshes:
        dps = sorted(
            {
                cluster.world_size // (t * p)
                for t in legal_tp_degrees(graph, cluster)
                for p in [1] + pipeline_degrees(graph, cluster.world_size // t)
            }
        )
        if pins.dp is None and all(global_batch % dp for dp in dps):
            return batch_message(global_batch, min(dps))
        return (
            f"no mesh (dp, tp, pp) of {cluster.world_size} devices honours the pins "
            f"{', '.join(pins.names)}; unpin --dp, --tp or --pp"
        )
    if isinstance(pins.stage_cuts, tuple) and any(
        mesh_configs(m, global_batch, pins, max_stages(graph)) for m in meshes
    ):
        n = len(pins.stage_cuts) + 1
        return (
            f"--stage-cuts gives {n} stages, but no configuration honouring the other pins has pp x virtual "
            f"stages = {n}; pin --pp and --virtual-stages whose product is {n}, or use --stage-cuts even"
        )
    if pins.microbatch_size is not None:
        mesh = meshes[0]
        per_rank = global_batch // mesh.dp
        m = per_rank // pins.microbatch_size
        why = microbatch_refusal(pins.schedule or "interleaved-1f1b", mesh.pp, m) if mesh.pp > 1 else ""
        if per_rank % pins.microbatch_size == 0 and m >= mesh.pp > 1 and interleaved_v(pins) > 1 and why:
            return f"--microbatch-size {pins.microbatch_size} leaves {m} micro-batches per rank: {why}"
        need = f" and leave at least {mesh.pp} micro-batches for pp={mesh.pp}" if mesh.pp > 1 else ""
        near = max(d for d in divisors(per_rank) if d <= max(1, min(pins.microbatch_size, per_rank // mesh.pp)))
        return (
            f"--microbatch-size {pins.microbatch_size} does not divide the per-rank batch {per_rank}{need}; "
            f"pick a divisor such as {near}"
        )
    if (pins.dp_replicate or 1) > 1:
        return (
            f"--dp-replicate {pins.dp_replicate} (HSDP) needs the dp group to span {pins.dp_replicate} nodes with "
            f"at least 2 of its ranks on each (shard inside a node, replicate across); this cluster's meshes "
            f"have none such: drop --dp-replicate or pin --dp-replicate 1"
        )
    if (pins.ep or 1) > 1 and all(m.dp % pins.ep or m.tp > 1 for m in meshes):
        dps = ", ".join(str(d) for d in sorted({m.dp for m in meshes if m.tp == 1})) or "none without tp"
        return (
            f"--ep {pins.ep} borrows {pins.ep} of the dp ranks, but this cluster's meshes give dp in {dps}; "
            f"pin an --ep that divides one of them, or plan for more devices"
        )
    if pins.offload == OFFLOAD_CPU and not any(offload_refusal(m, 3, 1, cluster.backend) is None for m in meshes):
        return (
            "--offload cpu offloads ZeRO-3 over dp > 1 without pipeline stages or cp, and this cluster's meshes that "
            "honour the pins have none such; pin --pp 1 and a --dp above 1, or --offload none"
        )
    if pins.compile and not any(compile_runs(m, recompute="full") for m in meshes):
        return (
            "--compile on compiles the blocks of plans without tensor parallelism beside context parallelism, nor "
            "context parallelism inside pipeline stages, and this cluster's meshes that honour the pins have one of "
            "those; pin --tp 1, or --cp 1, or --compile off"
        )
    if pins.async_tp and not any(m.tp > 1 and m.pp == 1 and compile_runs(m) for m in meshes):
        return (
            "--async-tp on overlaps the TP collectives of compiled blocks, and this cluster's meshes that honour the "
            "pins have tp 1, pipeline stages or cp; pin --tp 2 or more with --pp 1 --cp 1, or --async-tp off"
        )
    if pins.compile_loss and all(compile_loss_refusal(m) for m in meshes):
        return (
            "--compile-loss on compiles the loss of plans without pipeline stages, and this cluster's meshes that "
            "honour the pins all have them; pin --pp 1, or --compile-loss off"
        )
    if pins.loss_parallel and all(loss_parallel_refusal(m, "") for m in meshes):
        return (
            f"--loss-parallel on: {loss_parallel_refusal(meshes[0], '')} (mesh {meshes[0]}), and every mesh of this "
            f"cluster that honours the pins is such; pin --tp 2 or more without --cp, or plan for enough devices "
            f"for --pp 2 or more, or leave it off"
        )
    piped = [m for m in meshes if m.pp > 1]
    if pins.schedule == "dualpipev" and piped and all(global_batch // m.dp < 2 * m.pp for m in piped):
        mesh = piped[0]
        return (
            f"dualpipev needs at least 2·pp = {2 * mesh.pp} micro-batches, and the per-rank batch "
            f"{global_batch // mesh.dp} (dp={mesh.dp}) gives at most {global_batch // mesh.dp}; use --global-batch "
            f"{2 * mesh.pp * mesh.dp} or more, or --schedule zbv"
        )
    return (
        f"the pins {', '.join(pins.names)} leave no configuration the runtime supports "
        f"(e.g. ZeRO-{pins.zero_stage} with mesh {meshes[0]}); unpin one of them"
    )
