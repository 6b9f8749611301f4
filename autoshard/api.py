"""The Python API: plan a model, and parallelize it inside a torchrun-launched script."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from autoshard.cost.hardware import load_cluster
from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan, load_plan
from autoshard.ir.topology import Cluster
from autoshard.passes.lower import lower
from autoshard.passes.strategies import Pins
from autoshard.pipeline import PlanRequest, estimate_model, plan_model

if TYPE_CHECKING:  # planning never imports torch when the capture cache has the model
    import torch.nn as nn


def plan(model: str, cluster: str | Cluster = "local-cpu", global_batch: int = 8, nodes: int | None = None,
         devices_per_node: int | None = None, fold: bool = True, time_limit_s: float | None = None, cache: bool = True,
         runtime: str = "autoshard", seq_len: int | None = None, **pins) -> Plan:
    """Plan ``model`` ("file.py:factory") on ``cluster``; keyword pins fix decisions
    (dp, tp, pp, zero, microbatch_size, recompute, schedule, virtual_stages, stage_cuts); ``fold=False``
    exports every repeated layer (``passes.fold``); ``time_limit_s`` stops the search early (the plan's
    ``search`` gives the gap); ``cache=False`` captures the model even when the capture cache has it
    (``passes.capture_cache``); ``runtime`` names what the cost model prices ("autoshard", the emitted
    program, or "megatron-lm": ``cost.tables.Runtime.named``); ``seq_len`` is handed to the model file's
    ``example_batch`` (its own sequence length when None)."""
    if not isinstance(cluster, Cluster):
        cluster = load_cluster(cluster, nodes=nodes, devices_per_node=devices_per_node)
    return plan_model(PlanRequest(model, cluster, global_batch, Pins(**pins), fold, time_limit_s, cache, runtime,
                                  seq_len))


def estimate(model: str, cluster: str | Cluster = "local-cpu", global_batch: int = 8, nodes: int | None = None,
             devices_per_node: int | None = None, fold: bool = True, cache: bool = True, runtime: str = "autoshard",
             seq_len: int | None = None, **pins) -> Plan:
    """The plan of a configuration fixed by hand: every decision pinned (dp, tp, pp, zero,
    microbatch_size, recompute, schedule), or left to its default (``Pins.with_defaults``: virtual
    stages follow the schedule, the planner's stage cuts). It is priced like ``plan`` prices it (a
    fitting one is the same plan) and returned even when it does not fit (its ``notes`` say by how
    much); ``runtime`` as for ``plan``."""
    missing = Pins(**pins).missing_for_estimate()
    if missing:
        raise AutoshardError(f"estimate needs every decision pinned; missing: {', '.join(missing)}")
    if not isinstance(cluster, Cluster):
        cluster = load_cluster(cluster, nodes=nodes, devices_per_node=devices_per_node)
    return estimate_model(PlanRequest(model, cluster, global_batch, Pins(**pins), fold, cache=cache, runtime=runtime,
                                      seq_len=seq_len))


def parallelize(model: nn.Module, plan: Plan | str | Path, lr: float = 1e-3):
    """Inside a torchrun-launched script: apply ``plan`` to ``model`` (built the same on every
    rank) and return ``(model, optimizer, mesh)``. Micro-batching and data sharding stay in the
    caller's loop: take the ``mesh.get_local_rank("dp")``-th of ``plan.mesh.dp`` slices of each
    global batch, in ``plan.num_microbatches`` micro-batches."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard import runtime  # torch

    if not isinstance(plan, Plan):
        plan = load_plan(plan)
    if plan.mesh.pp > 1:
        raise AutoshardError("autoshard.parallelize takes plans without pipeline parallelism (a pipeline replaces "
                             "the model by stages and the loop by a schedule); run `autoshard compile` for this plan")
    if plan.mesh.cp > 1:
        raise AutoshardError("autoshard.parallelize takes plans without context parallelism (each rank's loop must cut "
                             "its tokens and run under runtime.context_parallel); run `autoshard compile` for this plan")
    ctx = runtime.init_distributed(expected_world_size=plan.world_size)
    mesh = init_device_mesh(ctx.device_type, (plan.mesh.pp, plan.mesh.dp, plan.mesh.tp),
                            mesh_dim_names=("pp", "dp", "tp"))
    model = model.to(ctx.device)
    applied = runtime.apply_steps(model, lower(plan), mesh, device=ctx.device, lr=lr)  # as the emitted program
    return applied["model"], applied["optimizer"], mesh
