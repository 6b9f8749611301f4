"""The Python API: plan a model, and parallelize it inside a torchrun-launched script."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from autoshard.cost.hardware import load_cluster
from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan, load_plan
from autoshard.ir.recipe import Recipe
from autoshard.ir.steps import Layout
from autoshard.ir.topology import Cluster
from autoshard.passes.lowering.lower import layout as lower_layout
from autoshard.passes.lowering.lower import lower
from autoshard.passes.planning.strategies import Pins
from autoshard.pipeline import PlanRequest, estimate_model, plan_model

if TYPE_CHECKING:  # planning never imports torch when the capture cache has the model
    import torch.nn as nn

    from autoshard.modelfile import ModelFile


def plan(
    model: str,
    cluster: str | Cluster = "local-cpu",
    global_batch: int = 8,
    nodes: int | None = None,
    devices_per_node: int | None = None,
    fold: bool = True,
    time_limit_s: float | None = None,
    cache: bool = True,
    runtime: str = "autoshard",
    seq_len: int | None = None,
    **pins,
) -> Plan:
    """Plan ``model`` ("file.py:factory") on ``cluster``; keyword pins fix decisions, one keyword per row of
    ``ir.pins.PINS`` (the flags of ``autoshard plan``: dp, tp, pp, zero, microbatch_size, recompute,
    schedule, virtual_stages, stage_cuts, dp_replicate, ep, cp, sequence_parallel, loss_parallel, precision,
    compile, float8; each also by its ``Decisions`` field name, ``zero_stage`` for ``zero``); ``fold=False``
    exports every repeated layer (``passes.capturing.fold``); ``time_limit_s`` stops the search early (the plan's
    ``search`` gives the gap); ``cache=False`` captures the model even when the capture cache has it
    (``passes.capturing.capture_cache``); ``runtime`` names what the cost model prices ("autoshard", the emitted
    program, or "megatron-lm": ``cost.tables.Runtime.named``); ``seq_len`` is handed to the model file's
    ``example_batch`` (its own sequence length when None)."""
    if not isinstance(cluster, Cluster):
        cluster = load_cluster(cluster, nodes=nodes, devices_per_node=devices_per_node)
    return plan_model(
        PlanRequest(
            model_spec=model,
            cluster=cluster,
            global_batch=global_batch,
            pins=Pins(**pins),
            fold=fold,
            time_limit_s=time_limit_s,
            cache=cache,
            runtime=runtime,
            seq_len=seq_len,
        )
    )


def estimate(
    model: str,
    cluster: str | Cluster = "local-cpu",
    global_batch: int = 8,
    nodes: int | None = None,
    devices_per_node: int | None = None,
    fold: bool = True,
    cache: bool = True,
    runtime: str = "autoshard",
    seq_len: int | None = None,
    **pins,
) -> Plan:
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
    return estimate_model(
        PlanRequest(
            model_spec=model,
            cluster=cluster,
            global_batch=global_batch,
            pins=Pins(**pins),
            fold=fold,
            cache=cache,
            runtime=runtime,
            seq_len=seq_len,
        )
    )


def layout(plan: Plan | str | Path) -> Layout:
    """The plan's mesh and batch shares (``passes.lowering.lower.layout``): what a training loop reads to take its
    samples (``data_axis``), its tokens (``sequence_axis``, None without context parallelism) and to average
    its loss (``loss_axis``)."""
    return lower_layout(plan if isinstance(plan, Plan) else load_plan(plan))


def parallelize(
    model: nn.Module,
    plan: Plan | str | Path,
    lr: float | None = None,
    init_from: str | Path | None = None,
    recipe: Recipe | None = None,
    loss_fn: Callable | None = None,
    example_inputs: tuple | None = None,
):
    """Inside a torchrun-launched script: apply ``plan`` to ``model`` (built the same on every rank, the model the
    plan was made for) and return a ``runtime.parallelized.Parallelized`` ``p`` that trains it as the emitted
    program does, for every plan (pipelines and context parallelism included)::

        loss = p.train_step(inputs, targets)   # one global batch: dp slice, micro-batches, cp tokens, schedule
        p.clip_grad_norm(1.0)                  # optional: the whole model's norm over every mesh axis
        optimizer.step(); optimizer.zero_grad()

    The mesh and the steps are the emitted program's (``passes.lowering.lower``: ``layout`` and ``lower``, applied by
    ``runtime.build_mesh`` and ``runtime.apply_steps``); ``p.model`` is the wrapped model, or this rank's pipeline
    stages, ``p.mesh`` the mesh, ``p.parameters()`` this rank's parameters for an optimizer of one's own.

    ``recipe`` (``autoshard.Recipe``, or ``Recipe.from_file(path)``): ``p.optimizer``, the optimizer, its settings
    and weight-decay groups, as an emitted program's ``RECIPE`` (None: ``Recipe()``, AdamW at 1e-3, no decay on
    norms, biases and embeddings); ``lr`` replaces its lr; ``p.lr_scheduler(steps)`` its schedule.

    ``loss_fn(outputs, targets)``: None, the plan's model file's (its ``loss_fn``, or the default loss).
    ``example_inputs``: for a pipeline plan, inputs of one micro-batch (or more rows: the first
    ``plan.microbatch_size`` are kept) that the split traces; None, drawn from the model file's ``example_batch``.

    ``init_from``: pretrained weights loaded once the plan is applied, each rank reading only its shards, as the
    program's ``--init-from`` (``runtime.checkpoint.load_weights``: a Hugging Face folder of ``*.safetensors`` or
    a DCP checkpoint)."""
    import os

    import torch.nn as nn

    from autoshard import runtime  # torch
    from autoshard.runtime.parallelized import Parallelized

    if not isinstance(plan, Plan):
        plan = load_plan(plan)
    if not isinstance(model, nn.Module):
        raise AutoshardError(
            f"autoshard.parallelize takes a torch.nn.Module, not a {type(model).__name__}; fix: "
            f"build the model first (the plan's {plan.model['spec']})"
        )
    check_model_for_plan(model, plan)
    if plan.precision == "fp16-autocast":
        raise AutoshardError(
            f"plan precision {plan.precision} scales the loss (a GradScaler), which "
            f"Parallelized.train_step does not; fix: train it with its emitted program "
            f"(autoshard compile), or plan with --precision bf16"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.world_size:
        raise AutoshardError(
            f"this plan is for {plan.world_size} ranks, and this process is one of {world}; fix: "
            f"launch the script with torchrun --nproc-per-node {plan.world_size} (or re-plan for "
            f"{world})"
        )
    spec = lower_layout(plan)
    ctx = runtime.init_distributed(expected_world_size=spec.world_size, host_collectives=plan.decisions.offloaded)
    mesh = runtime.build_mesh(ctx.device_type, dict(spec.mesh), dict(spec.flatten))  # as the emitted program
    model_file = _model_file_once(plan, spec.seq_len)
    if loss_fn is not None and plan.decisions.loss_parallel:
        raise AutoshardError(
            "this plan computes the model file's cross-entropy on the logits' vocabulary shards (loss "
            "parallelism), which another loss_fn was not shown to compute the same; fix: drop loss_fn, or "
            "re-plan with --loss-parallel off"
        )
    loss_fn = loss_fn or model_file().loss
    loss_fn = runtime.compiled_loss(loss_fn) if plan.decisions.compile_loss else loss_fn  # as the emitted program
    recipe = recipe or Recipe()
    recipe = recipe if lr is None else replace(recipe, lr=lr)
    run_inputs = dict(device=ctx.device, recipe=recipe)
    if plan.mesh.pp > 1:  # the split traces one micro-batch; the schedule computes the loss
        if example_inputs is None:
            example_inputs = runtime.global_batch(model_file(), plan.microbatch_size, seed=0, step=0)[0]
        example_inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        run_inputs |= dict(
            loss_fn=loss_fn, example_microbatch=tuple(t[: plan.microbatch_size].to(ctx.device) for t in example_inputs)
        )
    applied = runtime.apply_steps(model.to(ctx.device), lower(plan), mesh, **run_inputs)  # as the emitted program
    if init_from is not None:
        from autoshard.runtime.checkpoint import load_weights

        load_weights(
            init_from, applied["model"], applied["optimizer"], mesh if plan.mesh.pp > 1 else None
        )  # as the program
    return Parallelized(
        plan,
        spec,
        mesh,
        ctx.device,
        applied["model"],
        applied["optimizer"],
        recipe,
        loss_fn,
        applied.get("schedule"),
        model_file,
    )


def check_model_for_plan(model: nn.Module, plan: Plan) -> None:
    """Refuse, in one line, a model that is not the one ``plan`` was made for: its structure's fingerprint
    (``modelfile.model_fingerprint``: module types, parameter and buffer names, shapes, dtypes) differs."""
    from autoshard.modelfile import model_fingerprint

    want = plan.model.get("hash")
    if want is None or model_fingerprint(model) == want:
        return
    spec, planned = plan.model["spec"], plan.model.get("params")
    params = sum(p.numel() for p in model.parameters())
    how = (
        f"it has {params:,} parameters, the plan's {planned:,}"
        if planned is not None and params != planned
        else "its module types, parameter names, shapes or dtypes differ"
    )
    raise AutoshardError(
        f"this model is not the one the plan was made for ({spec}): {how}; fix: build the model "
        f"as {spec} does, or plan this one"
    )


def _model_file_once(plan: Plan, seq_len: int | None) -> Callable[[], ModelFile]:
    """The plan's model file, loaded the first time it is asked for (default loss, example inputs, data)."""
    loaded: list[ModelFile] = []

    def model_file() -> ModelFile:
        if not loaded:
            from autoshard.runtime import load_model_file

            loaded.append(load_model_file(plan.model["spec"], seq_len=seq_len))
        return loaded[0]

    return model_file
