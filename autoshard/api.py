"""The Python API: plan a model, and parallelize it inside a torchrun-launched script."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from autoshard.cost.hardware import load_cluster
from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan, load_plan
from autoshard.ir.recipe import Recipe
from autoshard.ir.steps import Layout
from autoshard.ir.topology import Cluster
from autoshard.passes.lower import layout as lower_layout
from autoshard.passes.lower import lower
from autoshard.passes.strategies import Pins
from autoshard.pipeline import PlanRequest, estimate_model, plan_model

if TYPE_CHECKING:  # planning never imports torch when the capture cache has the model
    import torch.nn as nn


def plan(model: str, cluster: str | Cluster = "local-cpu", global_batch: int = 8, nodes: int | None = None,
         devices_per_node: int | None = None, fold: bool = True, time_limit_s: float | None = None, cache: bool = True,
         runtime: str = "autoshard", seq_len: int | None = None, **pins) -> Plan:
    """Plan ``model`` ("file.py:factory") on ``cluster``; keyword pins fix decisions, one keyword per row of
    ``ir.decisions.PINS`` (the flags of ``autoshard plan``: dp, tp, pp, zero, microbatch_size, recompute,
    schedule, virtual_stages, stage_cuts, dp_replicate, ep, cp, sequence_parallel; each also by its
    ``Decisions`` field name, ``zero_stage`` for ``zero``); ``fold=False``
    exports every repeated layer (``passes.fold``); ``time_limit_s`` stops the search early (the plan's
    ``search`` gives the gap); ``cache=False`` captures the model even when the capture cache has it
    (``passes.capture_cache``); ``runtime`` names what the cost model prices ("autoshard", the emitted
    program, or "megatron-lm": ``cost.tables.Runtime.named``); ``seq_len`` is handed to the model file's
    ``example_batch`` (its own sequence length when None)."""
    if not isinstance(cluster, Cluster):
        cluster = load_cluster(cluster, nodes=nodes, devices_per_node=devices_per_node)
    return plan_model(PlanRequest(model_spec=model, cluster=cluster, global_batch=global_batch, pins=Pins(**pins),
                                  fold=fold, time_limit_s=time_limit_s, cache=cache, runtime=runtime, seq_len=seq_len))


def estimate(model: str, cluster: str | Cluster = "local-cpu", global_batch: int = 8, nodes: int | None = None,
             devices_per_node: int | None = None, fold: bool = True, cache: bool = True, runtime: str = "autoshard",
             seq_len: int | None = None, **pins) -> Plan:
    """The plan of a configuration fixed by hand: every decision pinned (dp, tp, pp, zero,
    microbatch_size, recompute, schedule: keywords as for ``plan``), or left to its default
    (``Pins.with_defaults``: virtual stages follow the schedule, the planner's stage cuts). It is
    priced like ``plan`` prices it (a fitting one is the same plan) and returned even when it does not
    fit (its ``notes`` say by how much); ``runtime`` as for ``plan``."""
    missing = Pins(**pins).missing_for_estimate()
    if missing:
        raise AutoshardError(f"estimate needs every decision pinned; missing: {', '.join(missing)}")
    if not isinstance(cluster, Cluster):
        cluster = load_cluster(cluster, nodes=nodes, devices_per_node=devices_per_node)
    return estimate_model(PlanRequest(model_spec=model, cluster=cluster, global_batch=global_batch,
                                      pins=Pins(**pins), fold=fold, cache=cache, runtime=runtime, seq_len=seq_len))


def layout(plan: Plan | str | Path) -> Layout:
    """The plan's mesh and batch shares (``passes.lower.layout``): what a training loop reads to take its
    samples (``data_axis``), its tokens (``sequence_axis``, None without context parallelism) and to average
    its loss (``loss_axis``)."""
    return lower_layout(plan if isinstance(plan, Plan) else load_plan(plan))


def parallelize(model: nn.Module, plan: Plan | str | Path, lr: float | None = None, init_from: str | Path | None = None,
                recipe: Recipe | None = None):
    """Inside a torchrun-launched script: apply ``plan`` to ``model`` (built the same on every rank) and
    return ``(model, optimizer, mesh)``: the mesh and the steps are the emitted program's
    (``passes.lower``: ``layout`` and ``lower``, applied by ``runtime.build_mesh`` and ``runtime.apply_steps``).

    The data stays in the caller's loop, as the emitted program's SPMD loop takes it, with
    ``spec = autoshard.layout(plan)``: each global batch's samples ``runtime.take_samples(batch, mesh,
    spec.data_axis, device)``, in ``plan.num_microbatches`` micro-batches; each micro-batch's tokens
    ``runtime.take_sequence_shard(x, y, mesh, spec.sequence_axis, spec.tokens_per_sample)``, its forward and
    backward under ``runtime.context_parallel(mesh, spec.sequence_axis, spec.tokens_per_sample)`` (both do
    nothing without context parallelism) and ``runtime.grad_sync``; the loss averaged over
    ``mesh.get_group(spec.loss_axis)``.

    ``recipe`` (``autoshard.Recipe``, or ``Recipe.from_file(path)``): the optimizer, its settings and weight-decay
    groups, as an emitted program's ``RECIPE`` (None: ``Recipe()``, AdamW at 1e-3, no decay on norms, biases and
    embeddings); ``lr`` replaces its lr. Its schedule and clipping belong to the caller's loop, as the program's:
    ``scheduler = runtime.recipe.build_scheduler(optimizer, recipe.for_run(steps))``, and after the backward
    ``runtime.recipe.clip_grad_norm(model, recipe.max_grad_norm)`` when it clips, then ``optimizer.step()``,
    ``scheduler.step()``.

    ``init_from``: pretrained weights loaded once the plan is applied, each rank reading only its shards, as the
    program's ``--init-from`` (``runtime.checkpoint.load_weights``: a Hugging Face folder of ``*.safetensors`` or
    a DCP checkpoint).

    Pipeline plans are refused: their steps replace the model by this rank's stages and need an example
    micro-batch and the loss function to trace them, and their loop is a schedule's, which this call's
    ``(model, optimizer, mesh)`` cannot carry."""
    from autoshard import runtime  # torch

    if not isinstance(plan, Plan):
        plan = load_plan(plan)
    if plan.mesh.pp > 1:
        raise AutoshardError("autoshard.parallelize takes plans without pipeline parallelism (a pipeline replaces "
                             "the model by stages and the loop by a schedule); run `autoshard compile` for this plan")
    spec = lower_layout(plan)
    ctx = runtime.init_distributed(expected_world_size=spec.world_size)
    mesh = runtime.build_mesh(ctx.device_type, dict(spec.mesh), dict(spec.flatten))  # as the emitted program
    model = model.to(ctx.device)
    recipe = recipe or Recipe()
    recipe = recipe if lr is None else replace(recipe, lr=lr)
    applied = runtime.apply_steps(model, lower(plan), mesh, device=ctx.device, recipe=recipe)  # as the emitted program
    if init_from is not None:
        from autoshard.runtime.checkpoint import load_weights

        load_weights(init_from, applied["model"], applied["optimizer"])
    return applied["model"], applied["optimizer"], mesh
