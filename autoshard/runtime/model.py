"""Build the model the plan was made for, and check that it is that model."""

from __future__ import annotations

import torch
import torch.nn as nn

from autoshard.errors import AutoshardError
from autoshard.modelfile import ModelFile, model_fingerprint
from autoshard.modelfile import load_model_file as _load

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def load_model_file(spec: str, expected_hash: str | None = None) -> ModelFile:
    """Load ``file.py:factory``; with ``expected_hash``, refuse a model the plan was not made for."""
    model_file = _load(spec)
    if expected_hash is not None:
        actual = model_fingerprint(model_file.build("meta"))
        if actual != expected_hash:
            raise AutoshardError(f"{spec} is not the model this plan was made for (fingerprint {actual}, plan "
                                 f"{expected_hash}); re-plan it with `autoshard plan {spec} ...`")
    return model_file


def build_model(model_file: ModelFile, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """Build with the same seed on every rank (and in the reference), so weights start equal."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_file.build("cpu")
    return model.to(device)


def strip_wrapper_names(name: str) -> str:
    """A parameter's name in the user's model, without DDP / checkpoint-wrapper parts."""
    for prefix in WRAPPER_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def get_block(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError as exc:
        raise AutoshardError(f"the model has no module '{path}' named in the plan; re-plan this model") from exc
