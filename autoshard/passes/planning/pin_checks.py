"""What the user pinned, checked before the search (``strategies``' module doc): ``check_pins`` needs no graph and
runs before capture (seconds on large models); ``check_graph_pins`` checks the pins against the captured graph.
Each refusal is one line naming the fix.
"""

from __future__ import annotations

import math

from autoshard.cost.float8 import float8_linears
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import (
    ALTERNATE,
    COMPILED_RECOMPUTE_OUTSIDE,
    FLOAT8_OFF,
    OFFLOAD_CPU,
    OFFLOAD_NVME,
    PIPELINE_SCHEDULES,
    SCHEDULES,
    V_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    Mesh,
    async_tp_refusal,
    compile_loss_refusal,
    offload_refusal,
)
from autoshard.ir.graph import OpGraph
from autoshard.ir.pins import STAGE_CUTS_EVEN, Pins
from autoshard.ir.topology import Cluster
from autoshard.passes.layouts.allowed import check_divisibility
from autoshard.passes.planning.context_parallel import cp_refusal, pipeline_cp_refusal
from autoshard.passes.planning.stage_cuts import cut_refusals, max_stages
from autoshard.passes.planning.strategies import (
    MAX_GLOBAL_BATCH,
    batch_norm_refusal,
    divisors,
    even_cuts,
    group_refusal,
    legal_tp_degrees,
    loss_parallel_refusal,
    runs_virtual_stages,
    split_backward_graph_refusal,
    split_backward_refusal,
)


def check_pins(pins: Pins, cluster: Cluster, global_batch: int) -> None:
    """Refuse pins outside what the runtime supports (module doc), before the model is captured."""
    check_global_batch(global_batch)
    _check_schedule(pins)
    _check_virtual_stages(pins)
    _check_stage_cuts(pins)
    _check_degrees(pins, cluster)
    if pins.pp is not None and cluster.world_size % pins.pp == 0 and group_refusal(cluster, pins.pp):
        raise AutoshardError(group_refusal(cluster, pins.pp))
    if pins.dp is not None and global_batch % pins.dp:
        raise AutoshardError(batch_message(global_batch, pins.dp))
    _check_zero(pins)
    _check_ep(pins)
    _check_sequence_parallel(pins)
    _check_loss_parallel(pins)
    _check_precision(pins)
    _check_compile(pins)
    _check_async_tp(pins, cluster)
    _check_compile_loss(pins)
    _check_float8(pins, cluster)
    _check_offload(pins, cluster)
    _check_alternate(pins)


def _check_offload(pins: Pins, cluster: Cluster) -> None:
    """--offload nvme, and --offload cpu where it is not emitted (``ir.decisions.offload_refusal``): one line each."""
    if pins.offload == OFFLOAD_NVME:
        raise AutoshardError(
            "--offload nvme is not emitted: no maintained library offloads FSDP2's state to NVMe (DeepSpeed's "
            "ZeRO-Infinity runs its own engine); pin --offload cpu, or leave --offload unpinned"
        )
    if pins.offload != OFFLOAD_CPU:
        return
    mesh = Mesh(dp=pins.dp or 2, tp=pins.tp or 1, pp=pins.pp or 1, cp=pins.cp or 1)
    zero = pins.zero_stage if pins.zero_stage is not None else 3
    why = offload_refusal(mesh, zero, pins.ep or 1, cluster.backend, pins.float8 or FLOAT8_OFF)
    if why:
        raise AutoshardError(
            f"--offload cpu: {why}; pin --offload none, or --zero 3 --pp 1 --float8 off on a GPU cluster"
        )


def _check_precision(pins: Pins) -> None:
    """--precision fp16 where its loss scaling is not emitted (``fp16_runs``): one line each."""
    if pins.precision != "fp16":
        return
    if pins.wants_pipeline:
        raise AutoshardError(
            "--precision fp16 with pipeline stages is not emitted yet (the pipeline schedule runs "
            "the backward, so the loss cannot be scaled); pin --pp 1 or --precision bf16"
        )
    for flag, value in (("--tp", pins.tp), ("--cp", pins.cp), ("--ep", pins.ep)):
        if (value or 1) > 1:
            raise AutoshardError(
                f"--precision fp16 with {flag} {value} is not emitted yet (the loss scaler is "
                f"verified over data parallelism only); pin {flag} 1 or --precision bf16"
            )


