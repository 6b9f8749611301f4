"""Model profiles for ``autoshard calibrate --model SPEC``: capture the model, then measure it.

The parent captures each model as ``plan`` does (on meta) for its graph signature and block paths
(``profile_request``), before the minutes of measuring; every worker then builds the real model
with the runtime's recompute wrappers and times, for each micro-batch size b and recompute mode,
one micro-batch's forward and forward + backward (in interleaved rounds, ``_paired_rounds``), one AdamW
step, what the emitted program's step costs beyond these (``_step_ops``), and with the ranks in pairs the model's
own two-stage 1F1B pipeline (``_pipeline_times``) and its tensor-parallel layouts at tp 2 (``_tp_times``)
(``measure_model``). Their figures (``calibrate._time_blocks``: over blocks of calls, the slowest rank's block time per call) become an ``ir.profile.ModelProfile`` (``model_profile``), which the
cost model scales its units to (``cost.profile``); the parent fits the pipeline's schedule time per micro-batch
(``pipeline_residual``, ``with_pipeline``) and DTensor's host time per module (``tp_residual``, ``with_tp``) with the
cost model itself.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from autoshard.cost.profile import graph_signature
from autoshard.host_probes import paired_over_rounds
from autoshard.ir.profile import MODES, ModelProfile
from autoshard.pipeline import capture_graph


@dataclass(frozen=True)
class ProfileRequest:
    """A model ``autoshard calibrate --model`` measures: its spec, graph signature and block paths."""

    spec: str
    signature: str
    blocks: tuple[str, ...]
    microbatch_sizes: tuple[int, ...]
    # the tensor-parallel layouts timed at TP_PROBE_DEGREE (``probe_layouts``): (name, ((module, style), ...))
    tp_layouts: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()


def profile_request(spec: str, microbatch_sizes: tuple[int, ...]) -> ProfileRequest:
    """Capture the model (on meta, as ``plan`` does) for its signature, blocks and tensor-parallel layouts."""
    _, graph = capture_graph(spec)
    layouts = tuple((name, tuple(sorted(c.sharded.items()))) for name, c in probe_layouts(graph).items())
    return ProfileRequest(spec, graph_signature(graph), tuple(b.path for b in graph.blocks), microbatch_sizes, layouts)


TP_PROBE_DEGREE = 2  # the model's tensor-parallel steps are timed over ranks in pairs
TP_LAYOUTS = ("tp", "sp")  # Megatron's layout without and with sequence parallelism
RECOMPUTED = "+full"  # ``_tp_times``: the last layout timed again with full recompute, under its name + this


def probe_layouts(graph) -> dict[str, Any]:
    """The layouts ``_tp_times`` times (name -> ``TPChoice``): the layout model's at tp = TP_PROBE_DEGREE without and
    with sequence parallelism, solved on a link whose collectives cost nothing, so that every module the proof allows
    is sharded (on a slow link the model would keep every module whole without sequence parallelism, and there
    would be no DTensor module to time); a layout that shards nothing, or that the model refuses, is left out."""
    from autoshard.cost.hardware import load_cluster
    from autoshard.ir.topology import LinkSpec
    from autoshard.passes.layouts.allowed import check_divisibility, sp_available
    from autoshard.passes.layouts.styles import choose_tp_styles

    tp = TP_PROBE_DEGREE
    if check_divisibility(graph, tp):
        return {}
    free = LinkSpec(1e9, 1e-6, "a link whose collectives cost nothing")
    device = load_cluster("local-cpu", devices_per_node=tp).device  # on a free link the layouts shard all they can
    out = {}
    for name in TP_LAYOUTS:
        if name == "sp" and not sp_available(graph, tp):
            continue
        choice = choose_tp_styles(graph, tp, free, device, sequence_parallel=name == "sp")
        if any(style != "replicate" for style in choice.sharded.values()):
            out[name] = choice
    return out


PROFILE_ROUNDS = 3  # every size and mode timed in this many rounds, interleaved (``_paired_rounds``)


def measure_model(time_op, request: ProfileRequest, device, rounds: int = PROFILE_ROUNDS) -> dict[str, Any]:
    """Worker side: {"times": b -> mode -> [forward_s, forward_backward_s], "optimizer_s", "step_loop_s", "step_sync_s"} of the
    real model with the runtime's own recompute wrappers (``runtime.parallel.apply_recompute``), AdamW and step
    (``_step_ops``), on every rank at once. Every size and mode is timed once per round, ``rounds`` rounds one after
    the other, and the figures are their paired medians (``_paired_rounds``)."""
    import torch  # the worker's: the planning side of calibrate stays torch-free
    import torch.distributed as dist

    from autoshard.runtime.model import build_model, load_model_file
    from autoshard.runtime.parallel import apply_recompute

    model_file = load_model_file(request.spec)
    models = {
        mode: apply_recompute(build_model(model_file, seed=0, device=device), list(request.blocks), mode)
        for mode in MODES
    }
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    batches = {}
    for b in request.microbatch_sizes:
        torch.manual_seed(b)
        inputs, targets = model_file.example_batch(b)
        inputs = tuple(t.to(device) for t in inputs)
        batches[b] = (inputs, targets.to(device) if isinstance(targets, torch.Tensor) else targets)

    def forward(model, b):
        inputs, targets = batches[b]
        with autocast:  # as the emitted program runs on GPUs (bf16), a no-op on CPUs
            return model_file.loss(model(*inputs), targets)

    def one_round() -> dict[int, dict[str, list[float]]]:
        return {
            b: {
                mode: _forward_and_step(
                    time_op, lambda m=model, b=b: forward(m, b), lambda m=model, b=b: forward(m, b).backward()
                )
                for mode, model in models.items()
            }
            for b in request.microbatch_sizes
        }

    out = _paired_rounds([one_round() for _ in range(rounds)])
    optimizer = torch.optim.AdamW(models["none"].parameters(), lr=1e-3)  # the gradients are there
    optimizer_s = time_op(optimizer.step)
    b = max(request.microbatch_sizes)
    parts, whole, alone = _step_ops(model_file, models["none"], optimizer, batches[b], autocast, device)
    loop_rounds = [{"parts": time_op(parts), "whole": time_op(whole), "alone": time_op(alone)} for _ in range(rounds)]
    step_loop_s = max(0.0, statistics.median(r["whole"] - r["parts"] for r in loop_rounds))
    step_sync_s = min(step_loop_s, max(0.0, statistics.median(r["whole"] - r["alone"] for r in loop_rounds)))
    measured = {"times": out, "optimizer_s": optimizer_s, "step_loop_s": step_loop_s, "step_sync_s": step_sync_s}
    if _pipeline_measurable(request):
        measured["pipeline"] = _pipeline_times(time_op, model_file, request, device, rounds)
        wide = wide_stages(request, dist.get_world_size())
        if wide is not None:
            measured["wide_pipeline"] = _pipeline_times(time_op, model_file, request, device, rounds, wide)
    if request.tp_layouts and dist.get_world_size() % TP_PROBE_DEGREE == 0:
        measured["tp"] = _tp_times(time_op, model_file, request, forward, device, rounds)
    return measured


def _tp_times(time_op, model_file, request: ProfileRequest, forward, device, rounds: int) -> dict[str, float] | None:
    """Worker side: one micro-batch's forward + backward (b = the smallest size, no recompute) of the model under each
    of ``request.tp_layouts``, and under the last with full recompute (its name + RECOMPUTED), with the runtime's own
    tensor parallelism and recompute (``runtime.parallel.apply_tp``, ``apply_recompute``: DTensor's styles and the
    blocks' checkpoints, as an emitted program applies them), the ranks in pairs (a (dp N/2, tp 2) mesh, each pair a model of its
    own, no gradient synchronised). Every layout timed once per round, ``rounds`` rounds; each figure the median of
    its rounds. The parent takes from these DTensor's host time per module on this model (``tp_residual``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.runtime.model import build_model
    from autoshard.runtime.parallel import apply_recompute, apply_tp

    shape = (dist.get_world_size() // TP_PROBE_DEGREE, TP_PROBE_DEGREE)
    tp_mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "tp"))["tp"]
    b = min(request.microbatch_sizes)
    last, last_styles = request.tp_layouts[-1]
    try:  # the same on every rank, before any collective (a layout the runtime cannot apply is not timed)
        models = {
            name: apply_tp(build_model(model_file, seed=0, device=device), tp_mesh, dict(styles))
            for name, styles in request.tp_layouts
        }
        rerun = apply_tp(build_model(model_file, seed=0, device=device), tp_mesh, dict(last_styles))
        models[last + RECOMPUTED] = apply_recompute(rerun, list(request.blocks), "full")
    except Exception:  # noqa: BLE001 - any failure: the profile goes without, and the host probes price it
        return None
    steps = {name: functools.partial(lambda m: forward(m, b).backward(), model) for name, model in models.items()}
    timed = [{name: time_op(step) for name, step in steps.items()} for _ in range(rounds)]
    return {name: statistics.median(r[name] for r in timed) for name in steps}


