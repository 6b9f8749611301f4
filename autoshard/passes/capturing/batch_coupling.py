"""Whether the loss of a batch is the mean of its shares' losses: what data parallelism and micro-batching need.

A data-parallel program gives each of dp ranks 1/dp of the batch, and each micro-batch 1/m of that;
every share computes the model file's loss on its own samples, and the gradients are averaged (DDP,
FSDP2) or summed over micro-batches of loss / m. That is one process's gradient exactly when

    L(batch) = mean over equal shares S of L(S)                                  (*)

as it is for a per-sample (or per-token, with as many tokens in every share) loss averaged over the
batch. (*) fails for a loss that couples the samples of a batch: a contrastive loss over the B x B
similarities of a batch (CLIP, SimCLR), in-batch negatives, a loss summed instead of averaged (dp
times one process's gradient), a mean over a count the data decide (ignore_index spread unevenly). Such
a plan would train wrong, so the planner refuses dp > 1, cp > 1 and more than one micro-batch for it
(``strategies``), with the reason found here.

How it is checked: on the model file's own example batch of ``CHECK_BATCH`` samples, the model built on
the CPU from a fixed seed, its random ops at their expectation (``runtime.randomness``) and BatchNorm at
its running statistics (the programs synchronise BatchNorm's batch statistics over the dp ranks
themselves: ``runtime.model.sync_batch_norm``), L of the batch against the mean of L of its two halves,
in float64 (so rounding cannot pass for a difference), relative tolerance ``RTOL`` (fp32 and ``RTOL_FP32`` for a
model that does not run in float64; a model that runs in neither is not checked). A model whose weights
would not fit in ``MAX_CHECK_BYTES``, or whose check would take more than a few seconds or a large share of
the machine's memory, is checked on a reduced copy instead: an ``hf:DIR`` model on its config narrowed
(``narrowing.narrowed_config``: the same architecture's code at width 64), any other on ``reduced_copy`` (its
repeated layers cut to three where their settings agree, its work held to the same bounds, a finding of no coupling
kept only where the captured graphs prove the cut layers run as the kept ones); one that no copy brings within them,
or whose cut is not proven, is not checked (``graph.batch_coupling`` None, and the plan says so). The check's work, from
the captured graph at its batch b (unfolded: every layer's FLOPs and outputs):

    FLOPs         2 · CHECK_BATCH / b · Σ_n flops(n)          (the whole batch, then its halves)    ≤ MAX_CHECK_FLOPS
    largest value CHECK_BATCH / b · max_n numel(n) · 8 bytes  (float64; the logits, usually)        ≤ MAX_CHECK_VALUE_BYTES

GPT-2 124M at 1,024 tokens is 2.3e12 FLOPs and a 1.6 GB logits tensor: 47 s and 5.5 GB of memory on a 2-core
machine, for a plan that otherwise takes seconds.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from autoshard.ir.graph import OpGraph
from autoshard.modelfile import ModelFile

CHECK_BATCH = 4  # samples of the example batch checked; halves of 2
RTOL = 1e-6  # float64: a mean of shares differs from the whole by rounding of ~1e-15
RTOL_FP32 = 1e-4  # for a model with an op that has no float64 kernel, checked in fp32
MAX_CHECK_BYTES = 2**30  # weights (fp32 on the CPU) of the largest model run for the check
# ~5 s of float64 on 2 cores: transformers' CLIPModel at its default config (ViT-B/32), a contrastive loss this check
# exists for, is 1.2e11 (6 s); GPT-2 124M at 1,024 tokens 2.3e12 (47 s), and its logits are over the bound below
MAX_CHECK_FLOPS = 2 * 10**11
MAX_CHECK_VALUE_BYTES = 2**28  # the largest tensor of the check in float64 (a few such are alive at its peak)


def check_batch_coupling(model_file: ModelFile, graph: OpGraph) -> OpGraph:
    """``graph`` with ``batch_coupling``: "" when (*) holds, the reason when not, None when not run (module doc).
    A model over the bounds is checked on a reduced copy (``reduced_copy``)."""
    from autoshard.passes.capturing.reduced_copy import numel

    meta = model_file.build("meta")
    weight_bytes = 4 * sum(p.numel() for p in meta.parameters())  # the whole model, unfolded
    if weight_bytes <= MAX_CHECK_BYTES and _runs_quickly(graph):
        graph.batch_coupling = _in_float64_else_fp32(lambda dtype: coupling_reason(model_file, dtype=dtype))
    else:
        graph.batch_coupling = reduced_coupling(model_file, graph, numel(meta))
    return graph


def _in_float64_else_fp32(check) -> str | None:
    """``check(dtype)`` in float64, else in fp32 for a model with an op that has no float64 kernel; None if neither
    runs (the plan says it was not checked)."""
    for dtype in (torch.float64, torch.float32):
        try:
            return check(dtype)
        except Exception:  # noqa: BLE001 (the model's own code, on a CPU it was not written for)
            continue
    return None


NARROWED = "width 64, 2 layers, vocabulary 256 (narrowing.narrowed_config)"


def reduced_coupling(model_file: ModelFile, graph: OpGraph, whole_numel: int) -> str | None:
    """The check on a reduced copy of the model (``reduced_copy``'s doc: fewer layers), its work
    held to the same bounds; the reason says it was found on the copy. None where no copy is within them, the
    whole model's ``whole_numel`` elements are too many to replay, or the copy finds no coupling but the graphs do
    not prove its cut layers run as the kept ones (``reduced_copy.runs_like_the_whole``)."""
    from autoshard.passes.capturing import reduced_copy

    narrowed = getattr(model_file.module, "narrowed", None)  # hf:DIR: the same architecture, narrow
    if narrowed is not None:
        reason = _in_float64_else_fp32(lambda dtype: coupling_reason(narrowed(), dtype=dtype))  # its config too
        if reason is not None:
            return f"{reason} (found on the same architecture narrowed: {NARROWED})" if reason else ""
    if whole_numel > reduced_copy.MAX_REPLAY_NUMEL:
        return None
    made = reduced_copy.reduced_copy(model_file, graph.batch_size)
    if made is None:
        return None
    flops, largest_bytes = check_work(graph)
    if (
        4 * sum(p.numel() for p in made.model.parameters()) > MAX_CHECK_BYTES
        or flops * reduced_copy.numel(made.model) / made.whole_numel > MAX_CHECK_FLOPS
        or largest_bytes > MAX_CHECK_VALUE_BYTES
    ):
        return None
    reason = _in_float64_else_fp32(lambda dtype: coupling_reason(model_file, dtype=dtype, model=made.model))
    if reason:
        return f"{reason} (found on a reduced copy: {reduced_copy.describe(made.cut)})"
    if reason == "" and reduced_copy.runs_like_the_whole(model_file, graph, made.graph, made.cut):
        return ""
    return None  # not run, or the cut layers are not proven to run as the kept ones


def check_work(graph: OpGraph) -> tuple[int, int]:
    """(FLOPs, bytes of the largest value) of the check on ``graph``'s model (module doc)."""
    from autoshard.passes.capturing.fold import unfold

    full = unfold(replace(graph, blocks=[])) if graph.fold is not None else graph
    flops = 2 * CHECK_BATCH * sum(n.flops for n in full.nodes) // graph.batch_size
    largest = max((n.output_numel for n in full.nodes), default=0)
    return flops, 8 * CHECK_BATCH * largest // graph.batch_size


def _runs_quickly(graph: OpGraph) -> bool:
    flops, largest_bytes = check_work(graph)
    return flops <= MAX_CHECK_FLOPS and largest_bytes <= MAX_CHECK_VALUE_BYTES


def coupling_reason(
    model_file: ModelFile,
    batch_size: int = CHECK_BATCH,
    dtype: torch.dtype = torch.float64,
    model: torch.nn.Module | None = None,
) -> str:
    """Why the loss of a batch is not the mean of its halves' losses ("" when it is); in ``dtype``; on ``model``
    (converted in place) when given, else on the model file's, built at seed 0."""
    from autoshard.runtime.data import global_batch, take_shard
    from autoshard.runtime.model import build_model, default_dtype, zero_dropout_rates
    from autoshard.runtime.randomness import fixed_randomness

    model = (build_model(model_file, seed=0) if model is None else model).to(dtype)
    zero_dropout_rates(model)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.eval()
    batch = _cast(global_batch(model_file, batch_size, 0, 0), dtype)
    cpu = torch.device("cpu")
    rtol = RTOL if dtype == torch.float64 else RTOL_FP32
    with fixed_randomness(), torch.no_grad(), default_dtype(dtype):
        whole = float(model_file.loss(model(*batch[0]), batch[1]))
        halves = [float(model_file.loss(model(*x), y)) for x, y in (take_shard(batch, i, 2, cpu) for i in range(2))]
    mean = sum(halves) / 2
    if abs(whole - mean) <= rtol * max(abs(whole), abs(mean), 1e-30):
        return ""
    kind = (
        "the loss is a sum over the batch, not a mean (dp ranks would each add theirs; divide by the batch size)"
        if abs(whole - sum(halves)) <= rtol * abs(whole)
        else "the loss couples the samples of a batch (in-batch pairs, as a contrastive loss has, or a mean over a "
        "count the data decide)"
    )
    return (
        f"{kind}: on the example batch of {batch_size}, L(batch) = {whole:.6g} but its halves give "
        f"{halves[0]:.6g} and {halves[1]:.6g} (mean {mean:.6g})"
    )


def _cast(batch, dtype: torch.dtype):
    inputs, targets = batch
    cast = lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
    return tuple(cast(t) for t in inputs), cast(targets)
