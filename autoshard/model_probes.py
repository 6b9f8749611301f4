"""Model profiles for ``autoshard calibrate --model SPEC``: capture the model, then measure it.

The parent captures each model as ``plan`` does (on meta) for its graph signature and block paths
(``profile_request``), before the minutes of measuring; every worker then builds the real model
with the runtime's recompute wrappers and times, for each micro-batch size b and recompute mode,
one micro-batch's forward and forward + backward (in interleaved rounds, ``_paired_rounds``), one AdamW
step, what the emitted program's step costs beyond these (``_step_ops``), and with the ranks in pairs the model's
own two-stage 1F1B pipeline (``_pipeline_times``) (``measure_model``). The slowest rank's medians become an
``ir.profile.ModelProfile`` (``model_profile``), which the cost model scales its units to (``cost.profile``); the
parent fits the pipeline's schedule time per micro-batch with the cost model itself (``pipeline_residual``,
``with_pipeline``).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from collections.abc import Mapping
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


def profile_request(spec: str, microbatch_sizes: tuple[int, ...]) -> ProfileRequest:
    """Capture the model (on meta, as ``plan`` does) for its signature and blocks."""
    _, graph = capture_graph(spec)
    return ProfileRequest(spec, graph_signature(graph), tuple(b.path for b in graph.blocks), microbatch_sizes)


PROFILE_ROUNDS = 3  # every size and mode timed in this many rounds, interleaved (``_paired_rounds``)


def measure_model(time_op, request: ProfileRequest, device, rounds: int = PROFILE_ROUNDS) -> dict[str, Any]:
    """Worker side: {"times": b -> mode -> [forward_s, forward_backward_s], "optimizer_s", "step_loop_s"} of the
    real model with the runtime's own recompute wrappers (``runtime.parallel.apply_recompute``), AdamW and step
    (``_step_ops``), on every rank at once. Every size and mode is timed once per round, ``rounds`` rounds one after
    the other, and the figures are their paired medians (``_paired_rounds``)."""
    import torch  # the worker's: the planning side of calibrate stays torch-free

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
    parts, whole = _step_ops(model_file, models["none"], optimizer, batches[b], autocast, device)
    loop_rounds = [{"parts": time_op(parts), "whole": time_op(whole)} for _ in range(rounds)]
    step_loop_s = max(0.0, statistics.median(r["whole"] - r["parts"] for r in loop_rounds))
    measured = {"times": out, "optimizer_s": optimizer_s, "step_loop_s": step_loop_s}
    if _pipeline_measurable(request):
        measured["pipeline"] = _pipeline_times(time_op, model_file, request, device, rounds)
    return measured


# the model's 1F1B is timed at each; a line through all three (``pipeline_residual``)
MODEL_PIPELINE_MICROBATCHES = (2, 4, 8)
PROBE_SCHEDULE_S = 1e-3  # δ of ``pipeline_residual``: a schedule time per micro-batch to price the pipeline with


def _pipeline_measurable(request: ProfileRequest) -> bool:
    """A two-stage pipeline of the model needs two blocks and the ranks in pairs."""
    import torch.distributed as dist

    return len(request.blocks) >= 2 and dist.get_world_size() % 2 == 0


def pipeline_split(request: ProfileRequest) -> str:
    """Where ``_pipeline_times`` cuts the model: before its middle block."""
    return request.blocks[len(request.blocks) // 2]


def _pipeline_times(time_op, model_file, request: ProfileRequest, device, rounds: int) -> dict[int, float] | None:
    """Worker side: the model's 1F1B step over two stages (ranks paired: a (pp 2, dp N/2) mesh, each dp rank a
    pipeline of its own, no gradient synchronised) at micro-batch b = the smallest size, for m ∈
    MODEL_PIPELINE_MICROBATCHES micro-batches, with the runtime's own pipeline (``runtime.pipeline_parallel``: the traced
    stages and torch's schedule, as an emitted program builds them), the model cut before its middle block
    (``pipeline_split``). Timed in ``rounds`` rounds, each m's figure the smallest m's median plus the median of
    their difference (``host_probes.paired_over_rounds``). The parent takes from these what the cost model's pipeline formula
    leaves out for this model (``pipeline_residual``)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.runtime import pipeline_parallel as pp
    from autoshard.runtime.model import build_model

    b, most = min(request.microbatch_sizes), max(MODEL_PIPELINE_MICROBATCHES)
    mesh = init_device_mesh(device.type, (2, dist.get_world_size() // 2), mesh_dim_names=("pp", "dp"))
    inputs, targets = model_file.example_batch(b * most)
    if not isinstance(targets, torch.Tensor):  # the schedule splits the targets along their first dim
        return None
    inputs, targets = tuple(t.to(device) for t in inputs), targets.to(device)
    steps = {}
    try:  # tracing: the same on every rank, before any collective (a model the split cannot trace is not timed)
        for m in MODEL_PIPELINE_MICROBATCHES:  # stages of their own per m: their buffers are sized by a first schedule
            parts = pp.build_pipeline_stages(
                build_model(model_file, seed=0, device=device),
                tuple(t[:b] for t in inputs),
                [pipeline_split(request)],
                mesh.get_local_rank("pp"),
                2,
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
    return paired_over_rounds(timed, lambda _m: min(MODEL_PIPELINE_MICROBATCHES))


def _pipeline_step(pp, schedule, parts, batch, optimizer) -> None:
    """A pipeline program's step without its step loop: the schedule, the optimizer's step, the gradients freed (as
    an emitted pipeline program calls them)."""
    pp.pipeline_step(schedule, parts, *batch)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def pipeline_residual(request: ProfileRequest, times: Mapping, cluster, ranks: int) -> tuple[float, float]:
    """Parent side: the pipeline schedule's own time that the model's measured 1F1B steps (``_pipeline_times``) hold
    beyond everything else the cost model prices in them, (per stage and micro-batch, per step): the least-squares line
    through the residuals r(m) = t(m) − Q(m) of the timed micro-batch counts against n(m), what schedule time per
    micro-batch and stage adds to the price per second of it (with shared cores the bubble's slot is partly free: an idle
    rank lends its core)::

        n(m) = [Q(m; x = δ) − Q(m)] / δ             δ = 1 ms; m + 1 on cores of their own (m slots, one of the bubble)
        x = Σ (n − n̄)(r − r̄) / Σ (n − n̄)²
        y = r̄ − n̄·x                                each clamped at 0 (y refitted as r̄ − n̄·x after x's clamp)

    Q(m): the cost model's price of one of the ``ranks`` / 2 pipelines that ran (two stages cut at ``pipeline_split``,
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
    pipelines = max(1, ranks // 2)
    one_pipeline = replace(
        cluster.host,
        pipeline_microbatch_us=0.0,
        pipeline_step_us=0.0,
        shared_cores=cluster.host.shared_cores / pipelines,
    )

    def priced_with(per_microbatch_s: float) -> CostTables:
        """The tables of one pipeline whose schedule time is ``per_microbatch_s`` per stage and micro-batch, 0 per step."""
        profiles = tuple(
            replace(p, pipeline_microbatch_s=per_microbatch_s, pipeline_step_s=0.0)
            if p.signature == request.signature
            else p
            for p in cluster.profiles
        )
        return CostTables(graph, replace(cluster, host=one_pipeline, profiles=profiles))

    tables, priced_tables = priced_with(0.0), priced_with(PROBE_SCHEDULE_S)
    base = Decisions(Mesh(1, 1, 2), 0, min(request.microbatch_sizes), points[0][0], schedule="1f1b")
    cuts = (request.blocks.index(pipeline_split(request)),)

    def q(m: int, on: CostTables) -> float:
        return price_parts(on, replace(base, num_microbatches=m), cuts).step_time_s - step_loop_s(on)

    n = [(q(m, priced_tables) - q(m, tables)) / PROBE_SCHEDULE_S for m, _ in points]
    r = [t - q(m, tables) for m, t in points]
    x = max(0.0, statistics.linear_regression(n, r).slope)
    return x, max(0.0, statistics.fmean(r) - statistics.fmean(n) * x)


def _step_ops(model_file, model, optimizer, batch, autocast, device):
    """Two ops of one micro-batch of ``batch``'s size b per rank (m = 1), for the step loop (``measure_model``):

        parts: forward + backward, then optimizer.step(), as the profile times them (each alone, back to back)
        whole: the emitted program's step, with its own calls in its order: batches.take (example_batch's draw of
               the step, this rank's share; ``runtime.data.global_batch``, ``take_shard``) → forward + backward →
               optimizer.step() → scheduler.step() → optimizer.zero_grad(set_to_none=True) →
               runtime.mean_over(loss) (an all-reduce over every rank, its value read) → log.end(step, ...)

    t_loop = med_r (t_whole − t_parts) over rounds r, each timing both: what a step costs beyond its parts timed
    alone. That is the work around them (measured alone, 2 CPU ranks, GPT example, dp 2, b 4, 2026-11-27: the draw
    0.68 ms, scheduler and zero_grad 0.13, the loss's all-reduce and read 0.43, the log 0.08), and what the parts
    cost more inside a step than back to back: the backward writes fresh gradients after zero_grad, where the
    profile's calls add to kept ones, and the forward reads weights the optimizer has just written (the same two
    ranks: whole 13.0-16.2 ms against parts 11.5, three rounds). Priced once per step (``cost.parts.step_loop_s``)."""
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

    def whole() -> None:
        step = next(steps)
        log.start()
        inputs, targets = take_shard(global_batch(model_file, microbatch_size * ranks, 0, step), rank, ranks, device)
        loss = loss_of(inputs, targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        log.end(step, mean_over(loss.detach(), None))

    return parts, whole


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
    )


def with_pipeline(profile: ModelProfile, request: ProfileRequest, measured: Mapping, cluster) -> ModelProfile:
    """``profile`` with the pipeline figures ``pipeline_residual`` fits to the measured steps, if there are any."""
    if not measured.get("pipeline"):
        return profile
    per_microbatch_s, per_step_s = pipeline_residual(request, measured["pipeline"], cluster, profile.ranks)
    return replace(profile, pipeline_microbatch_s=_sig(per_microbatch_s), pipeline_step_s=_sig(per_step_s))


def _sig(x: float) -> float:
    return float(f"{x:.4g}")