# the model's 1F1B is timed at each; a line through all three (``pipeline_residual``)
MODEL_PIPELINE_MICROBATCHES = (2, 4, 8)


def pipeline_microbatches(stages: int) -> tuple[int, ...]:
    """The micro-batch counts a pipeline of ``stages`` stages is timed at: MODEL_PIPELINE_MICROBATCHES × ⌈p/2⌉, so that
    every count is at least p (torch's 1F1B runs no fewer micro-batches than stages)."""
    return tuple(m * -(-stages // 2) for m in MODEL_PIPELINE_MICROBATCHES)


PROBE_SCHEDULE_S = 1e-3  # δ of ``pipeline_residual``: a schedule time per micro-batch to price the pipeline with


def _pipeline_measurable(request: ProfileRequest) -> bool:
    """A two-stage pipeline of the model needs two blocks and the ranks in pairs."""
    import torch.distributed as dist

    return len(request.blocks) >= 2 and dist.get_world_size() % 2 == 0


def pipeline_splits(request: ProfileRequest, stages: int) -> tuple[str, ...]:
    """Where ``_pipeline_times`` cuts the model into ``stages`` stages: before blocks ⌊k·n/p⌋, k = 1 … p − 1, of its
    n blocks (p = 2: the middle block)."""
    n = len(request.blocks)
    return tuple(request.blocks[k * n // stages] for k in range(1, stages))


def wide_stages(request: ProfileRequest, ranks: int) -> int | None:
    """The most stages, above 2, that a pipeline of the model can have on ``ranks`` ranks in equal groups (a stage
    needs a block): p ≤ min(ranks, blocks), p dividing ranks; None where there is none (2 ranks, 2 blocks)."""
    fits = [p for p in range(3, min(ranks, len(request.blocks)) + 1) if ranks % p == 0]
    return max(fits, default=None)


def _pipeline_times(
    time_op, model_file, request: ProfileRequest, device, rounds: int, stages: int = 2
) -> dict[int, float] | None:
    """Worker side: the model's 1F1B step over ``stages`` stages (a (pp p, dp N/p) mesh: each group of p ranks a
    pipeline of its own, no gradient synchronised) at micro-batch b = the smallest size, for m ∈
    ``pipeline_microbatches(p)`` micro-batches, with the runtime's own pipeline (``runtime.pipeline_parallel``: the traced
    stages and torch's schedule, as an emitted program builds them), the model cut at ``pipeline_splits``. Timed in
    ``rounds`` rounds, each m's figure the smallest m's median plus the median of their difference
    (``host_probes.paired_over_rounds``). The parent takes from these what the cost model's pipeline formula leaves out
    for this model (``pipeline_residual``)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.runtime import pipeline_parallel as pp
    from autoshard.runtime.model import build_model

    counts = pipeline_microbatches(stages)
    b, most = min(request.microbatch_sizes), max(counts)
    mesh = init_device_mesh(device.type, (stages, dist.get_world_size() // stages), mesh_dim_names=("pp", "dp"))
    inputs, targets = model_file.example_batch(b * most)
    if not isinstance(targets, torch.Tensor):  # the schedule splits the targets along their first dim
        return None
    inputs, targets = tuple(t.to(device) for t in inputs), targets.to(device)
    steps = {}
    try:  # tracing: the same on every rank, before any collective (a model the split cannot trace is not timed)
        for m in counts:  # stages of their own per m: their buffers are sized by a first schedule
            parts = pp.build_pipeline_stages(
                build_model(model_file, seed=0, device=device),
                tuple(t[:b] for t in inputs),
                list(pipeline_splits(request, stages)),
                mesh.get_local_rank("pp"),
                stages,
                1,
                device,
                mesh.get_group("pp"),
            )
            schedule = pp.make_torch_schedule(parts, m, model_file.loss, "1f1b")
            batch = (tuple(t[: b * m] for t in inputs), targets[: b * m])
            optimizer = torch.optim.AdamW([p for stage in parts.stages for p in stage.submod.parameters()], lr=1e-3)
            steps[m] = functools.partial(_pipeline_step, pp, schedule, parts, batch, optimizer)
    except Exception:  # noqa: BLE001 - any tracing failure: the profile goes without, as for one block
        return None
    timed = [{m: time_op(step) for m, step in steps.items()} for _ in range(rounds)]
    return paired_over_rounds(timed, lambda _m: min(counts))


def _pipeline_step(pp, schedule, parts, batch, optimizer) -> None:
    """A pipeline program's step without its step loop: the schedule, the optimizer's step, the gradients freed (as
    an emitted pipeline program calls them)."""
    pp.pipeline_step(schedule, parts, *batch)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def pipeline_residual(
    request: ProfileRequest, times: Mapping, cluster, ranks: int, stages: int = 2
) -> tuple[float, float]:
    """Parent side: the pipeline schedule's own time that the model's measured 1F1B steps (``_pipeline_times``) hold
    beyond everything else the cost model prices in them, (per stage and micro-batch, per step): the least-squares line
    through the residuals r(m) = t(m) − Q(m) of the timed micro-batch counts against n(m), what schedule time per
    micro-batch and stage adds to the price per second of it (with shared cores the bubble's slot is partly free: an idle
    rank lends its core)::

        n(m) = [Q(m; x = δ) − Q(m)] / δ             δ = 1 ms; m + 1 on cores of their own (m slots, one of the bubble)
        x = Σ (n − n̄)(r − r̄) / Σ (n − n̄)²
        y = r̄ − n̄·x                                each clamped at 0 (y refitted as r̄ − n̄·x after x's clamp)

    Q(m): the cost model's price of one of the ``ranks`` / p pipelines that ran (p = ``stages`` cut at ``pipeline_splits``,
    1F1B, micro-batch b, m of them, no data parallelism: the timed step has no dp wrapper, and its AdamW is the
    profile's, on plain tensors) on ``cluster``, on its share of the node's cores where the ranks share them
    (``HostOverheads.shared_cores`` / pipelines), whose profile of this model scales the units (``cost.profile``), with
    no schedule time, less the step loop (the timed step has none). The price grows by n(m)·x + y (y once per step).
    The host probes fit the same two terms on a probe whose tiny stages keep both
    ranks waiting on each other at every transfer: on one 2-core VM the per-micro-batch term read 0.27-3.3 ms and the
    per-step one 0 through 2026-11-27, while a model's stages overlap part of that with compute."""
    from autoshard.cost.parts import step_loop_s
    from autoshard.cost.step import price_parts
    from autoshard.cost.tables import CostTables
    from autoshard.ir.decisions import Decisions, Mesh

    points = sorted((int(m), t) for m, t in times.items())
    _, graph = capture_graph(request.spec)  # cached since ``profile_request``
    pipelines = max(1, ranks // stages)
    one_pipeline = replace(
        cluster.host,
        pipeline_microbatch_us=0.0,
        pipeline_step_us=0.0,
        shared_cores=cluster.host.shared_cores / pipelines,
    )

    def priced_with(per_microbatch_s: float) -> CostTables:
        """The tables of one pipeline whose schedule time is ``per_microbatch_s`` per stage and micro-batch, 0 per step."""
        profiled = _profile_with(
            cluster, request, pipeline_microbatch_s=per_microbatch_s, pipeline_step_s=0.0, wide_pipeline_stages=None
        )  # every pipeline priced with the trial figure
        return CostTables(graph, replace(profiled, host=one_pipeline))

    tables, priced_tables = priced_with(0.0), priced_with(PROBE_SCHEDULE_S)
    base = Decisions(Mesh(1, 1, stages), 0, min(request.microbatch_sizes), points[0][0], schedule="1f1b")
    cuts = tuple(request.blocks.index(block) for block in pipeline_splits(request, stages))

    def q(m: int, on: CostTables) -> float:
        return price_parts(on, replace(base, num_microbatches=m), cuts).step_time_s - step_loop_s(on)

    n = [(q(m, priced_tables) - q(m, tables)) / PROBE_SCHEDULE_S for m, _ in points]
    r = [t - q(m, tables) for m, t in points]
    x = max(0.0, statistics.linear_regression(n, r).slope)
    return x, max(0.0, statistics.fmean(r) - statistics.fmean(n) * x)


def _step_ops(model_file, model, optimizer, batch, autocast, device):
    """Three ops of one micro-batch of ``batch``'s size b per rank (m = 1), for the step loop (``measure_model``):

        parts: forward + backward, then optimizer.step(), as the profile times them (each alone, back to back)
        whole: the emitted program's step, with its own calls in its order: batches.take (example_batch's draw of
               the step, this rank's share; ``runtime.data.global_batch``, ``take_shard``) → forward + backward →
               optimizer.step() → scheduler.step() → optimizer.zero_grad(set_to_none=True) →
               runtime.mean_over(loss) (an all-reduce over every rank, its value read) → log.end(step, ...)
        alone: the same step with the loss read on its own rank (a program whose loss group is one rank: one
               data-parallel rank, no pipeline)

    t_loop = med_r (t_whole − t_parts) over rounds r, each timing both: what a step costs beyond its parts timed
    alone. That is the work around them (measured alone, 2 CPU ranks, GPT example, dp 2, b 4, 2026-11-27: the draw
    0.68 ms, scheduler and zero_grad 0.13, the loss's all-reduce and read 0.43, the log 0.08), and what the parts
    cost more inside a step than back to back: the backward writes fresh gradients after zero_grad, where the
    profile's calls add to kept ones, and the forward reads weights the optimizer has just written (the same two
    ranks: whole 13.0-16.2 ms against parts 11.5, three rounds). Priced once per step (``cost.parts.step_loop_s``).

    t_sync = med_r (t_whole − t_alone), at most t_loop: the loss's all-reduce, and the wait for the slowest rank it
    makes every step pay. Where ranks share cores that wait is most of the loop (4 ranks on 2 cores, GPT example,
    b 2 and 8, 2026-11-28, ``benchmarks/results/cpu-ranks-2026-11-28d/loop_sync.py``: t_loop 1.1-5.1 ms, "alone"
    minus "parts" −1.0-2.0 ms); a step whose ranks share no collective runs without it (``cost.parts.step_loop_s``)."""
    import torch.distributed as dist

    from autoshard.runtime.data import global_batch, take_shard
    from autoshard.runtime.distributed import mean_over
    from autoshard.runtime.recipe import Recipe, build_scheduler
    from autoshard.runtime.report import StepLog

    ranks, rank = dist.get_world_size(), dist.get_rank()
    microbatch_size = batch[0][0].shape[0]
    scheduler = build_scheduler(optimizer, Recipe())
    # rank 0 makes each step's record as the program's main rank does; its console line never falls due
    log = StepLog(tokens_per_step=1, is_main=rank == 0, log_every=1 << 62, last_step=1 << 62)
    steps = iter(range(1, 1 << 62))

    def loss_of(inputs, targets):
        with autocast:  # as the program runs on GPUs (bf16), a no-op on CPUs
            return model_file.loss(model(*inputs), targets)

    def parts() -> None:
        loss_of(*batch).backward()
        optimizer.step()

    def program_step(read_loss: Callable) -> None:
        step = next(steps)
        log.start()
        inputs, targets = take_shard(global_batch(model_file, microbatch_size * ranks, 0, step), rank, ranks, device)
        loss = loss_of(inputs, targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        log.end(step, read_loss(loss.detach()))

    def whole() -> None:
        program_step(lambda loss: mean_over(loss, None))

    def alone() -> None:
        program_step(lambda loss: loss.item())

    return parts, whole, alone


def _paired_rounds(rounds: list[dict[int, dict[str, list[float]]]]) -> dict[int, dict[str, list[float]]]:
    """Per micro-batch size b, "none"'s figures as their median over the rounds, and each other mode's as that
    plus the median over the rounds of its difference from "none" in the same round (``host_probes.paired_over_rounds``)::

        t_m(b) = med_r t_none,r(b) + med_r (t_m,r(b) − t_none,r(b))

    The cost model reads the modes' differences (a recompute's price is t_full − t_none), and on a shared host
    a slow period of seconds lifts whatever is timed in it: in one round the modes of a size are timed seconds
    apart, so a slow period moves the round's pair together, and the median drops the round it fell on (one
    round measured the GPT example's b 4 forward and backward at 20.6 ms without recompute and 15.1 ms with
    full recompute, 2026-11-27, ``benchmarks/results/cpu-ranks-2026-11-27/cluster8.yaml``). One round: its own
    figures."""
    flat = [
        {(b, mode, k): pair[k] for b, modes in r.items() for mode, pair in modes.items() for k in range(2)}
        for r in rounds
    ]
    paired = paired_over_rounds(flat, lambda key: (key[0], "none", key[2]))
    return {b: {mode: [paired[(b, mode, k)] for k in range(2)] for mode in modes} for b, modes in rounds[0].items()}


REMEASURES = 2  # a forward timed slower than its forward and backward is timed again, at most this often


def _forward_and_step(time_op, forward, step) -> list[float]:
    """[forward_s, forward_backward_s] of one model and micro-batch. On a loaded machine a burst can land on the
    forward's calls alone and time it above the whole step, which no run does: the pair is timed again then.
    ``time_op`` gives every rank the same figure (the slowest rank's), so every rank re-times alike."""
    for _ in range(1 + REMEASURES):
        pair = [time_op(forward), time_op(step)]
        if pair[0] < pair[1]:
            break
    return pair


def model_profile(request: ProfileRequest, measured: Mapping, ranks: int, source: str) -> ModelProfile:
    """The worker's ``measure_model`` result as a profile, figures to 4 significant digits."""
    rounded = {
        int(b): {m: tuple(_sig(x) for x in v) for m, v in modes.items()} for b, modes in measured["times"].items()
    }
    return ModelProfile(
        request.spec,
        request.signature,
        ranks,
        rounded,
        source,
        _sig(measured["optimizer_s"]),
        _sig(measured.get("step_loop_s", 0.0)),
        step_sync_s=_sig(measured.get("step_sync_s", 0.0)),
    )


def with_pipeline(profile: ModelProfile, request: ProfileRequest, measured: Mapping, cluster) -> ModelProfile:
    """``profile`` with the pipeline figures ``pipeline_residual`` fits to the measured steps, if there are any."""
    if not measured.get("pipeline"):
        return profile
    per_microbatch_s, per_step_s = pipeline_residual(request, measured["pipeline"], cluster, profile.ranks)
    profile = replace(profile, pipeline_microbatch_s=_sig(per_microbatch_s), pipeline_step_s=_sig(per_step_s))
    wide = wide_stages(request, profile.ranks)
    if wide is None or not measured.get("wide_pipeline"):
        return profile
    per_microbatch_s, per_step_s = pipeline_residual(request, measured["wide_pipeline"], cluster, profile.ranks, wide)
    return replace(
        profile,
        wide_pipeline_stages=wide,
        wide_pipeline_microbatch_s=_sig(per_microbatch_s),
        wide_pipeline_step_s=_sig(per_step_s),
    )


def tp_residual(request: ProfileRequest, times: Mapping, cluster) -> tuple[float, float, float | None]:
    """Parent side: DTensor's host time per module on this model, (of a style that shards a weight, of one that shards
    none), from its measured tensor-parallel micro-batches (``_tp_times``): what each holds beyond everything else the
    cost model prices in it, over its modules of each kind::

        Q_L(τ, σ): the price of one micro-batch's forward + backward under layout L at tp 2 (compute, the layout's
                   collectives, τ per module that shards a weight and σ per other module: ``cost.tp_units``)
        n_L = [Q_L(δ, 0) − Q_L(0, 0)] / δ,   s_L = [Q_L(0, δ) − Q_L(0, 0)] / δ      (the modules of each kind)
        τ = [t_tp − Q_tp(0, 0)] / n_tp                                             (Megatron's layout: no σ module)
        σ = [t_sp − Q_sp(0, 0) − τ·n_sp] / s_sp                                    each clamped at 0

    Without a sequence-parallel layout σ is the host probes'. Third: ``rerun_share`` at (τ, σ). The host probes fit
    the same two terms on a probe model of their own, as a small difference of large times: ``sequence_module_us`` read 1,298-2,861 µs over
    three 4-rank calibrations on one 2-core VM (2026-11-28), and the runs' sequence-parallel plans 5-10 times
    their layouts without it."""
    from autoshard.cost.tables import CostTables

    _, graph = capture_graph(request.spec)  # cached since ``profile_request``
    layouts = probe_layouts(graph)
    b = min(request.microbatch_sizes)

    def priced_with(tp_module_s: float, sequence_module_s: float) -> CostTables:
        profiled = _profile_with(cluster, request, tp_module_s=tp_module_s, sequence_module_s=sequence_module_s)
        return _with_layouts(CostTables(graph, profiled), layouts, b)

    def q(name: str, tables: CostTables) -> float:
        return tp_microbatch_s(tables, tp_probe_decisions(name, b))

    base, per_tp, per_seq = priced_with(0.0, 0.0), priced_with(PROBE_MODULE_S, 0.0), priced_with(0.0, PROBE_MODULE_S)

    def count(name: str, on: CostTables) -> float:
        return (q(name, on) - q(name, base)) / PROBE_MODULE_S

    tau = max(0.0, (times["tp"] - q("tp", base)) / count("tp", per_tp))
    sigma = cluster.host.sequence_module_us * 1e-6
    if "sp" in times and count("sp", per_seq):
        sigma = max(0.0, (times["sp"] - q("sp", base) - tau * count("sp", per_tp)) / count("sp", per_seq))
    return tau, sigma, rerun_share(request, times, cluster, layouts, tau, sigma)


def rerun_share(request: ProfileRequest, times: Mapping, cluster, layouts: Mapping, tau: float, sigma: float):
    """Parent side: the share s_f of a module's DTensor host time that a recomputed forward runs again (``cost.tp_units
    .forward_share``), from the last layout's micro-batch with full recompute (``_tp_times``), DTensor's time per
    module at (τ, σ) (``tp_residual``); None where it was not timed::

        s_f = [t_full − Q_full(s_f = 0)] / [Q_full(1) − Q_full(0)]          clamped to [0, 1]

    Q_full: the price of that micro-batch (compute with the profile's rerun, the layout's collectives rerun, host).
    The host probes' figure moved 0.24 → 0.70 between two 4-rank calibrations on one 2-core VM (2026-11-28)."""
    from autoshard.cost.tables import CostTables

    name = next((n for n in reversed(TP_LAYOUTS) if n in layouts), None)
    if name is None or name + RECOMPUTED not in times:
        return None
    _, graph = capture_graph(request.spec)
    b = min(request.microbatch_sizes)
    config = replace(tp_probe_decisions(name, b), recompute="full")

    def q(share: float) -> float:
        profiled = _profile_with(cluster, request, tp_module_s=tau, sequence_module_s=sigma, tp_forward_share=share)
        return tp_microbatch_s(_with_layouts(CostTables(graph, profiled), layouts, b), config)

    none, whole = q(0.0), q(1.0)
    if whole <= none:
        return None
    return min(1.0, max(0.0, (times[name + RECOMPUTED] - none) / (whole - none)))


PROBE_MODULE_S = 1e-3  # δ of ``tp_residual``


def _profile_with(cluster, request: ProfileRequest, **figures):
    """``cluster`` with the profile of ``request``'s model given ``figures`` (the fits price with trial figures)."""
    profiles = tuple(replace(p, **figures) if p.signature == request.signature else p for p in cluster.profiles)
    return replace(cluster, profiles=profiles)


def _with_layouts(tables, layouts: Mapping, microbatch_size: int):
    """``tables`` with each of ``probe_layouts``' layouts handed in for micro-batch b."""
    for name, choice in layouts.items():
        tables.add_tp_layout(choice, microbatch_size, name == "sp")
    return tables


def tp_probe_decisions(name: str, microbatch_size: int):
    """What ``_tp_times`` runs under layout ``name``, as decisions: tp 2, one micro-batch of b."""
    from autoshard.ir.decisions import Decisions, Mesh

    return Decisions(Mesh(1, TP_PROBE_DEGREE, 1), 0, microbatch_size, 1, sequence_parallel=name == "sp")


def tp_microbatch_s(tables, config) -> float:
    """The cost model's price of one micro-batch's forward + backward (and recompute) under ``config``'s tensor parallelism: compute,
    the layout's collectives, the op dispatch and DTensor's host time (the per-micro-batch part of
    ``cost.step.spmd_parts``)."""
    from autoshard.cost.tp_units import spmd_microbatch, tp_host_per_unit_s

    micro, comm_s, _ = spmd_microbatch(tables, config)
    host_s = sum(tables.config_units(config).host_s) + sum(tp_host_per_unit_s(tables, config))
    return micro.forward_s + micro.backward_s + micro.recompute_s + comm_s + host_s


def with_tp(profile: ModelProfile, request: ProfileRequest, measured: Mapping, cluster) -> ModelProfile:
    """``profile`` with DTensor's host time per module that ``tp_residual`` fits to the measured steps, if any."""
    if not measured.get("tp") or "tp" not in measured["tp"]:
        return profile
    tp_module_s, sequence_module_s, share = tp_residual(request, measured["tp"], cluster)
    return replace(
        profile,
        tp_module_s=_sig(tp_module_s),
        sequence_module_s=_sig(sequence_module_s),
        tp_forward_share=None if share is None else _sig(share),
    )


def _sig(x: float) -> float:
    return float(f"{x:.4g}")
