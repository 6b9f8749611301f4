"""The training recipe at run time: the optimizer, learning-rate schedule, weight decay and gradient clipping a
``Recipe`` (``ir.recipe``, re-exported here: plain data, read from a ``[training]`` table of a TOML or YAML file,
printed by a program as its ``RECIPE`` constant) says.

    param_groups(model, weight_decay)       decay on weights; none on norms, biases and embeddings
    build_optimizer(model, recipe, device)  torch's AdamW / Adam / SGD, fused on CUDA, foreach elsewhere
    build_scheduler(optimizer, recipe)      LambdaLR: linear warmup, then cosine / linear decay or constant
    clip_grad_norm(model, max_norm)         the whole model's gradient norm over every mesh axis, clipped

In a training step::

    grad_norm = clip_grad_norm(model, recipe.max_grad_norm)   # after backward (and the pipeline's step)
    optimizer.step()
    scheduler.step()                                           # the rate of the next step
    optimizer.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from autoshard.errors import AutoshardError
from autoshard.ir.recipe import OPTIMIZERS as RECIPE_OPTIMIZERS
from autoshard.ir.recipe import SCHEDULES, TABLE, Recipe
from autoshard.runtime.checkpoint import StageOptimizers
from autoshard.runtime.model import no_decay_params, strip_wrapper_names

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "TABLE",
    "Recipe",
    "param_groups",
    "optimizer_kernel",
    "optimizer_for",
    "recipe_params",
    "build_optimizer",
    "lr_factor",
    "LRFactor",
    "StageSchedulers",
    "build_scheduler",
    "clip_grad_norm",
]

# The recipe's optimizer names (``ir.recipe.OPTIMIZERS``) -> torch's classes
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}
assert tuple(OPTIMIZERS) == RECIPE_OPTIMIZERS


# ---------------------------------------------------------------------------- weight decay groups


def param_groups(model: nn.Module, weight_decay: float, no_decay: frozenset[str] | None = None) -> list[dict]:
    """torch param groups: ``weight_decay`` on every parameter but norms', biases and embeddings', which get 0
    (``model.no_decay_names``); each parameter once (a tied one is one tensor), empty groups left out.

    ``no_decay``: the names to leave undecayed when ``model`` no longer has the module types (a pipeline stage's
    graph module: ``PipelineStages.no_decay``, found on the whole model before the split); else found here by
    type, which works on DTensor (TP), FSDP2 and DDP-wrapped models."""
    params = {id(p): p for p in model.parameters()}  # parameters()' own dedup: a tied tensor once
    if no_decay is None:
        undecayed = set(no_decay_params(model))
    else:
        undecayed = {
            id(p) for name, p in model.named_parameters(remove_duplicate=False) if strip_wrapper_names(name) in no_decay
        }
    decay = [p for key, p in params.items() if key not in undecayed]
    plain = [p for key, p in params.items() if key in undecayed]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


# ---------------------------------------------------------------------------- optimizer


def optimizer_kernel(optimizer: str, params: Iterable[torch.Tensor], device_type: str) -> dict[str, bool]:
    """Which of torch's implementations steps ``params``: ``{"fused": True}`` on CUDA (one kernel per step;
    DTensor dispatches torch's fused Adam/AdamW to its shards, but has no fused SGD, which then runs foreach),
    else torch's per-tensor for-loop (``{"foreach": False}``: on CPU what one process's plain optimizer runs,
    so a CPU run matches it bit for bit; torch 2.13's fused CPU kernel rounds differently). Parameters that mix
    DTensors and plain tensors (tensor parallelism without FSDP2: the replicated modules stay plain) take the
    for-loop everywhere: torch's foreach and fused kernels refuse a list of both ("mixed torch.Tensor and
    DTensor")."""
    params = list(params)
    on_cuda = device_type == "cuda" and all(p.device.type == "cuda" and p.is_floating_point() for p in params)
    mixed = len({isinstance(p, DTensor) for p in params}) > 1
    if not on_cuda or mixed:
        return {"foreach": False}
    dtensor_sgd = optimizer == "sgd" and any(isinstance(p, DTensor) for p in params)
    return {"foreach": True} if dtensor_sgd else {"fused": True}


def optimizer_for(params, recipe: Recipe, device_type: str) -> torch.optim.Optimizer:
    """``recipe``'s optimizer over ``params`` (tensors or param groups), with ``optimizer_kernel``'s kernel."""
    params = list(params)
    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    return OPTIMIZERS[recipe.optimizer](
        params, **recipe.optimizer_kwargs(), **optimizer_kernel(recipe.optimizer, tensors, device_type)
    )