def _check_float8(pins: Pins, cluster: Cluster) -> None:
    """--float8 RECIPE where float8 linears are not emitted (``ir.decisions.float8_runs``) or the device has no
    float8 matmuls: one line each."""
    if pins.float8 in (None, FLOAT8_OFF):
        return
    if not cluster.device.has_float8:
        raise AutoshardError(
            f"--float8 {pins.float8}: {cluster.name}'s device {cluster.device.name} has no float8 matmuls "
            f"(float8_tflops is 0: CPU ranks, A100; torch._scaled_mm needs an H100-class GPU); pin --float8 off, or "
            f"plan for a cluster whose device gives float8_tflops"
        )
    if (pins.ep or 1) > 1:
        raise AutoshardError(
            f"--float8 {pins.float8} with --ep {pins.ep} is not emitted yet (expert shards are not converted); "
            f"pin --ep 1 or --float8 off"
        )


def _check_graph_float8(graph: OpGraph, pins: Pins) -> None:
    """--float8 RECIPE on a model without a linear torchao converts: one line."""
    if pins.float8 not in (None, FLOAT8_OFF) and not float8_linears(graph):
        raise AutoshardError(
            f"--float8 {pins.float8}: this model has no linear float8 converts (an nn.Linear whose weight's dims "
            f"are both divisible by 16, other than the output projection); pin --float8 off"
        )


def _check_alternate(pins: Pins) -> None:
    """--recompute alternate where it is emitted: SPMD plans (a pipeline stage recomputes its blocks' regions by
    selective or full policies only, ``runtime.stage_recompute``)."""
    if pins.recompute == ALTERNATE and pins.wants_pipeline:
        raise AutoshardError(
            "--recompute alternate with pipeline stages is not emitted yet (stages recompute selective or full); "
            "pin --pp 1, or --recompute selective or full"
        )


def _check_compile(pins: Pins) -> None:
    """--compile on where compiled blocks are not emitted (``ir.decisions.compile_runs``): one line each."""
    if not pins.compile:
        return
    if (pins.ep or 1) > 1:
        raise AutoshardError(
            f"--compile on with --ep {pins.ep} is not emitted yet (its all-to-all dispatch is not traced); "
            f"pin --ep 1 or --compile off"
        )
    if pins.wants_pipeline or (pins.cp or 1) > 1:
        _check_compile_recompute_outside(pins)


def _check_async_tp(pins: Pins, cluster: Cluster) -> None:
    """--async-tp on where it does not run (``ir.decisions.async_tp_refusal``), as far as the pins say: one line."""
    if not pins.async_tp:
        return
    tp = pins.tp if pins.tp is not None else 2  # unpinned: the search keeps it to meshes with tp > 1
    pp = 2 if pins.wants_pipeline else 1
    sequence_parallel = pins.sequence_parallel is not False
    why = async_tp_refusal(Mesh(tp=tp, pp=pp), bool(pins.compile), sequence_parallel, cluster.backend)
    if why:
        raise AutoshardError(f"--async-tp on is not emitted here: {why}; or pin --async-tp off")


def _check_compile_loss(pins: Pins) -> None:
    """--compile-loss on where the loss is not compiled (``ir.decisions.compile_loss_refusal``): one line."""
    if not pins.compile_loss:
        return
    if pins.wants_pipeline:
        why = compile_loss_refusal(Mesh(pp=2))
        raise AutoshardError(f"--compile-loss on is not emitted here: {why}; pin --compile-loss off or --pp 1")
    if pins.loss_parallel:
        why = compile_loss_refusal(Mesh(), loss_parallel=True)
        raise AutoshardError(f"--compile-loss on is not emitted here: {why}, or --compile-loss off")


