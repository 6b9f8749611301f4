"""One process training the plan's model: ``autoshard verify``'s reference (``verify``'s module doc), in the
plan's precision, in fp32 and in float64 (``Float64Fallback``: ops without a float64 kernel run in fp32), its
micro-batches as the plan accumulates them (``reference_microbatches``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from autoshard.ir.decisions import PrecisionPolicy, precision_policy
from autoshard.ir.plan import Plan
from autoshard.ir.recipe import Recipe
from autoshard.modelfile import ModelFile
from autoshard.passes.lowering.lower import lower
from autoshard.runtime.data import (
    DataSource,
    global_batches,
    split_microbatches,
    take_shard,
)
from autoshard.runtime.model import build_model, default_dtype, has_batch_norm, zero_dropout_rates
from autoshard.runtime.randomness import fixed_randomness
from autoshard.runtime.recipe import build_optimizer, build_scheduler, clip_grad_norm


@dataclass(frozen=True)
class Run:
    """One training run: the loss of every step and the final state (weights and buffers)."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    grad_norms: tuple[float | None, ...] = ()  # each step's, before clipping (None: the recipe does not clip)

    def __iter__(self):  # losses, params = train_reference(...)
        return iter((self.losses, self.params))


def reference_microbatches(model_file: ModelFile, plan: Plan) -> tuple[int, int] | None:
    """(dp, micro-batches) when the reference must accumulate over the program's micro-batches:
    BatchNorm normalises over each micro-batch there. None otherwise (one batch per step)."""
    if plan.num_microbatches > 1 and has_batch_norm(model_file.build("meta")):
        return plan.mesh.dp, plan.num_microbatches
    return None


def train_reference(
    model_file: ModelFile,
    batch_size: int,
    steps: int,
    seed: int,
    lr: float,
    dtype: torch.dtype = torch.float32,
    fixed_randomness: bool = False,
    microbatches: tuple[int, int] | None = None,
    data: DataSource | None = None,
    tokens_per_sample: int | None = None,
    dp: int = 1,
    recipe: Recipe | None = None,
    precision: str = "fp32",
    gathers_params: bool = False,
) -> Run:
    """One process, the whole global batch per step: the ground truth.

    ``recipe``: the program's (``Recipe.for_run(steps, lr)``: ``lr`` replaces its own, as the program's ``--lr``):
    its optimizer over ``param_groups`` of the whole model (``runtime.recipe.build_optimizer``), its scheduler,
    and after each step's backward the whole model's gradient clipped (``clip_grad_norm``, torch's
    ``clip_grad_norm_`` in one process) when it clips. None: torch's AdamW at ``lr`` on every parameter, no
    schedule, no clipping (what the tests' own drivers train with).

    ``dtype=torch.float64`` casts the fp32 initial weights and the float data, so it is the same
    computation with less rounding (an op with no float64 kernel runs in fp32 there:
    ``Float64Fallback``). ``fixed_randomness=True`` zeroes the model's dropout rates and runs
    under ``NoDropout``. ``microbatches=(dp, m)``: accumulate over the m micro-batches the program
    runs, each the dp ranks' slices of it. ``data``: train on that source's dataset (``runtime.data.global_batches``:
    samples of ``tokens_per_sample``, in the order ``dp`` ranks read them), None: on example_batch draws.
    ``precision``: the plan's (``ir.decisions.PRECISIONS``), run as its program runs it in one process: the
    model cast after its fp32 initialisation (bf16-pure, floating inputs too), the forward under autocast
    (bf16-autocast, fp16-autocast), the loss scaled by torch's GradScaler (fp16-autocast); ignored at float64.
    ``gathers_params``: the program's FSDP2 gathers the weights in the policy's param dtype (``gathers_params``), so
    the forward reads every parameter rounded to it (and floating inputs cast to it, as FSDP2 casts its root's),
    the gradients flowing back to the fp32 weights through the cast.
    """
    policy = precision_policy(precision if dtype != torch.float64 else "fp32")
    model = build_model(model_file, seed).to(dtype)
    if policy.cast_dtype is not None:
        model = model.to(getattr(torch, policy.cast_dtype))
    forward = _forward_precision(policy)
    gathered = (
        getattr(torch, policy.param_dtype) if gathers_params and policy.param_dtype and dtype != torch.float64 else None
    )
    scaler = torch.amp.GradScaler("cpu") if policy.grad_scaler else None
    if fixed_randomness:
        zero_dropout_rates(model)
    if recipe is None:
        optimizer, scheduler, max_norm = torch.optim.AdamW(model.parameters(), lr=lr), None, None
    else:
        recipe = recipe.for_run(steps, lr=lr)
        optimizer = build_optimizer(model, recipe, "cpu")
        scheduler, max_norm = build_scheduler(optimizer, recipe), recipe.max_grad_norm
    losses = []
    fallback = Float64Fallback() if dtype == torch.float64 else contextlib.nullcontext()
    default = default_dtype(torch.float64) if dtype == torch.float64 else contextlib.nullcontext()
    batch_of = global_batches(model_file, data, batch_size, seed, tokens_per_sample, dp)
    with _fixed_randomness() if fixed_randomness else contextlib.nullcontext(), fallback, default:
        for step in range(steps):
            batch = _cast(batch_of(step), dtype)
            if policy.cast_dtype is not None:
                batch = _cast_inputs(batch, getattr(torch, policy.cast_dtype))
            if gathered is not None:
                batch = _cast_inputs(batch, gathered)
            loss = sum(
                _backward(model_file, model, chunk, len(chunks), forward, scaler, gathered)
                for chunks in [_reference_chunks(batch, microbatches)]
                for chunk in chunks
            )
            if scaler is not None:
                scaler.unscale_(optimizer)
            if max_norm is not None:
                clip_grad_norm(model, max_norm)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss))
    return Run(losses, {k: v.detach().clone() for k, v in model.state_dict().items()})


