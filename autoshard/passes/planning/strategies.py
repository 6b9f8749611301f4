"""Strategies: the configurations the planner may choose from, with the user's pins applied.

A configuration fixes the mesh (dp, tp, pp), the ZeRO stage, the micro-batch size b (and so
the number of micro-batches m = B / (dp·b)), the recompute mode and, for pp > 1, the schedule
and virtual stages v. The space is what the runtime supports (``candidate_meshes``,
``mesh_configs``)::

    dp · tp · pp = world size,   B mod dp = 0
    tp | devices_per_node        (TP stays inside a node), check_divisibility(graph, tp) = ∅
    pp ≤ L blocks
    ZeRO (how each runs: ``ir.decisions.DP_RUNTIMES``): dp = 1 → 0;  pp = 1 → 0-3;  pp > 1 → 0, 1, 3
          (a pipeline schedule sums gradients whole until the last micro-batch, so ZeRO-2 would be ZeRO-1)
    HSDP (ZeRO-2/3, pp = 1, dp over n > 1 nodes, g > 1 of its ranks per node): dp_replicate = n,
          FSDP2 shards over the g ranks of a node and all-reduces across nodes; also dp_replicate = 1
    EP (models with expert groups, ``passes.capturing.experts``): ep | dp and ep | E of every group, tp = 1,
          dp_replicate = 1; also ep = 1 (``ep_degrees``)
    recompute: none | selective | full, and alternate (torchtitan's op-level policy) where pinned, pp = 1 only
    pp > 1: recompute none | selective | full, one mode for all blocks (``runtime.stage_recompute``;
            per-block mixed stays pp = 1's, ``passes.planning.recompute``); m ≥ pp; schedule gpipe |
            1f1b (v = 1) | interleaved-1f1b (v = 2, or --virtual-stages v > 1; L ≥ v·pp,
            m mod max(1, ⌊m/pp⌋) = 0: torch's interleaved rounds) | interleaved-zb (the same, zero
            bubble) | zbv (v = 2 in a V, L ≥ 2·pp) | dualpipev (v = 2 in a V, L ≥ 2·pp, m ≥ 2·pp)
            (``microbatch_refusal``); the zero-bubble ones (split backward) not with ZeRO-3 or selective
            recompute (``split_backward_refusal``)
    pp = 1: schedule none
    loss parallelism (tp > 1, pp = 1, cp = 1, the loss proven the default cross-entropy on the output projection's
            logits: ``OpGraph.loss_parallel_proof``): on or off (``loss_parallel_choices``); a point whose TP layout
            gathers no output projection is dropped by the search
    compile: off, or on where pinned (``--compile on``), on meshes with pp = 1, cp = 1 and ep = 1 only
            (``ir.decisions.compile_runs``): the search never turns it on, since compiling costs each launch
            its start-up (tens of seconds per block kind on CPU ranks, minutes on large models)
    float8 (torchao's Float8Linear on the linears ``cost.float8.float8_linears`` names): off, and tensorwise on
            a device with float8 matmuls (``DeviceSpec.float8_tflops`` > 0) when the model has such linears,
            on meshes with pp = 1, tp = 1 and ep = 1 (``ir.decisions.float8_runs``); rowwise only where pinned
            (``--float8``): it prices above tensorwise (twice the casts, the same matmuls) and is chosen for its
            numerics, not its speed (``float8_choices``)
    offload (FSDP2's CPUOffloadPolicy: ZeRO-3's shards and the optimizer step on the host): none, and cpu on GPU
            clusters (nccl) for ZeRO-3 over dp > 1 without pipeline stages, ep or cp (``ir.decisions.offload_refusal``;
            ``offload_choices``); searched, so it is chosen where it lets a plan fit or wins (priced by
            ``cost.offload``: the host link's copies, the optimizer on the CPU, the host memory per node);
            --offload nvme is refused (no maintained library offloads FSDP2's state to NVMe)
    --stage-cuts: the pp·v − 1 cuts fixed (``pinned_cuts``; "even" is Megatron-LM's L/(pp·v)
            blocks per stage), else ``passes.planning.stage_cuts`` chooses them

The pins are ``ir.pins.Pins`` (one field per row of ``ir.pins.PINS``, each row's check run
when they are made). Pins that fall outside the space are refused with one line naming the fix;
``check_pins`` does the checks that need no graph before capture (seconds on large models).
``Pins.with_defaults`` fills the decisions with a natural default (virtual stages follow the
schedule), for ``estimate``.
"""

