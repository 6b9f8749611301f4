"""float8 training with torchao (``--float8``): the plan's linears made ``Float8Linear`` before anything wraps
them, and, where FSDP2 gathers their weights in float8, those weights' scales computed after each optimizer step.

torchao's API (torchao 0.18, ``torchao.float8``)::

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(float8), module_filter_fn=...)
    Float8LinearConfig.enable_fsdp_float8_all_gather   FSDP2 gathers the weights' float8 bytes (tensorwise only)
    precompute_float8_dynamic_scale_for_fsdp(model)    after optimizer.step(): every weight's amax in one
                                                       all-reduce, for the next step's float8 all-gather

Pipeline stages (``apply_float8`` on ``PipelineStages``): the split traces the model with ``torch.export``, which does
not trace torchao's float8 tensor subclass, so the stages are cut from the bf16 model and converted afterwards.
Each stage is unflattened: a linear of the model is a child module whose graph holds its one ``aten.linear`` on
``get_attr`` weight (and bias), with TP's traceable collectives around it (``tensor_parallel_stages``). That node
becomes a call of a state-less ``Float8Matmul`` child, which runs torchao's ``matmul_with_hp_or_float8_args``
as ``Float8Linear.forward`` does: parameters and their names stay where the split left them. Beside TP the stage's
linears hold plain local shards, so each rank scales its own shard of the input, the weight and the output gradient
(tensorwise: one scale per shard; rowwise: per row of the shard), where one process, and DTensor's SPMD layout through
torchao's float8 TP styles, take one scale over the whole tensor: the same layout, a float8 rounding that differs
within float8's own. ``verify`` checks the layout through the twin with float8 off; a GPU run checks the numerics.

A float8 matmul (``torch._scaled_mm``) needs a CUDA device of compute capability 8.9 or later (H100, L40S, ...):
elsewhere the conversion is refused in one line. ``autoshard verify`` checks a float8 plan's layout on CPU ranks
through its twin with float8 off (``verify``), so this module runs on GPUs only.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx
from torch import nn

from autoshard.errors import AutoshardError

FLOAT8_MIN_CAPABILITY = (8, 9)  # torch._scaled_mm: Ada (SM 8.9) and Hopper (SM 9.0) and later


def float8_refusal(device: torch.device | None = None) -> str:
    """Why float8 matmuls cannot run here, or "" where they can: a CUDA device of capability >= 8.9."""
    if not torch.cuda.is_available():
        return f"this torch build ({torch.__version__}) has no CUDA device, and float8 matmuls need one"
    index = device.index if device is not None and device.type == "cuda" else None
    capability = torch.cuda.get_device_capability(index)
    if capability < FLOAT8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(index)
        return f"{name} (compute capability {capability[0]}.{capability[1]}) has no float8 matmuls (needs 8.9+)"
    return ""


def apply_float8(
    model: nn.Module,
    float8: str,
    linears: tuple[str, ...] | list[str],
    fsdp_float8_all_gather: bool = False,
    emulate: bool = False,
) -> nn.Module:
    """The linears named in ``linears`` replaced by torchao's ``Float8Linear`` with the scaling of recipe ``float8``
    (in place, on the meta device as well, as torchtitan converts: each module keeps its weight tensor).
    ``emulate``: torchao's emulated float8 matmul (any device; for checks on CPUs, never a plan's program)."""
    why = "" if emulate else float8_refusal()
    if why:
        raise AutoshardError(f"--float8 {float8}: {why}; plan with --float8 off, or run on an H100-class GPU")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(float8)
    config = dataclasses.replace(config, enable_fsdp_float8_all_gather=fsdp_float8_all_gather, emulate=emulate)
    if _is_stages(model):
        for module in model.modules:
            convert_stage_linears(module, config, linears)
        return model
    names = frozenset(linears)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn in names)
    return model


def _is_stages(model) -> bool:
    """``model`` is a pipeline's ``PipelineStages`` (module doc); the module is imported by the split only."""
    import sys

    module = sys.modules.get("autoshard.runtime.pipeline_parallel")
    return module is not None and isinstance(model, module.PipelineStages)


class Float8Matmul(nn.Module):
    """y = x·Wᵀ + b in float8, as torchao's ``Float8Linear.forward`` computes it, with W and b passed in (module
    doc): no state, so a stage's parameters keep their names."""

    def __init__(self, config):
        super().__init__()
        from torchao.float8.float8_linear import Float8Linear

        with torch.device("meta"):
            probe = Float8Linear(16, 16, bias=False, config=config)
        self.config, self.linear_mm_config = probe.config, probe.linear_mm_config

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        if torch.is_autocast_enabled():
            x = x.to(torch.get_autocast_gpu_dtype())
        y = matmul_with_hp_or_float8_args.apply(x, weight.t(), self.linear_mm_config, self.config)
        return y + bias.to(y.dtype) if bias is not None else y


FLOAT8_MATMUL = "float8_matmul"  # the Float8Matmul child of each converted linear of a stage


def convert_stage_linears(stage: nn.Module, config, linears: tuple[str, ...] | list[str]) -> nn.Module:
    """Each of ``linears`` this stage holds: its ``aten.linear`` node made a call of a ``Float8Matmul`` child
    (module doc), in place. A linear another stage holds is skipped; one whose graph is not a single
    ``aten.linear`` on its own weight is refused in one line."""
    for path in linears:
        try:
            owner = stage.get_submodule(path)
        except AttributeError:
            continue  # another stage's
        _convert_linear_node(owner, path, config)
    return stage


def _convert_linear_node(owner: nn.Module, path: str, config) -> None:
    graph = getattr(owner, "graph", None)
    nodes = [n for n in graph.nodes if n.target is torch.ops.aten.linear.default] if graph is not None else []
    weight = nodes[0].args[1] if len(nodes) == 1 else None
    if weight is None or weight.op != "get_attr" or weight.target != "weight":
        raise AutoshardError(
            f"--float8: stage module {path} is not one linear on its own weight after the split; plan --float8 off"
        )
    owner.add_module(FLOAT8_MATMUL, Float8Matmul(config))
    graph.owning_module = owner  # the split leaves the traced GraphModule as the owner of each copied graph
    node = nodes[0]
    with graph.inserting_before(node):
        call = graph.create_node("call_module", FLOAT8_MATMUL, tuple(node.args))
    node.replace_all_uses_with(call)
    graph.erase_node(node)
    graph.lint()
    if isinstance(owner, torch.fx.GraphModule):
        owner.recompile()
    else:
        owner.finalize()


def compute_float8_scales_after_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    """``precompute_float8_dynamic_scale_for_fsdp(model)`` after every ``optimizer.step()`` (torchao's recipe
    for the float8 all-gather: the scales of the updated weights, all at once, before the next forward)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
    return optimizer
