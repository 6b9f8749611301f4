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

Sequence parallelism (``ir.decisions.TP_STYLES``' second table; Megatron-LM's, as torchtitan applies
it): between the parallel linears the activations are each rank's slice of the tokens, a local
tensor. ``colwise-seq-input-dim{d}`` (ColwiseParallel(input_layouts=Shard(d))) all-gathers them in
its input hook and reduce-scatters the input gradient; ``rowwise-seq-output-dim{d}``
(RowwiseParallel(output_layouts=Shard(d))) reduce-scatters its partial sums and all-gathers the
output gradient; the norms in between take ``sharded-input-dim{d}`` (SequenceParallel), whose
replicated weights get their per-rank partial gradients summed. A replicated module reading or
writing a sequence shard takes torch's PrepareModuleInput / PrepareModuleOutput
(``gather-seq-input-dim{d}``, ``scatter-seq-output-dim{d}``); a module whose column-parallel
linears share its input (attention, an MLP) takes ``GatherSequenceInput`` (one all-gather into a
Replicate DTensor that its code reads whole, one reduce-scatter of the summed input gradients); a
block whose input comes replicated from outside the blocks takes ``ScatterSequenceInput`` (its first
positional input sliced, its gradient all-gathered back). The two Conv1D styles take the same
``input_layouts`` / ``output_layouts`` keywords.