def recipe_params(module: nn.Module, recipe: Recipe, no_decay: frozenset[str] | None = None) -> list:
    """What the optimizer steps: every parameter in one group (``decay_all``), or ``param_groups``."""
    if recipe.decay_all:
        return list(module.parameters())
    return param_groups(module, recipe.weight_decay, no_decay)


def build_optimizer(model_or_params, recipe: Recipe, device_type: str):
    """``recipe``'s optimizer: over a module (or pipeline stages: one per stage module, ``StageOptimizers``,
    their no-decay names read from the whole model, ``PipelineStages.no_decay``) or over given parameters or
    groups. Kernel: fused on CUDA, foreach elsewhere (``optimizer_kernel``). ZeRO-1 over DDP:
    ``runtime.parallel.build_optimizer(..., recipe=...)``."""
    modules = getattr(model_or_params, "modules", None)
    if isinstance(modules, list):  # pipeline stages
        no_decay = getattr(model_or_params, "no_decay", frozenset())
        return StageOptimizers(
            modules,
            lambda params, **_: optimizer_for(params, recipe, device_type),
            params_of=lambda module: recipe_params(module, recipe, no_decay),
        )
    if isinstance(model_or_params, nn.Module):
        return optimizer_for(recipe_params(model_or_params, recipe), recipe, device_type)
    return optimizer_for(model_or_params, recipe, device_type)


# ---------------------------------------------------------------------------- learning-rate schedule


def lr_factor(step: int, recipe: Recipe) -> float:
    """The learning rate of step ``step`` (0-based) as a fraction of ``recipe.lr``. With W = warmup_steps,
    S = steps, m = min_lr_ratio::

        t < W        (t + 1) / W                                  linear warmup, reaching lr at t = W − 1
        t ≥ W        p = min(1, (t + 1 − W) / (S − W))            the decay's progress, 1 at t = S − 1
          constant   1
          linear     m + (1 − m)·(1 − p)
          cosine     m + (1 − m)·(1 + cos(π·p)) / 2

    and m (the floor) once p = 1, for every step after S too (S ≤ W: the floor right after warmup)."""
    warmup, steps, floor = recipe.warmup_steps, recipe.steps, recipe.min_lr_ratio
    if step < warmup:
        return (step + 1) / warmup
    if recipe.schedule == "constant":
        return 1.0
    assert steps is not None, "a decaying schedule needs steps (Recipe.for_run)"
    progress = min(1.0, (step + 1 - warmup) / (steps - warmup)) if steps > warmup else 1.0
    if recipe.schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2


class LRFactor:
    """``lr_factor`` of one recipe, as LambdaLR's function (a class, so the scheduler's state never pickles code)."""

    def __init__(self, recipe: Recipe):
        if recipe.schedule != "constant" and recipe.steps is None:
            raise AutoshardError(
                f"schedule '{recipe.schedule}' decays over steps, and the recipe has none; fix: "
                f"set steps in [{TABLE}], or pass the run's steps (Recipe.for_run)"
            )
        self.recipe = recipe

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.recipe)


class StageSchedulers:
    """One LambdaLR per pipeline stage optimizer (``StageOptimizers``), stepped together; one state (they count
    the same steps)."""

    def __init__(self, schedulers: list[LambdaLR]):
        self.schedulers = schedulers

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr()

    @property
    def last_epoch(self) -> int:
        return self.schedulers[0].last_epoch


def build_scheduler(optimizer, recipe: Recipe):
    """``recipe``'s schedule (``lr_factor``) as torch's LambdaLR on ``optimizer`` (each stage's for
    ``StageOptimizers``: ``StageSchedulers``). Step it after each ``optimizer.step()``: it sets the rate of the
    next step. Checkpoints hold its position (``checkpoint.save`` / ``resume`` with ``scheduler=``)."""
    if isinstance(optimizer, StageOptimizers):
        return StageSchedulers([build_scheduler(o, recipe) for o in optimizer.optimizers])
    return LambdaLR(optimizer, LRFactor(recipe))


# ---------------------------------------------------------------------------- gradient clipping


