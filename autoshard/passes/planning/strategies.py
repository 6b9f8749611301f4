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
    compile: off, or on where pinned (``--compile on``), on meshes with ep = 1, and beside cp or pipeline stages
            with recompute none or full, without tp beside cp, without cp in stages (``ir.decisions.compile_runs``): the search never turns it on, since compiling costs each launch
            its start-up (tens of seconds per block kind on CPU ranks, minutes on large models)
    async TP (inductor's micro-pipelined TP): off, and on under compile with tp > 1, sequence parallelism and NCCL
            ranks, without pipeline stages (``ir.decisions.async_tp_refusal``; ``async_tp_choices``), priced by
            ``cost.async_tp``
    float8 (torchao's Float8Linear on the linears ``cost.float8.float8_linears`` names): off, and tensorwise on
            a device with float8 matmuls (``DeviceSpec.float8_tflops`` > 0) when the model has such linears,
            on meshes with ep = 1 (``ir.decisions.float8_runs``); rowwise only where pinned
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
``pin_checks.check_pins`` does the checks that need no graph before capture (seconds on large models);
``space.candidate_configs`` is the space these functions enumerate, after ``pin_checks``.
``Pins.with_defaults`` fills the decisions with a natural default (virtual stages follow the
schedule), for ``estimate``.
"""

from __future__ import annotations

import math
from dataclasses import replace

from autoshard.cost.float8 import float8_linears
from autoshard.cost.units import node_units
from autoshard.ir.decisions import (
    ALTERNATE,
    FLOAT8_OFF,
    OFFLOAD_CPU,
    OFFLOAD_NONE,
    PIN_RECOMPUTE,
    PIPELINE_SCHEDULES,
    RECOMPUTE_MODES,
    SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    ZERO_STAGES,
    Decisions,
    Mesh,
    async_tp_refusal,
    compile_loss_refusal,
    compile_runs,
    float8_runs,
    offload_refusal,
)
from autoshard.ir.graph import OpGraph, hidden_backward_units
from autoshard.ir.names import has_batch_norm
from autoshard.ir.pins import STAGE_CUTS_EVEN, Pins
from autoshard.ir.topology import Cluster
from autoshard.passes.layouts.allowed import check_divisibility
from autoshard.passes.planning.context_parallel import pipeline_cp_refusal, searched_cp_degrees
from autoshard.passes.planning.stage_cuts import max_stages

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


def fp16_runs(c: Decisions) -> bool:
    """Where --precision fp16's loss scaling is emitted and verified: the SPMD loop (a pipeline's schedule runs
    the backward itself), without TP (the scaler's unscale mixes TP's DTensor gradients with plain ones), expert
    or context parallelism; DDP, ZeroRedundancyOptimizer and FSDP2 (ShardedGradScaler) over dp."""
    return c.mesh.pp == 1 and c.mesh.tp == 1 and c.mesh.cp == 1 and c.ep == 1


def float8_choices(graph: OpGraph, cluster: Cluster, pins: Pins) -> tuple[str, ...]:
    """The float8 values searched (module doc): the pinned one; else off, and tensorwise where the device has
    float8 matmuls and the model has linears torchao converts."""
    if pins.float8 is not None:
        return (pins.float8,)
    if cluster.device.has_float8 and float8_linears(graph):
        return (FLOAT8_OFF, "tensorwise")
    return (FLOAT8_OFF,)


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


def offload_choices(c: Decisions, pins: Pins, cluster: Cluster) -> tuple[str, ...]:
    """The offload values searched for point ``c``: the pinned one where it runs; else none, and cpu where
    ``offload_refusal`` has no reason against it."""
    runs = offload_refusal(c.mesh, c.zero_stage, c.ep, cluster.backend, c.float8) is None
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


def hidden_backward_refusal(graph: OpGraph, zero_stage: int) -> str:
    """Why ZeRO-3 cannot shard this model ("" where it can): FSDP2 shards a unit's parameters again after its
    forward, and an autograd Function's own backward that runs the unit again out of FSDP2's sight
    (``ir.graph.hidden_backward_units``) would meet them sharded; ZeRO-2 keeps them gathered until the end of the
    backward."""
    units = hidden_backward_units(graph) if zero_stage >= 3 else ()
    if not units:
        return ""
    return (
        f"--zero 3 shards each unit's parameters again after its forward, but {units[0]} runs inside an autograd "
        f"Function whose own backward runs it again (a reversible layer, a reentrant checkpoint), where FSDP2 would "
        f"hand it shards; pin --zero 2 (FSDP2 keeps the parameters gathered until the backward) or less"
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


def graph_batch_norm(graph: OpGraph) -> bool:
    """The captured model runs a batch normalisation (``ir.names.has_batch_norm``), which normalises over the
    samples of each micro-batch."""
    return graph.derived("has_batch_norm", lambda: has_batch_norm(node.target for node in graph.nodes))


def batch_norm_refusal(graph: OpGraph, mesh: Mesh) -> str:
    """Why ``mesh`` would normalise a BatchNorm model's micro-batch over other samples than one process ("" where
    it does not): BatchNorm's statistics are synchronised over dp in SPMD steps (``runtime.parallel.sync_batch_norm``
    swaps the modules for SyncBatchNorm), but a pipeline stage is a traced graph of aten ops with no module to
    swap, so each of dp > 1 ranks would normalise over its own b samples where one process normalises over dp·b."""
    if mesh.pp == 1 or mesh.dp == 1 or not graph_batch_norm(graph):
        return ""
    return (
        f"the model's BatchNorm would normalise over each dp rank's samples alone inside pipeline stages (their "
        f"statistics are synchronised over dp only without stages), and this mesh has dp {mesh.dp} beside pp "
        f"{mesh.pp}"
    )


def candidate_meshes(graph: OpGraph, cluster: Cluster, global_batch: int, pins: Pins) -> list[Mesh]:
    """(dp, tp, pp, cp) honouring the pins: pure DP first, then tp ascending, then pp ascending, cp last
    (``cp_choices``); pipelines of a BatchNorm model only at dp 1 (``batch_norm_refusal``)."""
    world = cluster.world_size
    meshes = []
    for tp in legal_tp_degrees(graph, cluster):
        for pp in [1] + pipeline_degrees(graph, world // tp):
            for cp in cp_choices(graph, world // (tp * pp), pp, pins):
                dp = world // (tp * pp * cp)
                mesh = Mesh(dp=dp, tp=tp, pp=pp, cp=cp)
                if global_batch % dp or not _honours(mesh, pins) or not stages_fit_groups(cluster, mesh):
                    continue
                if batch_norm_refusal(graph, mesh):
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


def honours_cuts(config: Decisions, pins: Pins, blocks: int, refusals: dict[int, str]) -> bool:
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
        replace(
            c,
            dp_replicate=r,
            ep=e,
            sequence_parallel=sp,
            loss_parallel=lp,
            compile=compiled,
            float8=f8,
            async_tp=at,
            compile_loss=cl,
        )
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
        if not compiled or compile_runs(mesh, e, sp, c.recompute, c.schedule)
        if f8 == FLOAT8_OFF or float8_runs(mesh, e)
        for at in async_tp_choices(mesh, compiled, sp, cluster)
        if pins.async_tp in (None, at)
        for cl in compile_loss_choices(mesh, compiled, pins.compile_loss, lp)
    ]


def compile_loss_choices(
    mesh: Mesh, compiled: bool, pinned: bool | None, loss_parallel: bool = False
) -> tuple[bool, ...]:
    """The compiled loss (``ir.decisions.compile_loss_refusal``): the pin where it runs, else on with compiled
    blocks (torchtitan compiles the loss with the model under --training.compile); off in pipelines and beside loss
    parallelism."""
    runs = not compile_loss_refusal(mesh, loss_parallel)
    if pinned is None:
        return (compiled and runs,)
    return (pinned,) if runs or not pinned else ()


def async_tp_choices(mesh: Mesh, compiled: bool, sequence_parallel: bool, cluster: Cluster | None) -> tuple[bool, ...]:
    """Async TP is searched where it runs (``ir.decisions.async_tp_refusal``: compiled blocks, tp > 1 with
    sequence parallelism, NCCL ranks); off elsewhere."""
    backend = cluster.backend if cluster is not None else "gloo"
    return (False, True) if not async_tp_refusal(mesh, compiled, sequence_parallel, backend) else (False,)


def sequence_parallel_choices(mesh: Mesh) -> tuple[bool, ...]:
    """Sequence parallelism is a choice of the TP layout (tp > 1): SPMD, where DTensor's styles run it, and inside
    pipeline stages, where the sequence ops of ``runtime.tensor_parallel_stages`` do, beside cp there too (the
    stages are traced on a cp rank's token chunk, which the sequence ops split again over tp)."""
    return (False, True) if mesh.tp > 1 else (False,)


def loss_parallel_choices(mesh: Mesh, loss_proof: str | None) -> tuple[bool, ...]:
    """Loss parallelism is a choice of the TP layout where the loss is proven the default cross-entropy on the
    output projection's logits (``loss_proof`` ""): tp > 1, SPMD or inside pipeline stages (the last stage hands
    the schedule's loss its vocabulary shard: ``runtime.pipeline_parallel``), with cp only inside pipeline stages
    (the loss on a cp rank's tokens is checked there; the SPMD ring's sequence shards are not checked with
    vocabulary shards)."""
    return (False, True) if loss_parallel_refusal(mesh, loss_proof) == "" else (False,)


def loss_parallel_refusal(mesh: Mesh, loss_proof: str | None) -> str:
    """Why ``mesh`` runs no loss parallelism ("" where it may; ``loss_parallel_choices``)."""
    if mesh.tp == 1:
        return "no TP: the logits are whole on each rank already"
    if mesh.cp > 1 and mesh.pp == 1:
        return "context parallelism's sequence shards are not checked with vocabulary shards outside pipeline stages"
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