float8 (tensorwise, ``float8=True``; torchtitan's ``apply_tp(enable_float8_tensorwise_tp=True)``): a linear
torchao made ``Float8Linear`` takes torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` in place of
ColwiseParallel / RowwiseParallel, with the same keywords: the input is cast to float8 before its layout changes,
so a sequence-parallel all-gather moves float8 bytes, and the output gradient is cast before its all-gather. A
module whose column-parallel linears are all float8 gathers its input in float8 once (``GatherSequenceInput``
with ``float8``, as torchao's ``PrepareFloat8ModuleInput`` does). rowwise recipes keep the plain styles
(torchtitan's choice: torchao's float8 TP styles assume tensorwise scales).
"""

from __future__ import annotations

import ast
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Placement

from autoshard.errors import AutoshardError
from autoshard.ir.decisions import REPLICATE, tp_style


def parallel_style(style: str, float8: bool = False) -> ParallelStyle | None:
    """The DTensor ParallelStyle of a planner style name (its row in ``ir.decisions.TP_STYLES``, built);
    None for "replicate". ``float8``: torchao's float8 twin of the constructor where it has one (module doc)."""
    if style == REPLICATE:
        return None
    row = tp_style(style)
    arguments = {key: _argument(source) for key, source in row.arguments}
    if float8 and row.constructor == "GatherSequenceInput":
        return GatherSequenceInput(**arguments, float8=True)
    name = FLOAT8_CONSTRUCTORS.get(row.constructor, row.constructor) if float8 else row.constructor
    return _float8_constructor(name)(**arguments) if name.startswith("Float8") else _CONSTRUCTORS[name](**arguments)


# torchao's float8 TP styles (``torchao.float8.float8_tensor_parallel``) by the constructor they replace
FLOAT8_CONSTRUCTORS = {"ColwiseParallel": "Float8ColwiseParallel", "RowwiseParallel": "Float8RowwiseParallel"}


def _float8_constructor(name: str):
    from torchao.float8 import float8_tensor_parallel

    return getattr(float8_tensor_parallel, name)


def _argument(source: str):
    """A style argument's value from its source text: ``Replicate()``, ``Shard(d)``, or a Python literal."""
    if source == "Replicate()":
        return Replicate()
    if source.startswith("Shard(") and source.endswith(")"):
        return Shard(int(source[len("Shard(") : -1]))
    return ast.literal_eval(source)


class Conv1DColwiseParallel(ParallelStyle):
    """Column (output-feature) split of a transformers ``Conv1D``: weight (in, out) Shard(1), bias Shard(0).

    Input: a replicated local tensor (made a Replicate DTensor; its gradient is all-reduced in
    backward, Megatron's f), or with ``input_layouts=Shard(d)`` this rank's slice of the tokens,
    all-gathered (its gradient reduce-scattered in backward). Output: this rank's slice of the last dim,
    as a local tensor.
    """

    def __init__(self, *, input_layouts: Placement | None = None):
        super().__init__()
        self.input_layouts = input_layouts or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_conv1d(module, type(self).__name__)
        return distribute_module(
            module,
            device_mesh,
            partial(_shard_params, placements={"weight": Shard(1), "bias": Shard(0)}, src=self.src_data_rank),
            partial(_input_to_dtensor, self.input_layouts, Replicate()),
            partial(_output_to_local, None),
        )


class Conv1DRowwiseParallel(ParallelStyle):
    """Row (input-feature) split of a transformers ``Conv1D``: weight (in, out) Shard(0), bias Replicate.

    Input: a local tensor sharded on its last dim (a col-parallel output). Output: the partial
    sums all-reduced to a replicated local tensor (Megatron's g), or with ``output_layouts=Shard(d)``
    reduce-scattered to this rank's slice of the tokens; the bias is added once.
    """

    def __init__(self, *, output_layouts: Placement | None = None):
        super().__init__()
        self.output_layouts = output_layouts or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_conv1d(module, type(self).__name__)
        return distribute_module(
            module,
            device_mesh,
            partial(_shard_params, placements={"weight": Shard(0), "bias": Replicate()}, src=self.src_data_rank),
            partial(_input_to_dtensor, Shard(-1), None),
            partial(_output_to_local, self.output_layouts),
        )


class ScatterSequenceInput(ParallelStyle):
    """A module (a block) whose first positional input arrives replicated, every rank the whole sequence, and
    is to run on this rank's slice of it along ``sequence_dim``: the forward slices it (no communication),
    the backward all-gathers its gradient (DTensor's Shard → Replicate), so the replicated code before the
    block gets the whole gradient on every rank. Other arguments (masks, position embeddings) pass
    unchanged. torch's PrepareModuleInput would need one layout per positional argument."""

    def __init__(self, *, sequence_dim: int = 1):
        super().__init__()
        self.sequence_dim = sequence_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(partial(_scatter_first_input, self.sequence_dim, device_mesh))
        return module


class GatherSequenceInput(ParallelStyle):
    """A module holding column-parallel linears (attention, an MLP) whose input arrives as this rank's slice of
    the tokens along ``sequence_dim``: its first tensor argument (positional, else the first tensor keyword:
    HF attention takes ``hidden_states=``) is all-gathered once into a Replicate DTensor. The module's code then
    reads its whole shape, and the ColwiseParallel linears inside take the DTensor as it is, so their input
    gradients, partial on each rank, add up as DTensors and are reduce-scattered once (the gather's
    backward) instead of all-reduced per linear (torchtitan's PrepareModuleInput on attention). The planner
    gives such a module's input no other reader than those linears: nothing else meets the DTensor."""

    def __init__(self, *, sequence_dim: int = 1, float8: bool = False):
        super().__init__()
        self.sequence_dim, self.float8 = sequence_dim, float8

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        cast = _float8_input_cast(module) if self.float8 else None
        hook = partial(_gather_first_input, self.sequence_dim, device_mesh, cast)
        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _float8_input_cast(module: nn.Module):
    """The cast of torchao's ``PrepareFloat8ModuleInput``: the input scaled to float8 (e4m3, one scale for the
    tensor, the amax all-reduced over the shards by DTensor) with the module's Float8Linear matmul settings."""
    from torchao.float8.config import e4m3_dtype
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    config = next(m.linear_mm_config for m in module.modules() if isinstance(m, Float8Linear))
    return partial(
        hp_tensor_to_float8_dynamic,
        float8_dtype=e4m3_dtype,
        linear_mm_config=config,
        gemm_input_role=GemmInputRole.INPUT,
    )


def _gather_first_input(dim: int, mesh: DeviceMesh, cast, module: nn.Module, args: tuple, kwargs: dict):
    def gather(x: torch.Tensor) -> DTensor:
        shard = DTensor.from_local(x, mesh, (Shard(dim),), run_check=False)
        return (cast(shard) if cast is not None else shard).redistribute(mesh, (Replicate(),))

    if args and isinstance(args[0], torch.Tensor):
        return (gather(args[0]), *args[1:]), kwargs
    key = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
    if key is None:
        raise AutoshardError(
            f"tensor parallel: GatherSequenceInput on {type(module).__name__} found no tensor "
            f"argument to gather; re-plan this model"
        )
    return args, {**kwargs, key: gather(kwargs[key])}


def _scatter_first_input(dim: int, mesh: DeviceMesh, module: nn.Module, args: tuple):
    if not args or not isinstance(args[0], torch.Tensor) or isinstance(args[0], DTensor):
        raise AutoshardError(
            f"tensor parallel: ScatterSequenceInput on {type(_unwrapped(module)).__name__} needs the sequence "
            f"as a plain tensor in its first positional argument; re-plan this model"
        )
    whole = DTensor.from_local(args[0], mesh, (Replicate(),), run_check=False)
    return (whole.redistribute(mesh, (Shard(dim),)).to_local(), *args[1:])


def _unwrapped(module: nn.Module) -> nn.Module:
    """The block a recompute wrapper holds (its input hooks run on the wrapper: ``parallel._hoist_input_hooks``)."""
    return getattr(module, "_checkpoint_wrapped_module", module)


def _check_conv1d(module: nn.Module, style: str) -> None:
    weight = getattr(module, "weight", None)
    if not (_is_conv1d(module) and weight is not None and tuple(weight.shape) == (module.nx, module.nf)):
        raise AutoshardError(
            f"{style} needs a transformers Conv1D (weight (in, out)), got {type(module).__name__}; "
            f"use colwise / rowwise for nn.Linear"
        )


def _is_conv1d(module: nn.Module) -> bool:
    """transformers.pytorch_utils.Conv1D, recognised without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _shard_params(
    name: str, module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src: int | None
) -> None:
    """Replace ``module``'s own weight / bias with DTensors placed as ``placements`` says."""
    for pname, placement in placements.items():
        param = getattr(module, pname, None)
        if param is None:
            continue
        dist_param = distribute_tensor(param, mesh, [placement], src_data_rank=src)
        module.register_parameter(pname, nn.Parameter(dist_param, requires_grad=param.requires_grad))


def _input_to_dtensor(
    layout: Placement, desired: Placement | None, module: nn.Module, inputs: tuple, mesh: DeviceMesh
) -> DTensor:
    """Forward pre-hook: the local input, annotated with the layout it already has, then redistributed to
    ``desired`` if given (Shard(d) -> Replicate() is the sequence all-gather)."""
    x = inputs[0]
    x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (layout,), run_check=False)
    return x if desired is None or x.placements == (desired,) else x.redistribute(placements=(desired,))


def _output_to_local(layout: Placement | None, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    """Forward hook: redistribute to ``layout`` if given (Partial -> Replicate is the all-reduce); a local tensor."""
    if layout is not None and output.placements != (layout,):
        output = output.redistribute(placements=(layout,))
    return output.to_local()


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, styles: dict[str, str], float8: bool = False
) -> nn.Module:
    """Shard the modules named in ``styles`` over ``tp_mesh`` (in place; returns the model). ``float8``: torchao's
    float8 styles for the Float8Linear modules, and a float8 gather into modules whose column-parallel linears are
    all Float8Linear (module doc)."""
    in_float8 = float8_styled(model, styles) if float8 else frozenset()
    plan = {path: parallel_style(style, path in in_float8) for path, style in styles.items() if style != "replicate"}
    for path in plan:
        _check_module(model, path, styles[path])
    if plan:
        parallelize_module(model, tp_mesh, plan)
    return model


def float8_styled(model: nn.Module, styles: dict[str, str]) -> frozenset[str]:
    """The paths that take a float8 style: Float8Linear modules under a column or row split, and each module
    gathering its input for column-parallel linears (``GatherSequenceInput``) when those are all Float8Linear."""
    from torchao.float8.float8_linear import Float8Linear

    def float8_linear(path: str) -> bool:
        return isinstance(model.get_submodule(path), Float8Linear)

    split = {p for p, s in styles.items() if s != REPLICATE and tp_style(s).constructor in FLOAT8_CONSTRUCTORS}
    linears = {p for p in split if float8_linear(p)}
    gathers = set()
    for path, style in styles.items():
        if style == REPLICATE or tp_style(style).constructor != "GatherSequenceInput":
            continue
        readers = [
            p for p in split if p.startswith(path + ".") and tp_style(styles[p]).constructor == "ColwiseParallel"
        ]
        if readers and all(p in linears for p in readers):
            gathers.add(path)
    return frozenset(linears | gathers)


def _check_module(model: nn.Module, path: str, style: str) -> None:
    try:
        module = model.get_submodule(path)
    except AttributeError as exc:
        raise AutoshardError(f"tensor parallel: the model has no module {path!r}; re-plan this model") from exc
    if style.startswith("conv1d-"):
        if not _is_conv1d(module):
            raise AutoshardError(
                f"tensor parallel: {path} is a {type(module).__name__}, not a transformers Conv1D; "
                f"{style} does not fit it; re-plan this model"
            )
    elif tp_style(style).shards_weight and not isinstance(module, (nn.Linear, nn.Embedding)):
        raise AutoshardError(
            f"tensor parallel: {path} is a {type(module).__name__}, not nn.Linear / nn.Embedding; keep it replicated"
        )


# The constructors ``ir.decisions.TP_STYLES`` names: torch's, and the four written here.
_CONSTRUCTORS = {
    "ColwiseParallel": ColwiseParallel,
    "RowwiseParallel": RowwiseParallel,
    "SequenceParallel": SequenceParallel,
    "PrepareModuleInput": PrepareModuleInput,
    "PrepareModuleOutput": PrepareModuleOutput,
    "Conv1DColwiseParallel": Conv1DColwiseParallel,
    "Conv1DRowwiseParallel": Conv1DRowwiseParallel,
    "ScatterSequenceInput": ScatterSequenceInput,
    "GatherSequenceInput": GatherSequenceInput,
}