def _check_compile_recompute_outside(pins: Pins) -> None:
    """--compile on beside --cp > 1 or pipeline stages (``compile_runs``: the recompute eager around the compiled
    block): none or full recompute; beside cp no TP outside stages; in stages no split backward."""
    where = "pipeline stages" if pins.wants_pipeline else f"--cp {pins.cp}"
    fixes = (
        (
            not pins.wants_pipeline and (pins.tp or 1) > 1,
            f"--tp {pins.tp} (TP's collectives in compiled blocks there are not verified)",
            "--tp 1",
        ),
        (
            pins.recompute not in (None, *COMPILED_RECOMPUTE_OUTSIDE),
            f"--recompute {pins.recompute} (its policy is a dispatch mode, under which dynamo compiles nothing)",
            "--recompute full or none",
        ),
        (
            pins.wants_pipeline and pins.schedule in ZERO_BUBBLE_SCHEDULES,
            f"--schedule {pins.schedule} (its weight pass would rerun a compiled block's whole backward)",
            "--schedule 1f1b, gpipe or interleaved-1f1b",
        ),
    )
    for refused, what, fix in fixes:
        if refused:
            raise AutoshardError(
                f"--compile on with {where} and {what} is not emitted yet; pin {fix}, or --compile off"
            )


def _check_loss_parallel(pins: Pins) -> None:
    """--loss-parallel on: a mesh that may run it (``loss_parallel_refusal``), as far as the pins say."""
    if not pins.loss_parallel:
        return
    pipelined = pins.wants_pipeline or pins.pp is None  # an unpinned pp may be 2 or more: the search keeps those
    mesh = Mesh(tp=pins.tp or 2, pp=2 if pipelined else 1, cp=pins.cp or 1)
    why = loss_parallel_refusal(mesh, "")
    if why:
        raise AutoshardError(
            f"--loss-parallel on: {why}; pin --tp 2 or more without --cp (or with --pp 2 or more), or leave it off"
        )


def _check_sequence_parallel(pins: Pins) -> None:
    """--sequence-parallel on: TP's layout, with or without pipeline stages and cp (``sequence_parallel_choices``)."""
    if not pins.sequence_parallel:
        return
    if pins.tp == 1:
        raise AutoshardError(
            "--sequence-parallel on shards TP's regions along the sequence, and --tp 1 has no TP; "
            "pin --tp 2 or more, or --sequence-parallel off"
        )


