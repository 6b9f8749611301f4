"""Apply chosen tensor-parallel styles with DTensor's ``parallelize_module``.

    style                        ParallelStyle                                   weight / output
    colwise                      ColwiseParallel()                               Shard(0) / local shard
    colwise-gather               ColwiseParallel(output_layouts=Replicate())     Shard(0) / all-gathered
    rowwise                      RowwiseParallel()                               Shard(1) / all-reduced
    vocab-parallel-embedding     RowwiseParallel(input_layouts=Replicate())      Shard(0) / all-reduced
    replicate                    (nothing: a plain parameter, the same on every TP rank)

``use_local_output=True`` (the default) hands plain local tensors to the code between the
parallel linears, so attention must reshape with -1 for the head count: examples/gpt.py's
``view(b, s, -1, head_dim)`` and HF Llama's ``view(*input_shape, -1, head_dim)`` (and its
``repeat_kv``, which reads the KV head count from the tensor) both do; local heads = heads / tp.

Replicated parameters need no gradient sync over tp: every TP rank computes the same
activations at the replicated ops (the planner only leaves S inside col → row spans).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from autoshard.errors import AutoshardError


def parallel_style(style: str) -> ParallelStyle | None:
    """The DTensor ParallelStyle of a planner style name; None for "replicate"."""
    if style == "replicate":
        return None
    if style == "colwise":
        return ColwiseParallel()
    if style == "colwise-gather":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise":
        return RowwiseParallel()
    if style == "vocab-parallel-embedding":
        return RowwiseParallel(input_layouts=Replicate())
    raise AutoshardError(f"unknown tensor-parallel style {style!r}; use colwise, colwise-gather, rowwise, "
                         f"vocab-parallel-embedding or replicate")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, styles: dict[str, str]) -> nn.Module:
    """Shard the modules named in ``styles`` over ``tp_mesh`` (in place; returns the model)."""
    plan = {path: parallel_style(style) for path, style in styles.items() if style != "replicate"}
    for path in plan:
        _check_module(model, path)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a whole tensor (DTensors gathered), under the model's names."""
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for name, t in model.state_dict().items()}


def _check_module(model: nn.Module, path: str) -> None:
    try:
        module = model.get_submodule(path)
    except AttributeError as exc:
        raise AutoshardError(f"tensor parallel: the model has no module {path!r}; re-plan this model") from exc
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        raise AutoshardError(f"tensor parallel: {path} is a {type(module).__name__}, not nn.Linear / nn.Embedding; "
                             f"keep it replicated")