def clip_grad_norm(model, max_norm: float | None) -> float:
    """Scale every gradient by min(1, max_norm / (‖g‖ + 1e-6)), ‖g‖ the 2-norm of the WHOLE model's gradient as
    one process computes it (torch's ``clip_grad_norm_`` formula); returns ‖g‖ (for logging; NaN on fake
    tensors). ``max_norm`` None: nothing is clipped, the norm is still computed.

        ‖g‖² = Σ_buckets ‖g_bucket‖²  (+ over the pp ranks for pipeline stages)

    with this rank's gradients bucketed by how their pieces lie over the ranks (``_norm_buckets``):
    DTensors (TP, FSDP2 shards, HSDP, expert DTensors) by their mesh, each bucket's norm from torch's
    ``get_total_norm`` made whole with ``full_tensor()`` (a Replicate dim counts once, a Shard dim sums);
    plain tensors (DDP, parameters kept whole beside FSDP2: every rank holds the same gradient) count once.
    Pipeline stages hold plain TP shards and plain expert shards that torch knows nothing of: their squares
    are summed over the tp group and the expert group by hand, then every stage's over the pp group; a weight
    tied across stages is counted at one copy (after ``sync_tied_grads`` every copy holds the sum). Only the
    2-norm. Call it where the recipe clips (``max_grad_norm`` set) or the norm is logged: it runs collectives
    on every rank, after the backward (and a pipeline's step), before ``optimizer.step()``."""
    buckets = _norm_buckets(model)
    squares = [_bucket_square(bucket) for bucket in buckets]
    device = _device_of(model)
    # host offload leaves FSDP2's gradients (and their bucket's square) on the host: every square on the device
    total_square = torch.stack([sq.to(device) for sq in squares]).sum() if squares else torch.zeros((), device=device)
    pp_group = getattr(model, "pp_group", None)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:  # torch has no pipeline-wide norm (torchtitan
        dist.all_reduce(total_square, op=dist.ReduceOp.SUM, group=pp_group)  # reduces it over pp the same way)
    total = total_square.sqrt()
    if max_norm is not None:
        for bucket in buckets:
            torch.nn.utils.clip_grads_with_norm_(bucket.params, max_norm, total, foreach=None)
    return math.nan if is_fake(total) else total.item()


@dataclass
class _Bucket:
    """Gradients whose 2-norm is made whole the same way: over ``mesh`` (DTensors), then summed in squares over
    each of ``groups`` (plain shards pipelining keeps: TP's, experts')."""

    mesh: Any
    groups: tuple
    params: list[nn.Parameter]


def _norm_buckets(model) -> list[_Bucket]:
    """This rank's parameters with a gradient, each once, bucketed (``clip_grad_norm``), in parameter order (the
    same on every rank that holds the same modules, so each bucket's collectives line up)."""
    from autoshard.runtime.expert_parallel import expert_shard_of

    modules = model.modules if isinstance(getattr(model, "modules", None), list) else [model]
    tp_shards = getattr(model, "tp_shard_dims", {})
    tp_group = getattr(model, "tp_group", None)
    skipped = _extra_tied_copies(model)
    buckets: dict[tuple, _Bucket] = {}
    seen: set[int] = set()
    for module in modules:
        for name, param in module.named_parameters():
            if id(param) in seen or id(param) in skipped or param.grad is None:
                continue
            seen.add(id(param))
            grad = param.grad
            mesh = grad.device_mesh if isinstance(grad, DTensor) else None
            groups = []
            if tp_group is not None and strip_wrapper_names(name) in tp_shards and param.dim() > 0:
                groups.append(tp_group)
            if (shard := expert_shard_of(param)) is not None:
                groups.append(shard.group)
            key = (id(mesh), tuple(id(g) for g in groups))
            buckets.setdefault(key, _Bucket(mesh, tuple(groups), [])).params.append(param)
    return list(buckets.values())


def _extra_tied_copies(model) -> set[int]:
    """The ids of the copies of weights tied across pipeline stages that the norm leaves out: every copy but the
    first on the lowest pp rank holding one (``pipeline_parallel.TiedCopies``; its group ranks are the holders
    in pp order)."""
    skipped = set()
    for tie in getattr(model, "tied", ()):
        first_holder = tie.group is None or dist.get_rank(tie.group) == 0
        for index, (position, name) in enumerate(tie.copies):
            if index > 0 or not first_holder:
                skipped.add(id(model.stages[position].submod.get_parameter(name)))
    return skipped


def _bucket_square(bucket: _Bucket) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm([p.grad for p in bucket.params], 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()  # one number: torch's reduction of the norm over the mesh's dims (gathers: scalar)
    square = norm.to(torch.promote_types(norm.dtype, torch.float32)) ** 2  # fp32 at least; float64 stays
    for group in bucket.groups:  # shards torch sees as plain tensors: summed over their group by hand
        if dist.get_world_size(group) > 1:
            dist.all_reduce(square, op=dist.ReduceOp.SUM, group=group)
    return square


def _device_of(model) -> torch.device:
    modules = model.modules if isinstance(getattr(model, "modules", None), list) else [model]
    param = next((p for m in modules for p in m.parameters()), None)
    return param.device if param is not None else torch.device("cpu")