_fixed_randomness = fixed_randomness  # the context manager, under a name the parameter does not shadow


class Float64Fallback(TorchFunctionMode):
    """In the float64 reference, an op that has no float64 kernel (``torch._grouped_mm`` in transformers'
    MoE experts) runs on fp32 copies of its float64 inputs, its outputs cast back: that op rounds like
    fp32, every other op like float64, so the reference stays far closer to exact than the fp32 run."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as exc:
            if not _DOUBLE_REFUSED.search(str(exc)):
                raise
        args, kwargs = tree_map(_to(torch.float64, torch.float32), (args, kwargs))
        return tree_map(_to(torch.float32, torch.float64), func(*args, **kwargs))


_DOUBLE_REFUSED = re.compile(r"Double|float64", re.IGNORECASE)


def _to(src: torch.dtype, dst: torch.dtype):
    return lambda t: t.to(dst) if isinstance(t, torch.Tensor) and t.dtype == src else t


def gathers_params(plan: Plan) -> bool:
    """Whether the plan's program gathers its weights through FSDP2 (``apply_fsdp``, ``apply_replicate``), whose
    mixed-precision policy rounds every parameter to its param dtype for the forward (autocast alone rounds only
    what its listed ops read)."""
    return any(step.op in ("apply_fsdp", "apply_replicate") for step in lower(plan))


def _forward_precision(policy: PrecisionPolicy) -> Callable[[], contextlib.AbstractContextManager]:
    """The forward's context in one process: CPU autocast in the policy's dtype, or nothing."""
    if policy.autocast_dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast("cpu", dtype=getattr(torch, policy.autocast_dtype))


def _backward(
    model_file: ModelFile,
    model,
    chunk,
    count: int,
    forward: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    scaler: torch.amp.GradScaler | None = None,
    gathered: torch.dtype | None = None,
) -> float:
    inputs, targets = chunk
    with forward():
        if gathered is None:
            outputs = model(*inputs)
        else:  # FSDP2's mixed precision: the forward on a copy of the weights in its param dtype
            cast = {name: p.to(gathered) if p.is_floating_point() else p for name, p in model.named_parameters()}
            outputs = torch.func.functional_call(model, cast, inputs)
        loss = model_file.loss(outputs, targets) / count
    (scaler.scale(loss) if scaler is not None else loss).backward()
    return loss.item()


def _cast_inputs(batch, dtype: torch.dtype):
    inputs, targets = batch
    return tuple(t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs), targets


def _reference_chunks(batch, microbatches: tuple[int, int] | None) -> list:
    if microbatches is None:
        return [batch]
    dp, count = microbatches
    per_rank = [split_microbatches(*take_shard(batch, r, dp, torch.device("cpu")), count) for r in range(dp)]
    return [
        (
            tuple(torch.cat(parts) for parts in zip(*(per_rank[r][i][0] for r in range(dp)))),
            torch.cat([per_rank[r][i][1] for r in range(dp)]),
        )
        for i in range(count)
    ]


def _cast(batch, dtype: torch.dtype):
    inputs, targets = batch
    cast = lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
    return tuple(cast(t) for t in inputs), cast(targets)
