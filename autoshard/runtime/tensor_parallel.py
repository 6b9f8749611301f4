"""Apply chosen tensor-parallel styles with DTensor's ``parallelize_module``.

    style                        ParallelStyle                                   weight / output
    colwise                      ColwiseParallel()                               Shard(0) / local shard
    colwise-gather               ColwiseParallel(output_layouts=Replicate())     Shard(0) / all-gathered
    rowwise                      RowwiseParallel()                               Shard(1) / all-reduced
    vocab-parallel-embedding     RowwiseParallel(input_layouts=Replicate())      Shard(0) / all-reduced
    conv1d-colwise               Conv1DColwiseParallel()                         Shard(1) / local shard
    conv1d-rowwise               Conv1DRowwiseParallel()                         Shard(0) / all-reduced
    sharded-input-dim{d}         SequenceParallel(sequence_dim=d,                Replicate / local shard
                                   use_local_output=True)
    replicate                    (nothing: a plain parameter, the same on every TP rank)

The two ``conv1d-*`` styles are for transformers' ``Conv1D`` (GPT-2): its weight is (in, out) and
y = x @ W + b, the transpose of nn.Linear, so the column (output-feature) split is weight Shard(1)
with bias Shard(0), and the row (input-feature) split is weight Shard(0) with the bias replicated.
They install the same hooks as ColwiseParallel / RowwiseParallel; Conv1D's own forward
(``addmm`` on views) then runs on DTensors.

``use_local_output=True`` (the default) hands plain local tensors to the code between the
parallel linears, so attention must reshape with -1 for the head count: examples/gpt.py's
``view(b, s, -1, head_dim)`` and HF Llama's ``view(*input_shape, -1, head_dim)`` (and its
``repeat_kv``, which reads the KV head count from the tensor) both do; local heads = heads / tp.

A module whose parameters stay whole but whose input is a shard (Qwen3's per-head ``q_norm`` on
heads sharded over tp) takes ``sharded-input-dim{d}``: torch's SequenceParallel on the sharded dim
makes its parameters Replicate DTensors and its input a Shard(d) DTensor, so each rank's partial
weight gradient is summed over tp by DTensor (Megatron does the same for sequence-parallel norms).
Every other replicated parameter only meets replicated activations (the planner's layouts keep
it so), so every TP rank computes the same gradient for it and needs no sync.
"""

from __future__ import annotations

import ast
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.distributed.tensor.placement_types import Placement

from autoshard.errors import AutoshardError
from autoshard.ir.decisions import REPLICATE, tp_style


def parallel_style(style: str) -> ParallelStyle | None:
    """The DTensor ParallelStyle of a planner style name (its row in ``ir.decisions.TP_STYLES``, built);
    None for "replicate"."""
    if style == REPLICATE:
        return None
    row = tp_style(style)
    constructor = _CONSTRUCTORS[row.constructor]
    return constructor(**{key: _argument(source) for key, source in row.arguments})


def _argument(source: str):
    """A style argument's value from its source text: ``Replicate()``, or a Python literal."""
    return Replicate() if source == "Replicate()" else ast.literal_eval(source)


class Conv1DColwiseParallel(ParallelStyle):
    """Column (output-feature) split of a transformers ``Conv1D``: weight (in, out) Shard(1), bias Shard(0).

    Input: a replicated local tensor (made a Replicate DTensor; its gradient is all-reduced in
    backward, Megatron's f). Output: this rank's slice of the last dim, as a local tensor.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_conv1d(module, type(self).__name__)
        return distribute_module(
            module, device_mesh,
            partial(_shard_params, placements={"weight": Shard(1), "bias": Shard(0)}, src=self.src_data_rank),
            partial(_input_to_dtensor, Replicate()),
            partial(_output_to_local, None))


class Conv1DRowwiseParallel(ParallelStyle):
    """Row (input-feature) split of a transformers ``Conv1D``: weight (in, out) Shard(0), bias Replicate.

    Input: a local tensor sharded on its last dim (a col-parallel output). Output: the partial
    sums all-reduced to a replicated local tensor (Megatron's g); the bias is added once.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_conv1d(module, type(self).__name__)
        return distribute_module(
            module, device_mesh,
            partial(_shard_params, placements={"weight": Shard(0), "bias": Replicate()}, src=self.src_data_rank),
            partial(_input_to_dtensor, Shard(-1)),
            partial(_output_to_local, Replicate()))


def _check_conv1d(module: nn.Module, style: str) -> None:
    weight = getattr(module, "weight", None)
    if not (_is_conv1d(module) and weight is not None and tuple(weight.shape) == (module.nx, module.nf)):
        raise AutoshardError(f"{style} needs a transformers Conv1D (weight (in, out)), got {type(module).__name__}; "
                             f"use colwise / rowwise for nn.Linear")


def _is_conv1d(module: nn.Module) -> bool:
    """transformers.pytorch_utils.Conv1D, recognised without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _shard_params(name: str, module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement],
                  src: int | None) -> None:
    """Replace ``module``'s own weight / bias with DTensors placed as ``placements`` says."""
    for pname, placement in placements.items():
        param = getattr(module, pname, None)
        if param is None:
            continue
        dist_param = distribute_tensor(param, mesh, [placement], src_data_rank=src)
        module.register_parameter(pname, nn.Parameter(dist_param, requires_grad=param.requires_grad))


def _input_to_dtensor(layout: Placement, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> DTensor:
    """Forward pre-hook: the local input, annotated with the layout it already has."""
    x = inputs[0]
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (layout,), run_check=False)


def _output_to_local(layout: Placement | None, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    """Forward hook: redistribute to ``layout`` if given (Partial -> Replicate is the all-reduce); a local tensor."""
    if layout is not None and output.placements != (layout,):
        output = output.redistribute(placements=(layout,))
    return output.to_local()


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, styles: dict[str, str]) -> nn.Module:
    """Shard the modules named in ``styles`` over ``tp_mesh`` (in place; returns the model)."""
    plan = {path: parallel_style(style) for path, style in styles.items() if style != "replicate"}
    for path in plan:
        _check_module(model, path, styles[path])
    if plan:
        parallelize_module(model, tp_mesh, plan)
    return model


def _check_module(model: nn.Module, path: str, style: str) -> None:
    try:
        module = model.get_submodule(path)
    except AttributeError as exc:
        raise AutoshardError(f"tensor parallel: the model has no module {path!r}; re-plan this model") from exc
    if style.startswith("conv1d-"):
        if not _is_conv1d(module):
            raise AutoshardError(f"tensor parallel: {path} is a {type(module).__name__}, not a transformers Conv1D; "
                                 f"{style} does not fit it; re-plan this model")
    elif tp_style(style).shards_weight and not isinstance(module, (nn.Linear, nn.Embedding)):
        raise AutoshardError(f"tensor parallel: {path} is a {type(module).__name__}, not nn.Linear / nn.Embedding; "
                             f"keep it replicated")


# The constructors ``ir.decisions.TP_STYLES`` names: torch's, and the two written here.
_CONSTRUCTORS = {"ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel,
                 "SequenceParallel": SequenceParallel, "Conv1DColwiseParallel": Conv1DColwiseParallel,
                 "Conv1DRowwiseParallel": Conv1DRowwiseParallel}