def check_global_batch(global_batch: int) -> None:
    """A positive integer of at most ``MAX_GLOBAL_BATCH`` samples."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise AutoshardError(
            f"--global-batch {global_batch!r} must be a positive integer; fix: pass e.g. --global-batch 256"
        )
    if global_batch > MAX_GLOBAL_BATCH:
        digits = int(global_batch.bit_length() * math.log10(2)) + 1  # str() of 4300+ digits raises
        shown = f"{global_batch:,}" if digits <= 30 else f"(a number of {digits} digits)"
        raise AutoshardError(
            f"--global-batch {shown} is more than autoshard plans for ({MAX_GLOBAL_BATCH:,} = 2^30 "
            "samples per step); fix: give the samples per optimizer step, e.g. --global-batch 2048"
        )


def _check_schedule(pins: Pins) -> None:
    if pins.schedule == "none" and (pins.pp or 1) > 1:
        raise AutoshardError(
            f"--schedule none with --pp {pins.pp}: pipelines need one of "
            f"{', '.join(SCHEDULES[1:])}; drop --schedule or pin one of those"
        )
    if pins.schedule not in (None, "none") and pins.pp == 1:
        raise AutoshardError(
            f"--schedule {pins.schedule} needs pipeline stages but --pp 1 is pinned; "
            f"drop --schedule or pin --pp 2 or more"
        )
    if pins.schedule in ZERO_BUBBLE_SCHEDULES:
        why = split_backward_refusal(pins.zero_stage, pins.recompute)
        if why:
            raise AutoshardError(f"--schedule {pins.schedule} with {why}")


def _check_virtual_stages(pins: Pins) -> None:
    """v > 1 is interleaved 1F1B on pp > 1 ranks; interleaved 1F1B is v > 1."""
    v = pins.virtual_stages
    if v is None:
        return
    if v > 1 and pins.pp == 1:
        raise AutoshardError(
            f"--virtual-stages {v} puts {v} stages on each pipeline rank but --pp 1 is pinned; "
            f"drop --virtual-stages or pin --pp 2 or more"
        )
    if v > 1 and pins.schedule in V_SCHEDULES and v != 2:
        raise AutoshardError(
            f"--virtual-stages {v} with --schedule {pins.schedule}: it puts exactly 2 stages on each "
            f"rank, in a V; pin --virtual-stages 2, or --schedule interleaved-zb for {v}"
        )
    if v > 1 and pins.schedule is not None and not runs_virtual_stages(pins.schedule, v):
        raise AutoshardError(
            f"--virtual-stages {v} needs --schedule interleaved-1f1b ({pins.schedule} runs "
            f"{dict(PIPELINE_SCHEDULES).get(pins.schedule, 1)} stage(s) per rank); pin that "
            f"schedule or drop --virtual-stages"
        )
    if v == 1 and dict(PIPELINE_SCHEDULES).get(pins.schedule, 1) > 1:
        raise AutoshardError(
            f"--schedule {pins.schedule} runs 2 or more stages per rank, but --virtual-stages 1 "
            "is pinned; pin --virtual-stages 2, or --schedule 1f1b"
        )


def _pinned_stages(pins: Pins) -> int | None:
    """pp·v when the pins fix both (v from the schedule where it is not pinned), else None."""
    v = pins.with_defaults().virtual_stages
    return pins.pp * v if pins.pp is not None and v is not None else None


def _check_stage_cuts(pins: Pins) -> None:
    """--stage-cuts needs pipeline stages; explicit cuts, pp·v − 1 of them when the pins fix pp·v."""
    if pins.stage_cuts is None:
        return
    shown = pins.stage_cuts if isinstance(pins.stage_cuts, str) else ",".join(map(str, pins.stage_cuts))
    if pins.pp == 1 or pins.schedule == "none":
        raise AutoshardError(
            f"--stage-cuts {shown} splits pipeline stages but --pp 1 (no pipeline) is pinned; "
            f"drop --stage-cuts or pin --pp 2 or more"
        )
    stages = _pinned_stages(pins)
    if isinstance(pins.stage_cuts, tuple) and stages is not None and len(pins.stage_cuts) != stages - 1:
        raise AutoshardError(
            f"--stage-cuts {shown} gives {len(pins.stage_cuts) + 1} stages, but --pp {pins.pp} x "
            f"{stages // pins.pp} virtual stages is {stages}; give {stages - 1} block indices, "
            f"or --stage-cuts even"
        )


def _check_degrees(pins: Pins, cluster: Cluster) -> None:
    world, per_node = cluster.world_size, cluster.devices_per_node
    if pins.tp is not None and per_node % pins.tp:
        raise AutoshardError(
            f"--tp {pins.tp} must divide the {per_node} devices per node (tensor parallelism "
            f"stays inside a node); use one of {', '.join(map(str, divisors(per_node)))}"
        )
    pinned = {k: v for k, v in (("dp", pins.dp), ("tp", pins.tp), ("pp", pins.pp), ("cp", pins.cp)) if v is not None}
    product = 1
    for v in pinned.values():
        product *= v
    what = " x ".join(f"--{k} {v}" for k, v in pinned.items())
    if len(pinned) == 4 - ("cp" not in pinned) and product != world:  # an unpinned cp is 1 unless searched
        raise AutoshardError(
            f"{what} = {product} ranks, but the cluster has {world} devices; pin degrees whose product is {world}"
        )
    if world % product:
        raise AutoshardError(
            f"{what} = {product} ranks does not divide the cluster's {world} devices; "
            f"pin degrees whose product divides {world}"
        )


def _check_zero(pins: Pins) -> None:
    pipeline = pins.wants_pipeline
    if pins.zero_stage is not None and pins.zero_stage >= 1 and pins.dp == 1 and (pins.cp or 1) == 1:
        raise AutoshardError(
            f"--zero {pins.zero_stage} with --dp 1 has nothing to shard over; use --zero 0, or a larger --dp"
        )
    if pins.zero_stage == 2 and pipeline:
        raise AutoshardError(
            "--zero 2 with pipeline stages runs as ZeRO-1 (torch's pipeline schedules keep each "
            "stage's gradients whole until the last micro-batch); pin --zero 1 (the same "
            "program) or --zero 3"
        )
    _check_hsdp(pins, pipeline)


def _check_hsdp(pins: Pins, pipeline: bool) -> None:
    r = pins.dp_replicate
    if r is None or r == 1:
        return
    if pipeline:
        raise AutoshardError(
            f"--dp-replicate {r} (HSDP) is planned without pipeline stages; drop --dp-replicate or pin --pp 1"
        )
    if pins.zero_stage is not None and pins.zero_stage < 2:
        raise AutoshardError(f"--dp-replicate {r} (HSDP) shards with FSDP2: pin --zero 2 or 3, not {pins.zero_stage}")
    if pins.dp is not None and (pins.dp % r or pins.dp == r):
        raise AutoshardError(
            f"--dp-replicate {r} must divide --dp {pins.dp} and leave at least 2 ranks per shard "
            f"group; use a divisor of {pins.dp} below it"
        )


def _check_ep(pins: Pins) -> None:
    """--ep e > 1 borrows e of the dp ranks (module doc): e | dp, no tp, no HSDP."""
    e = pins.ep
    if e is None or e == 1:
        return
    if pins.dp is not None and pins.dp % e:
        raise AutoshardError(
            f"--ep {e} splits the experts over {e} of the --dp {pins.dp} ranks and must divide "
            f"it; pin an --ep that divides {pins.dp}"
        )
    if (pins.tp or 1) > 1:
        raise AutoshardError(
            f"--ep {e} with --tp {pins.tp}: expert parallelism is planned without tensor "
            f"parallelism; pin --tp 1 or --ep 1"
        )
    if (pins.dp_replicate or 1) > 1:
        raise AutoshardError(
            f"--ep {e} with --dp-replicate {pins.dp_replicate}: expert parallelism is planned "
            f"without HSDP; drop one of them"
        )


def batch_message(global_batch: int, dp: int) -> str:
    near = max(dp, global_batch // dp * dp)
    return f"global batch {global_batch} is not divisible by dp={dp}; use --global-batch {near} or {near + dp}"


def check_graph_pins(graph: OpGraph, cluster: Cluster, pins: Pins) -> None:
    """The pins that need the captured graph: heads divisible by tp, at most one stage per block."""
    if pins.tp is not None and pins.tp not in legal_tp_degrees(graph, cluster):
        legal = ", ".join(map(str, legal_tp_degrees(graph, cluster)))
        raise AutoshardError(
            f"--tp {pins.tp} cannot split this model: {'; '.join(check_divisibility(graph, pins.tp))}; "
            f"use --tp in {legal}"
        )
    blocks = len(graph.blocks)
    if pins.pp is not None and pins.pp > max(1, blocks):
        raise AutoshardError(
            f"--pp {pins.pp} needs at least {pins.pp} blocks, the model has {blocks}; pin --pp {max(1, blocks)} or less"
        )
    _check_cuts(graph, pins)
    if pins.loss_parallel and graph.loss_parallel_proof != "":
        raise AutoshardError(
            f"--loss-parallel on: {graph.loss_parallel_proof or 'the loss was not checked'}; leave --loss-parallel off"
        )
    if pins.schedule in ZERO_BUBBLE_SCHEDULES and split_backward_graph_refusal(graph):
        raise AutoshardError(
            f"--schedule {pins.schedule} splits backward, but "
            f"{split_backward_graph_refusal(graph)}; pin --schedule 1f1b or interleaved-1f1b"
        )
    v = interleaved_v(pins)
    if v > 1 and pins.pp is not None and max_stages(graph) < v * pins.pp:
        schedule = pins.schedule or "interleaved-1f1b"
        fewer = "" if schedule in V_SCHEDULES else ", fewer --virtual-stages"
        raise AutoshardError(
            f"--schedule {schedule} puts {v} stages on each of --pp {pins.pp} ranks: needs "
            f"{v * pins.pp} blocks, the model has {blocks}; use 1f1b{fewer} or "
            f"--pp {max(1, blocks // v)}"
        )
    _check_pinned_cuts(graph, pins)
    _check_graph_ep(graph, pins)
    _check_graph_cp(graph, pins)
    _check_graph_float8(graph, pins)
    _check_graph_batch_norm(graph, pins)


def _check_graph_batch_norm(graph: OpGraph, pins: Pins) -> None:
    """--pp > 1 beside --dp > 1 on a BatchNorm model (``strategies.batch_norm_refusal``): one line."""
    if not pins.wants_pipeline or (pins.dp or 1) == 1:
        return
    why = batch_norm_refusal(graph, Mesh(dp=pins.dp, pp=pins.pp or 2))
    if why:
        raise AutoshardError(f"--dp {pins.dp} with pipeline stages: {why}; pin --dp 1 or --pp 1")


def _check_graph_cp(graph: OpGraph, pins: Pins) -> None:
    """--cp c > 1 needs sequences the ring can split (``passes.planning.context_parallel.cp_refusal``), and with
    pipeline stages attention without an explicit mask (``pipeline_cp_refusal``)."""
    c = pins.cp or 1
    if c == 1:
        return
    why = cp_refusal(graph, c)
    if why:
        legal = [d for d in divisors(max(1, graph.tokens_per_sample))[1:9] if cp_refusal(graph, d) is None]
        fix = f"pin --cp in {legal}" if legal else "pin --cp 1"
        raise AutoshardError(f"--cp {c}: {why}; {fix}")
    if pins.wants_pipeline and pipeline_cp_refusal(graph):
        raise AutoshardError(f"--cp {c} with pipeline stages: {pipeline_cp_refusal(graph)}; pin --pp 1 or --cp 1")
    if (pins.ep or 1) > 1 or (pins.dp_replicate or 1) > 1:
        raise AutoshardError(
            f"--cp {c} is planned without expert parallelism and HSDP; drop --ep / --dp-replicate or pin --cp 1"
        )


def _check_graph_ep(graph: OpGraph, pins: Pins) -> None:
    """--ep e > 1 needs expert groups (``passes.capturing.experts``), each with a multiple of e experts."""
    e = pins.ep or 1
    if e == 1:
        return
    if not graph.experts:
        raise AutoshardError(
            f"--ep {e}: the model has no expert group whose experts can live on other ranks "
            f"(stacked per-expert weights read only by grouped matmuls); pin --ep 1"
        )
    uneven = sorted({g.experts for g in graph.experts if g.experts % e})
    if uneven:
        legal = [d for d in divisors(math.gcd(*(g.experts for g in graph.experts))) if d > 1]
        raise AutoshardError(
            f"--ep {e} must divide every expert group's experts ({uneven[0]} do not split "
            f"{e} ways); use --ep in {', '.join(map(str, legal)) or '1'}"
        )


def interleaved_v(pins: Pins) -> int:
    """Stages per rank the pins fix: --virtual-stages, else the pinned schedule's (2 for the interleaved
    and V schedules), else 1."""
    if pins.virtual_stages is not None:
        return pins.virtual_stages
    return dict(PIPELINE_SCHEDULES).get(pins.schedule, 1)


def _check_pinned_cuts(graph: OpGraph, pins: Pins) -> None:
    """--stage-cuts: each cut names a block after the first, in the model, where a stage may begin."""
    blocks, stages = len(graph.blocks), _pinned_stages(pins)
    cuts = pins.stage_cuts
    if cuts == STAGE_CUTS_EVEN:
        cuts = even_cuts(stages, blocks) if stages is not None and stages <= blocks else ()
    if not cuts:
        return
    if cuts[-1] >= blocks:
        raise AutoshardError(
            f"--stage-cuts names block {cuts[-1]}, but the model's blocks are 0 .. {blocks - 1} "
            f"(a stage begins at block 1 .. {blocks - 1}); fix the indices or use --stage-cuts even"
        )
    refused = [k for k in cuts if k in cut_refusals(graph)]
    if refused:
        raise AutoshardError(
            f"--stage-cuts: no stage can begin at block {refused[0]}: "
            f"{cut_refusals(graph)[refused[0]]}; choose other indices or drop --stage-cuts"
        )


def _check_cuts(graph: OpGraph, pins: Pins) -> None:
    """--pp (× v stages per rank with interleaved 1F1B) needs that many blocks a stage may begin at."""
    refusals = cut_refusals(graph)
    stages = (pins.pp or 1) * interleaved_v(pins)
    most = max_stages(graph, refusals)
    if refusals and stages > max(1, most):
        reasons = list(dict.fromkeys(refusals[k] for k in sorted(refusals)))  # each reason once, in block order
        why = "; ".join(reasons[:2]) + ("; ..." if len(reasons) > 2 else "")
        fix = f"pin --pp {most} or less" if most > 1 else "pin --pp 1"
        raise AutoshardError(
            f"--pp {pins.pp} needs {stages} pipeline stages, but a stage can begin at only "
            f"{max(1, most)} of this model's {len(graph.blocks)} blocks: {why}; {fix}"
        )