from __future__ import annotations

import math
from dataclasses import replace

from autoshard.cost.float8 import float8_linears
from autoshard.cost.units import node_units
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import (
    ALTERNATE,
    FLOAT8_OFF,
    OFFLOAD_CPU,
    OFFLOAD_NONE,
    OFFLOAD_NVME,
    PIN_RECOMPUTE,
    PIPELINE_SCHEDULES,
    RECOMPUTE_MODES,
    SCHEDULES,
    V_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    ZERO_STAGES,
    Decisions,
    Mesh,
    compile_runs,
    float8_runs,
    offload_refusal,
)
from autoshard.ir.graph import OpGraph
from autoshard.ir.pins import STAGE_CUTS_EVEN, Pins
from autoshard.ir.topology import Cluster
from autoshard.passes.layouts.allowed import check_divisibility
from autoshard.passes.planning.context_parallel import cp_refusal, pipeline_cp_refusal, searched_cp_degrees
from autoshard.passes.planning.stage_cuts import cut_refusals, max_stages

MAX_MICROBATCH_CHOICES = 12  # the largest divisors of the per-rank batch are tried
# The largest global batch planned: 2^30 samples per step, ~10^5 times the largest in use (a few
# thousand sequences); divisors are found by trial division up to its square root (32,768 steps).
MAX_GLOBAL_BATCH = 2**30
# Zero-bubble schedules are priced by running their orders (pp·m·v·3 actions, once per (pp, m, v): see
# cost.schedule.schedule_makespan_s); unpinned, the search tries them up to this pp, which keeps a 1T-model
# search on thousands of GPUs within 20 s (at pp 64 one shape is ~10^5 actions); --schedule zbv (or another
# zero-bubble schedule) prices any pp.
MAX_SEARCHED_ZERO_BUBBLE_PP = 8
LOOPED_SCHEDULES = ("interleaved-1f1b", "interleaved-zb")  # v > 1 stages per rank, r, r + pp, ...; any v > 1


def pinned_cuts(stage_cuts: str | tuple[int, ...] | None, config: Decisions, blocks: int) -> tuple[int, ...] | None:
    """The cuts ``--stage-cuts`` fixes for ``config`` (``STAGE_CUTS_EVEN`` worked out for its pp·v stages),
    or None where the planner chooses them (unpinned, or no pipeline)."""
    if stage_cuts is None or config.mesh.pp == 1:
        return None
    if stage_cuts == STAGE_CUTS_EVEN:
        return even_cuts(config.num_stages, blocks)
    return tuple(stage_cuts)


