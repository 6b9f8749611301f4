"""What ``autoshard.parallelize`` returns: a model (or this rank's pipeline stages) with the plan applied, and
the emitted program's training step for it.

``Parallelized.train_step(inputs, targets)`` is one step of a program's loop on a global batch of B samples,
for every plan, with the functions the emitted program's loop calls (``passes.lowering.codegen``):

    SPMD plans (dp, tp, ZeRO, cp, ep)                  pipeline plans (pp > 1)
    x, y = take_samples(batch, data axis)              x, y = take_samples(batch, data axis)
    Σ_j ℓ_j = runtime.forward_backward(model, x, y,    under autocast:
        m micro-batches, sequence axis, precision)         loss = pipeline_step(schedule, stages, x, y)
    loss = mean over the loss axis of Σ_j ℓ_j

so the gradients left for the optimizer are the one-process gradient of the global batch's mean loss, and the
returned loss is that mean (the value a program logs). The step leaves the optimizer to its caller: the
plan's recipe optimizer (``optimizer``, ZeRO-1's sharded state included), or one of the caller's own over
``parameters()``; ``clip_grad_norm`` clips the whole model's gradient over every mesh axis in between.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan
from autoshard.ir.recipe import Recipe
from autoshard.ir.steps import Layout
from autoshard.modelfile import ModelFile
from autoshard.runtime.data import DataSource, RankBatches, take_samples
from autoshard.runtime.distributed import mean_over
from autoshard.runtime.parallel import autocast
from autoshard.runtime.train_step import forward_backward


@dataclass
class Parallelized:
    """The plan applied on this rank (``autoshard.parallelize``): ``model`` (or this rank's ``PipelineStages``),
    the recipe's ``optimizer``, the ``mesh``, and the pipeline ``schedule`` (None without pp)."""

    plan: Plan
    layout: Layout
    mesh: Any  # DeviceMesh
    device: torch.device
    model: Any  # nn.Module, or runtime.pipeline_parallel.PipelineStages for a pipeline plan
    optimizer: torch.optim.Optimizer
    recipe: Recipe
    loss_fn: Callable
    schedule: Any = None  # torch.distributed.pipelining's schedule for a pipeline plan
    model_file: Callable[[], ModelFile] | None = field(default=None, repr=False)  # the plan's model file, on demand

    @property
    def is_pipeline(self) -> bool:
        return self.schedule is not None

    @property
    def reads(self) -> bool:
        """Whether this rank reads batches: every rank but a pipeline's middle ones (neither the first stage, which
        takes the inputs, nor the last, which takes the targets)."""
        return not self.is_pipeline or self.model.reads

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once (its shards; a pipeline's: its stages'), for an optimizer of one's own."""
        return list(self.model.parameters())

    def train_step(self, inputs, targets, loss_fn: Callable | None = None, *, local: bool = False) -> float:
        """Forward and backward of one global batch (``inputs``: a tensor or a tuple of them, batch first;
        ``targets``: one tensor) as the plan runs it (module doc); returns its mean loss, the same on every rank.
        A pipeline's middle ranks (``reads`` False) ignore the batch: ``data_loader`` gives them ``((), None)``.
        Gradients are left for ``optimizer.step()``. ``local=True``: the batch is this rank's share already
        (B / dp samples, what ``data_loader`` gives). ``loss_fn(outputs, targets)``: None, the one given to
        ``autoshard.parallelize`` (default: the model file's)."""
        inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        nothing = not inputs and targets is None  # data_loader's batch on a rank that reads none
        if not (nothing and not self.reads):  # every rank refuses a bad call, together
            self._check_batch(tuple(inputs), targets, local)
        loss_fn = self._loss_fn(loss_fn)
        if not self.reads:  # a pipeline's middle stage: the schedule feeds it
            return self._pipeline_step((), None)
        if local:
            inputs, targets = tuple(t.to(self.device) for t in inputs), targets.to(self.device)
        else:
            inputs, targets = take_samples((tuple(inputs), targets), self.mesh, self.layout.data_axis, self.device)
        if self.is_pipeline:
            return self._pipeline_step(inputs, targets)  # the global batch's mean
        spec = self.layout
        step_loss = forward_backward(
            self.model,
            inputs,
            targets,
            loss_fn,
            self.mesh,
            self.plan.num_microbatches,
            spec.sequence_axis,
            spec.tokens_per_sample,
            self.plan.precision,
            loss_parallel=spec.loss_parallel,
        )
        return mean_over(step_loss, self.mesh.get_group(spec.loss_axis))

    def _pipeline_step(self, inputs: tuple, targets) -> float:
        from autoshard.runtime.pipeline_parallel import pipeline_step  # pipelining: imported by pipeline plans only

        with autocast(self.plan.precision, self.device):
            return pipeline_step(self.schedule, self.model, inputs, targets)

    def clip_grad_norm(self, max_norm: float | None) -> float:
        """Clip the whole model's gradient to 2-norm ``max_norm`` (None: only measure it), the norm taken over
        every mesh axis as one process takes it (``runtime.recipe.clip_grad_norm``); returns the norm. Call it on
        every rank after ``train_step``, before ``optimizer.step()``."""
        from autoshard.runtime.recipe import clip_grad_norm

        return clip_grad_norm(self.model, max_norm)

    def lr_scheduler(self, steps: int | None = None):
        """The recipe's learning-rate schedule on ``optimizer`` (warmup, then its decay over ``steps``, or the
        recipe's own steps); ``scheduler.step()`` after each ``optimizer.step()``."""
        from autoshard.runtime.recipe import build_scheduler

        return build_scheduler(self.optimizer, self.recipe if steps is None else self.recipe.for_run(steps))

    def data_loader(self, dataset=None, seed: int = 0, workers: int = 1) -> RankBatches:
        """This rank's share of each step's global batch, in step order (iterate it, or ``take(step)``), for
        ``train_step(..., local=True)``: ``dataset`` (a map-style dataset, or an iterable one, of ``(inputs, target)``
        samples, each one row of the model file's ``example_batch``; None: the model file's ``dataset`` if it has one, else
        ``example_batch`` draws) read through a ``DataLoader`` over a ``DistributedSampler`` on the data axis,
        shuffled with ``seed``, ``workers`` processes ahead (a stream: read in this process, ``runtime.data``); a
        pipeline rank holding neither the first nor the last stage gets ``((), None)`` (``reads``). The global batch of step k is the
        one ``autoshard verify``'s one-process run reads (``runtime.data.dataset_global_batch``)."""
        if self.model_file is None:
            raise AutoshardError(
                "data_loader needs the plan's model file (its example_batch checks the samples); "
                "fix: parallelize a plan made from a model file"
            )
        return RankBatches(
            self.model_file(),
            DataSource(),
            self.plan.global_batch,
            self.layout.tokens_per_sample,
            self.mesh,
            self.layout.data_axis,
            self.device,
            seed,
            workers,
            dataset=dataset,
            reads=self.reads,
        )

    def __iter__(self):
        raise AutoshardError(
            "autoshard.parallelize returns one object, not (model, optimizer, mesh); fix: "
            "p = autoshard.parallelize(...), then p.model, p.optimizer, p.mesh and p.train_step"
        )

    def _check_batch(self, inputs: tuple, targets, local: bool) -> None:
        dp = self.mesh[self.layout.data_axis].size() if local else 1
        want = self.plan.global_batch // dp
        tensors = [*inputs, targets]
        if not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in tensors):
            raise AutoshardError(
                f"train_step takes inputs (a tensor or a tuple of them) and targets (a tensor), "
                f"batch first; got {', '.join(type(t).__name__ for t in tensors)}; fix: pass tensors "
                f"(example_batch's, a DataLoader's)"
            )
        sizes = sorted({t.shape[0] for t in tensors})
        if sizes != [want]:
            what = (
                f"this rank's share of {want} samples (global batch {self.plan.global_batch} / dp {dp})"
                if local
                else f"the plan's global batch of {want} samples"
            )
            fix = "pass exactly that many" + (
                "" if local else ", or local=True for this rank's share (data_loader's batches)"
            )
            raise AutoshardError(f"train_step takes {what}, got a batch of {' and '.join(map(str, sizes))}; fix: {fix}")

    def _loss_fn(self, loss_fn: Callable | None) -> Callable:
        if loss_fn is None or loss_fn is self.loss_fn:
            return self.loss_fn
        if self.is_pipeline:
            raise AutoshardError(
                "a pipeline's schedule computes the loss it was built with; fix: pass loss_fn to "
                "autoshard.parallelize, not to train_step"
            )
        if self.layout.loss_parallel:
            raise AutoshardError(
                "this plan computes the model file's cross-entropy on the logits' vocabulary shards (loss "
                "parallelism); fix: call train_step without loss_fn, or re-plan with --loss-parallel off"
            )
        return loss_fn
