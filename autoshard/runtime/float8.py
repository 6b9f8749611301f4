"""float8 training with torchao (``--float8``): the plan's linears made ``Float8Linear`` before anything wraps
them, and, where FSDP2 gathers their weights in float8, those weights' scales computed after each optimizer step.

torchao's API (torchao 0.18, ``torchao.float8``)::

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(float8), module_filter_fn=...)
    Float8LinearConfig.enable_fsdp_float8_all_gather   FSDP2 gathers the weights' float8 bytes (tensorwise only)
    precompute_float8_dynamic_scale_for_fsdp(model)    after optimizer.step(): every weight's amax in one
                                                       all-reduce, for the next step's float8 all-gather

A float8 matmul (``torch._scaled_mm``) needs a CUDA device of compute capability 8.9 or later (H100, L40S, ...):
elsewhere the conversion is refused in one line. ``autoshard verify`` checks a float8 plan's layout on CPU ranks
through its twin with float8 off (``verify``), so this module runs on GPUs only.
"""

from __future__ import annotations

import dataclasses

import torch
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
    names = frozenset(linears)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn in names)
    return model


def compute_float8_scales_after_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    """``precompute_float8_dynamic_scale_for_fsdp(model)`` after every ``optimizer.step()`` (torchao's recipe
    for the float8 all-gather: the scales of the updated weights, all at once, before the next forward)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
    return optimizer