def even_cuts(stages: int, blocks: int) -> tuple[int, ...]:
    """⌊k·L / S⌋ for k = 1 .. S − 1: L / S blocks per stage when S divides L (Megatron-LM's split)."""
    return tuple(k * blocks // stages for k in range(1, stages))


# ---------------------------------------------------------------------------- pins, before capture


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
        raise AutoshardError(_batch_message(global_batch, pins.dp))
    _check_zero(pins)
    _check_ep(pins)
    _check_sequence_parallel(pins)
    _check_loss_parallel(pins)
    _check_precision(pins)
    _check_compile(pins)
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
    why = offload_refusal(mesh, zero, pins.ep or 1, cluster.backend)
    if why:
        raise AutoshardError(f"--offload cpu: {why}; pin --offload none, or --zero 3 --pp 1 on a GPU cluster")


def fp16_runs(c: Decisions) -> bool:
    """Where --precision fp16's loss scaling is emitted and verified: the SPMD loop (a pipeline's schedule runs
    the backward itself), without TP (the scaler's unscale mixes TP's DTensor gradients with plain ones), expert
    or context parallelism; DDP, ZeroRedundancyOptimizer and FSDP2 (ShardedGradScaler) over dp."""
    return c.mesh.pp == 1 and c.mesh.tp == 1 and c.mesh.cp == 1 and c.ep == 1


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
    for flag, value, why in (
        ("--pp", pins.pp, "pipeline stages are traced, and torchao's float8 tensors are not traced by the split yet"),
        ("--tp", pins.tp, "torchao's float8 TP styles are not among autoshard's yet"),
        ("--ep", pins.ep, "expert shards are not converted"),
    ):
        if (value or 1) > 1:
            raise AutoshardError(
                f"--float8 {pins.float8} with {flag} {value} is not emitted yet ({why}); pin {flag} 1 or --float8 off"
            )


def float8_choices(graph: OpGraph, cluster: Cluster, pins: Pins) -> tuple[str, ...]:
    """The float8 values searched (module doc): the pinned one; else off, and tensorwise where the device has
    float8 matmuls and the model has linears torchao converts."""
    if pins.float8 is not None:
        return (pins.float8,)
    if cluster.device.has_float8 and float8_linears(graph):
        return (FLOAT8_OFF, "tensorwise")
    return (FLOAT8_OFF,)


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
    if pins.wants_pipeline:
        raise AutoshardError(
            "--compile on with pipeline stages is not emitted yet (each stage is a traced graph whose blocks are "
            "regions, not modules); pin --pp 1 or --compile off"
        )
    for flag, value, why in (
        ("--cp", pins.cp, "its ring replaces attention outside the compiled graph"),
        ("--ep", pins.ep, "its all-to-all dispatch is not traced"),
    ):
        if (value or 1) > 1:
            raise AutoshardError(
                f"--compile on with {flag} {value} is not emitted yet ({why}); pin {flag} 1 or --compile off"
            )
    tp = Mesh(tp=pins.tp) if (pins.tp or 1) > 1 else None
    if tp and pins.recompute and not compile_runs(tp, 1, bool(pins.sequence_parallel), pins.recompute):
        sp = " and --sequence-parallel on" if pins.sequence_parallel else ""
        raise AutoshardError(
            f"--compile on with --tp {pins.tp}{sp} and --recompute {pins.recompute} is not emitted yet (dynamo cannot "
            f"trace that checkpointed block); pin --recompute none (or selective without sequence parallelism), or "
            f"--compile off"
        )


def _check_loss_parallel(pins: Pins) -> None:
    """--loss-parallel on: a mesh that may run it (``loss_parallel_refusal``), as far as the pins say."""
    if not pins.loss_parallel:
        return
    mesh = Mesh(tp=pins.tp or 2, pp=2 if pins.wants_pipeline else 1, cp=pins.cp or 1)
    why = loss_parallel_refusal(mesh, "")
    if why:
        raise AutoshardError(f"--loss-parallel on: {why}; pin --tp 2 or more without --pp or --cp, or leave it off")


def _check_sequence_parallel(pins: Pins) -> None:
    """--sequence-parallel on: TP's layout, with or without pipeline stages (``sequence_parallel_choices``)."""
    if not pins.sequence_parallel:
        return
    if pins.tp == 1:
        raise AutoshardError(
            "--sequence-parallel on shards TP's regions along the sequence, and --tp 1 has no TP; "
            "pin --tp 2 or more, or --sequence-parallel off"
        )
    if (pins.pp or 1) > 1 and (pins.cp or 1) > 1:
        raise AutoshardError(
            f"--sequence-parallel on with --pp {pins.pp} and --cp {pins.cp}: sequence shards of a cp rank's tokens "
            "inside pipeline stages are not emitted yet; pin --sequence-parallel off, --cp 1 or --pp 1"
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


def split_backward_refusal(zero: int | None, recompute: str | None) -> str:
    """Why a zero-bubble schedule (backward split into the inputs' and the weights' gradients, torch's
    ``stage_backward_input`` / ``stage_backward_weight``) cannot run with this ZeRO stage and recompute
    mode ("" when it can), found on CPU ranks against one process (``tests/e2e/test_pipeline_schedules.py``):
    ZeRO-3 trains to other weights (FSDP2's post-backward, which reshards the stage's weights and
    reduce-scatters their gradients, runs when the gradient reaches the stage's inputs, so at the end of I
    and before W); selective recompute's saved-tensor policy lets a region run backward once, not twice.
    Full recompute runs at any tp: the stage inputs a stage passes on keep needing a gradient into the weight
    pass (``runtime.pipeline_parallel._keep_passed_inputs_needing_grad``; without it Llama's rotary inputs
    made the rerun save fewer tensors than the forward, at tp 2 and at tp 1 alike)."""
    if zero == 3:
        return (
            "--zero 3: FSDP2 reshards each stage and reduce-scatters its gradients when the input gradient "
            "is done, before the split backward's weight gradients; pin --zero 1, or a schedule without "
            "split backward (1f1b, interleaved-1f1b)"
        )
    if recompute == "selective":
        return (
            "--recompute selective: its policy lets a recomputed region run backward once, and the split "
            "backward runs it twice; pin --recompute full or none, or --schedule 1f1b"
        )
    return ""


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


def _batch_message(global_batch: int, dp: int) -> str:
    near = max(dp, global_batch // dp * dp)
    return f"global batch {global_batch} is not divisible by dp={dp}; use --global-batch {near} or {near + dp}"


# ---------------------------------------------------------------------------- the space


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
        if _honours_cuts(c, pins, len(graph.blocks), refusals)
        and (split_backward or c.schedule not in ZERO_BUBBLE_SCHEDULES)
        and (not graph.batch_coupling or keeps_batch_whole(c))
        and (pins.precision != "fp16" or fp16_runs(c))
    ]  # loss scaling: _check_precision
    if not configs:
        raise AutoshardError(explain_no_config(graph, cluster, global_batch, pins))
    return configs


def offload_choices(c: Decisions, pins: Pins, cluster: Cluster) -> tuple[str, ...]:
    """The offload values searched for point ``c``: the pinned one where it runs; else none, and cpu where
    ``offload_refusal`` has no reason against it."""
    runs = offload_refusal(c.mesh, c.zero_stage, c.ep, cluster.backend) is None
    if pins.offload is not None:
        return (pins.offload,) if pins.offload == OFFLOAD_NONE or runs else ()
    return (OFFLOAD_NONE, OFFLOAD_CPU) if runs else (OFFLOAD_NONE,)


def with_offload_choices(c: Decisions, pins: Pins, cluster: Cluster) -> list[Decisions]:
    """``c`` with each of its ``offload_choices``."""
    return [c if o == OFFLOAD_NONE else replace(c, offload=o) for o in offload_choices(c, pins, cluster)]


def keeps_batch_whole(c: Decisions) -> bool:
    """One rank computes the loss of the whole batch at once: no dp or cp shares, one micro-batch. What a model
    whose loss couples the samples of a batch needs (``passes.capturing.batch_coupling``)."""
    return c.mesh.dp == 1 and c.mesh.cp == 1 and c.num_microbatches == 1


def batch_coupling_refusal(graph: OpGraph, pins: Pins) -> str:
    """Why no configuration honouring the pins keeps the batch whole, for a model whose loss couples its samples."""
    split = [
        f"--{name.replace('_', '-')} {value}" for name, value in (("dp", pins.dp), ("cp", pins.cp)) if (value or 1) > 1
    ]
    how = (
        f"{' and '.join(split)} splits" if split else "every configuration of this cluster that honours the pins splits"
    )
    return (
        f"{how} the batch over ranks or micro-batches, but {graph.batch_coupling}; plan with --dp 1 and one "
        f"micro-batch (tensor or pipeline parallelism over the devices), or make the loss a mean over samples"
    )


def split_backward_graph_refusal(graph: OpGraph) -> str:
    """Why torch's split backward would leave part of a weight's gradient out on this model ("" when not).

    On every stage but the first, ``stage_backward_input`` keeps the gradient at the values where a
    weight's forward cone meets a value made from the stage's inputs that need gradients (D), and
    ``stage_backward_weight`` goes from there to the weight; gradient reaching a weight by a path that
    meets no value of D (T5's relative position bias made from positions and handed to the next
    block, its decoder embedding of token ids) is dropped; stage 0 runs its backward whole. Cuts fall
    between units (``cost.units``: the ops before block 0, each block, the ops after), so a value made
    from weights but from no first-unit value needing gradients (a weight's transpose, Gemma's 1 + w)
    is safe while it is used in its own unit, where it meets D, and refused once a later unit reads it:
    a cut could fall in between, for any cuts the search may choose."""
    trainable = {name for p in graph.params if not p.is_buffer for name in (p.name, *p.tied_to)}
    needs_grad: set[str] = set()  # values made from a trainable weight
    from_first: set[str] = set()  # values made from a first-unit value that needs gradients (in D at every cut)
    loose: dict[str, tuple[int, str]] = {}  # needs gradients, not from_first -> (its unit, the weight behind it)
    for node, unit in zip(graph.nodes, node_units(graph)):
        weights = [
            w for w in (*node.param_inputs, *(graph.placeholder_params.get(i) for i in node.inputs)) if w in trainable
        ]
        crossing = [loose[i][1] for i in node.inputs if i in loose and loose[i][0] != unit]
        if crossing:
            return (
                f"{crossing[0]} reaches {node.module_path or 'the forward'} through values made from no "
                f"input that needs gradients, and torch's split backward would drop that part of its gradient"
            )
        if weights or any(i in needs_grad for i in node.inputs):
            needs_grad.add(node.name)
        if (unit == 0 and node.name in needs_grad) or any(i in from_first for i in node.inputs):
            from_first.add(node.name)
        elif node.name in needs_grad:
            loose[node.name] = (unit, weights[0] if weights else next(loose[i][1] for i in node.inputs if i in loose))
    return ""


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
    v = _interleaved_v(pins)
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


def _interleaved_v(pins: Pins) -> int:
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
    stages = (pins.pp or 1) * _interleaved_v(pins)
    most = max_stages(graph, refusals)
    if refusals and stages > max(1, most):
        why = "; ".join(refusals[k] for k in sorted(refusals)[:2]) + ("; ..." if len(refusals) > 2 else "")
        fix = f"pin --pp {most} or less" if most > 1 else "pin --pp 1"
        raise AutoshardError(
            f"--pp {pins.pp} needs {stages} pipeline stages, but a stage can begin at only "
            f"{max(1, most)} of this model's {len(graph.blocks)} blocks: {why}; {fix}"
        )


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(√n) steps: each d ≤ √n that divides n, and n / d."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def legal_tp_degrees(graph: OpGraph, cluster: Cluster) -> list[int]:
    """tp that divides devices_per_node and the world, and splits every attention's heads."""
    return [t for t in [1, *cluster.tp_degrees()] if not check_divisibility(graph, t)]


def pipeline_degrees(graph: OpGraph, world_size: int) -> list[int]:
    """pp > 1 dividing the world, at most one stage per block a stage may begin at (``stage_cuts``)."""
    return [p for p in divisors(world_size) if 1 < p <= max_stages(graph)]


def candidate_meshes(graph: OpGraph, cluster: Cluster, global_batch: int, pins: Pins) -> list[Mesh]:
    """(dp, tp, pp, cp) honouring the pins: pure DP first, then tp ascending, then pp ascending, cp last
    (``cp_choices``)."""
    world = cluster.world_size
    meshes = []
    for tp in legal_tp_degrees(graph, cluster):
        for pp in [1] + pipeline_degrees(graph, world // tp):
            for cp in cp_choices(graph, world // (tp * pp), pp, pins):
                dp = world // (tp * pp * cp)
                mesh = Mesh(dp=dp, tp=tp, pp=pp, cp=cp)
                if global_batch % dp or not _honours(mesh, pins) or not stages_fit_groups(cluster, mesh):
                    continue
                meshes.append(mesh)
    return meshes


def stages_fit_groups(cluster: Cluster, mesh: Mesh) -> bool:
    """Whether each pipeline rank's ranks lie inside one node group (always on a homogeneous cluster). A pp rank
    holds world/pp consecutive ranks (``ir.decisions.Mesh``) and a group consecutive whole nodes, so this holds
    when every group's rank count is a multiple of world/pp. An SPMD mesh (pp = 1) spans the groups and runs at the
    slowest group's pace (``topology.slowest_device``); a pipeline whose stage would span two groups is not offered:
    its stage would run at the slower group's pace and the cuts could not give the faster one more work."""
    if not cluster.groups or mesh.pp == 1:
        return True
    per_stage = mesh.world_size // mesh.pp
    return all((g.nodes * cluster.devices_per_node) % per_stage == 0 for g in cluster.groups)


def group_refusal(cluster: Cluster, pp: int) -> str | None:
    """Why --pp ``pp`` cannot run on this cluster's node groups (``stages_fit_groups``), or None."""
    world = cluster.world_size
    if stages_fit_groups(cluster, Mesh(dp=world // pp, pp=pp)):
        return None
    sizes = ", ".join(f"{g.name} {g.nodes * cluster.devices_per_node}" for g in cluster.groups)
    fitting = [p for p in divisors(world) if p > 1 and stages_fit_groups(cluster, Mesh(dp=world // p, pp=p))]
    return (
        f"--pp {pp} puts {cluster.world_size // pp} ranks in each pipeline stage, which would span two node groups "
        f"(ranks per group: {sizes}); pin --pp in {', '.join(map(str, fitting))} or leave it to the search"
    )


def cp_choices(graph: OpGraph, ranks: int, pp: int, pins: Pins) -> list[int]:
    """cp over ``ranks`` = dp·cp ranks: the pinned one, else 1 and the degrees ``passes.planning.context_parallel``
    offers for long sequences; with pipeline stages (pp > 1) only where they can run the ring
    (``pipeline_cp_refusal``)."""
    ring = pp == 1 or pipeline_cp_refusal(graph) is None
    if pins.cp is not None:
        return [pins.cp] if ranks % pins.cp == 0 and (pins.cp == 1 or ring) else []
    return [1] + (searched_cp_degrees(graph, ranks) if ring else [])


def _honours(mesh: Mesh, pins: Pins) -> bool:
    degrees = all(getattr(pins, a) in (None, getattr(mesh, a)) for a in ("dp", "tp", "pp", "cp"))
    schedule = pins.schedule is None or (pins.schedule == "none") == (mesh.pp == 1)
    staged = mesh.pp > 1 or ((pins.virtual_stages or 1) == 1 and pins.stage_cuts is None)
    return degrees and schedule and staged


def _honours_cuts(config: Decisions, pins: Pins, blocks: int, refusals: dict[int, str]) -> bool:
    """Explicit --stage-cuts fix the number of stages pp·v to one more than their count; --stage-cuts even
    keeps the configurations whose even cuts all begin a stage where one may begin (``cut_refusals``)."""
    if isinstance(pins.stage_cuts, tuple):
        return config.num_stages == len(pins.stage_cuts) + 1
    cuts = pinned_cuts(pins.stage_cuts, config, blocks)
    return cuts is None or not refusals.keys() & set(cuts)


def mesh_configs(
    mesh: Mesh,
    global_batch: int,
    pins: Pins,
    blocks: int,
    cluster: Cluster | None = None,
    experts: tuple[int, ...] = (),
    float8s: tuple[str, ...] = (FLOAT8_OFF,),
    loss_proof: str | None = None,
) -> list[Decisions]:
    """The configurations of one mesh (module doc), zero stage outermost; HSDP variants where the dp
    group spans nodes of ``cluster``; ep variants where the model has expert groups of ``experts`` each;
    float8 variants of ``float8s`` (``float8_choices``) where they run; loss parallelism where ``loss_proof``
    (``OpGraph.loss_parallel_proof``) is "" (``loss_parallel_choices``)."""
    configs = _mesh_configs(mesh, global_batch, pins, blocks)
    compiled = bool(pins.compile)  # off unless pinned: compiling costs each launch minutes of start-up
    return [
        replace(c, dp_replicate=r, ep=e, sequence_parallel=sp, loss_parallel=lp, compile=compiled, float8=f8)
        for f8 in float8s
        for c in configs
        for r in (hsdp_replicas(mesh, c.zero_stage, cluster) if cluster is not None else (1,))
        if pins.dp_replicate in (None, r)
        for e in ep_degrees(mesh, experts, r)
        if pins.ep in (None, e)
        for sp in sequence_parallel_choices(mesh)
        if pins.sequence_parallel in (None, sp)
        for lp in loss_parallel_choices(mesh, loss_proof)
        if pins.loss_parallel in (None, lp)
        if not compiled or compile_runs(mesh, e, sp, c.recompute)
        if f8 == FLOAT8_OFF or float8_runs(mesh, e)
    ]


def sequence_parallel_choices(mesh: Mesh) -> tuple[bool, ...]:
    """Sequence parallelism is a choice of the TP layout (tp > 1): SPMD, where DTensor's styles run it, and inside
    pipeline stages, where the sequence ops of ``runtime.tensor_parallel_stages`` do, but not beside cp there (a
    cp rank's token chunk split again over tp inside a traced stage does not build yet)."""
    return (False, True) if mesh.tp > 1 and not (mesh.pp > 1 and mesh.cp > 1) else (False,)


def loss_parallel_choices(mesh: Mesh, loss_proof: str | None) -> tuple[bool, ...]:
    """Loss parallelism is a choice of the SPMD TP layout where the loss is proven the default cross-entropy on
    the output projection's logits (``loss_proof`` ""): tp > 1, no pipeline (stages run TP on local shards and
    hand the loss whole logits), no cp (the ring's sequence shards are not checked with vocabulary shards)."""
    return (False, True) if loss_parallel_refusal(mesh, loss_proof) == "" else (False,)


def loss_parallel_refusal(mesh: Mesh, loss_proof: str | None) -> str:
    """Why ``mesh`` runs no loss parallelism ("" where it may; ``loss_parallel_choices``)."""
    if mesh.tp == 1:
        return "no TP: the logits are whole on each rank already"
    if mesh.pp > 1:
        return (
            "pipeline stages run TP on local shards with traced collectives and hand the schedule's loss whole "
            "logits; the output projection gathers them"
        )
    if mesh.cp > 1:
        return "context parallelism's sequence shards are not checked with vocabulary shards"
    if loss_proof is None:
        return "the loss was not checked (a graph without the proof)"
    return loss_proof


def ep_degrees(mesh: Mesh, experts: tuple[int, ...], dp_replicate: int = 1) -> tuple[int, ...]:
    """ep choices (module doc): 1, and each e > 1 dividing dp and every group's experts, with tp = 1 and
    no HSDP."""
    if not experts or mesh.tp > 1 or dp_replicate > 1 or mesh.cp > 1:
        return (1,)
    common = math.gcd(*experts)
    return (1, *(e for e in divisors(mesh.dp) if e > 1 and common % e == 0))


def _mesh_configs(mesh: Mesh, global_batch: int, pins: Pins, blocks: int) -> list[Decisions]:
    per_rank = global_batch // mesh.dp
    zeros = [z for z in zero_stages(mesh) if pins.zero_stage in (None, z)]
    recomputes = [pins.recompute] if pins.recompute else list(RECOMPUTE_MODES)  # alternate only where pinned
    recomputes = [r for r in recomputes if r != ALTERNATE or mesh.pp == 1]  # _check_alternate
    out = []
    for schedule, v in schedule_choices(mesh, blocks, pins):
        for b in microbatch_sizes(per_rank, pins.microbatch_size, mesh.pp):
            m = per_rank // b
            if microbatch_refusal(schedule, mesh.pp, m):
                continue
            out += [
                Decisions(
                    mesh=mesh,
                    zero_stage=z,
                    microbatch_size=b,
                    num_microbatches=m,
                    recompute=r,
                    schedule=schedule,
                    virtual_stages=v,
                )
                for z in zeros
                for r in recomputes
                if schedule not in ZERO_BUBBLE_SCHEDULES or not split_backward_refusal(z, r)
            ]
    return sorted(
        out,
        key=lambda c: (
            SCHEDULES.index(c.schedule),
            c.zero_stage,
            -c.microbatch_size,
            PIN_RECOMPUTE.index(c.recompute),
        ),
    )


def zero_stages(mesh: Mesh) -> tuple[int, ...]:
    """ZeRO stages the runtime runs on ``mesh`` (module doc; ``ir.decisions.dp_runtime``); the dp·cp ranks
    hold the same parameters, so ZeRO shards over them."""
    if mesh.dp_cp == 1:
        return (0,)
    return (0, 1, 3) if mesh.pp > 1 else ZERO_STAGES


def hsdp_replicas(mesh: Mesh, zero_stage: int, cluster: Cluster) -> tuple[int, ...]:
    """dp_replicate choices: 1, and under ZeRO-2/3 without pipelining the nodes the dp group spans when
    each holds g > 1 of its ranks (shard inside a node, replicate across: torchtitan's HSDP)."""
    if zero_stage < 2 or mesh.pp > 1 or mesh.dp == 1 or mesh.cp > 1:
        return (1,)
    ranks = [d * mesh.tp for d in range(mesh.dp)]  # rank 0's dp group, (pp, dp, tp) with tp innermost
    per_node = sum(cluster.node_of(r) == 0 for r in ranks)
    nodes = mesh.dp // per_node
    return (1, nodes) if nodes > 1 and per_node > 1 and mesh.dp % per_node == 0 else (1,)


def schedule_choices(mesh: Mesh, blocks: int, pins: Pins) -> list[tuple[str, int]]:
    """The schedules of a pp > 1 mesh; unpinned zero-bubble schedules up to ``MAX_SEARCHED_ZERO_BUBBLE_PP``."""
    if mesh.pp == 1:
        return [("none", 1)]
    return [
        (s, v)
        for s, v in _schedules_of(pins)
        if pins.schedule in (None, s)
        and blocks >= v * mesh.pp
        and (s not in ZERO_BUBBLE_SCHEDULES or pins.schedule == s or mesh.pp <= MAX_SEARCHED_ZERO_BUBBLE_PP)
    ]


def _schedules_of(pins: Pins) -> tuple[tuple[str, int], ...]:
    """PIPELINE_SCHEDULES, with --virtual-stages v: the schedules that run v stages per rank."""
    v = pins.virtual_stages
    if v is None:
        return PIPELINE_SCHEDULES
    return tuple((s, v) for s, _ in PIPELINE_SCHEDULES if runs_virtual_stages(s, v))


def microbatch_refusal(schedule: str, pp: int, m: int) -> str:
    """Why torch's ``schedule`` cannot run m micro-batches over pp ranks ("" when it can): the interleaved
    schedules run them in max(1, ⌊m/pp⌋) rounds that must divide m; DualPipeV needs m ≥ 2·pp (its stages)."""
    rounds = max(1, m // pp)
    if schedule in LOOPED_SCHEDULES and m % rounds:
        return (
            f"{schedule} runs the {m} micro-batches in rounds of {m // rounds}, and the {rounds} rounds must "
            f"divide {m}; pick a micro-batch size that leaves a multiple of pp={pp} micro-batches"
        )
    if schedule == "dualpipev" and m < 2 * pp:
        return (
            f"dualpipev needs at least 2·pp = {2 * pp} micro-batches (one per stage), got {m}; pick a smaller "
            f"micro-batch size or a larger --global-batch"
        )
    return ""


def runs_virtual_stages(schedule: str, v: int) -> bool:
    """Whether ``schedule`` runs v stages per rank: the interleaved ones any v > 1, the others their own v
    (the V schedules exactly 2)."""
    return v > 1 if schedule in LOOPED_SCHEDULES else dict(PIPELINE_SCHEDULES).get(schedule, 1) == v


def microbatch_sizes(per_rank_batch: int, pinned: int | None, min_microbatches: int = 1) -> list[int]:
    """Divisors of the per-rank batch giving at least ``min_microbatches``, largest first."""
    divisors_ = [b for b in reversed(divisors(per_rank_batch)) if per_rank_batch // b >= min_microbatches]
    if pinned is not None:
        return [pinned] if pinned in divisors_ else []
    return divisors_[:MAX_MICROBATCH_CHOICES]


def explain_no_config(graph: OpGraph, cluster: Cluster, global_batch: int, pins: Pins) -> str:
    """Why the pins leave nothing to plan, with the fix."""
    if graph.batch_coupling:
        return batch_coupling_refusal(graph, pins)
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
            return _batch_message(global_batch, min(dps))
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
        if per_rank % pins.microbatch_size == 0 and m >= mesh.pp > 1 and _interleaved_v(pins) > 1 and why:
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
    if pins.float8 not in (None, FLOAT8_OFF) and not any(float8_runs(m) for m in meshes):
        return (
            f"--float8 {pins.float8} converts the linears of plans without pipeline stages or tensor parallelism, "
            "and this cluster's meshes that honour the pins have one of them; pin --pp 1 --tp 1, or --float8 off"
        )
    if pins.offload == OFFLOAD_CPU and not any(offload_refusal(m, 3, 1, cluster.backend) is None for m in meshes):
        return (
            "--offload cpu offloads ZeRO-3 over dp > 1 without pipeline stages or cp, and this cluster's meshes that "
            "honour the pins have none such; pin --pp 1 and a --dp above 1, or --offload none"
        )
    if pins.compile and not any(compile_runs(m) for m in meshes):
        return (
            "--compile on compiles the blocks of plans without pipeline stages or context parallelism, and this "
            "cluster's meshes that honour the pins have one of them; pin --pp 1 --cp 1, or --compile off"
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
