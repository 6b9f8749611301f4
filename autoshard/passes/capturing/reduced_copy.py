"""A reduced copy of a model too large to run whole for the batch-coupling check (``batch_coupling``).

Whether the loss of a batch is the mean of its shares' losses depends on how the model and its loss treat the
batch dimension, not on how deep or long the model is. So a model over the whole check's bounds is checked on a
copy with:

- **fewer layers**: every repeated stack (an ``nn.ModuleList`` / ``nn.Sequential`` ending in ≥ ``fold.MIN_LAYERS``
  layers of one structure, ``fold.stacks``; a two-tower model has two) cut to its distinct first layers and
  ``fold.KEPT`` of the identical ones, as the capture's fold cuts the one stack it folds. The cut layers'
  structure is that of the kept ones (``fold.fingerprint``), so a coupling inside a layer is in the copy too;
- **fewer tokens**, where ``example_batch`` takes ``seq_len``: ``REDUCED_SEQ_LEN`` (tried again at the file's own
  length if the model refuses the shorter one).

The copy is built on the meta device with the factory's initialisation recorded (``runtime.init_replay``), cut,
and only its kept tensors made on the CPU by replaying the record: the kept layers hold exactly the weights one
process would give them, and host memory is about the copy's weights, not the model's. What the replay costs is
drawing every random number of the whole model's initialisation (the generator cannot skip ahead): bounded by
``MAX_REPLAY_NUMEL``.

The copy's work is estimated from the whole check's (``batch_coupling.check_work``), each term scaled by what the
copy keeps, for transformer-like models whose FLOPs go with their weights times their tokens:

    FLOPs         F · (W_copy / W) · (s_copy / s)
    largest value V · (s_copy / s)

and held to the whole check's bounds, as are its weights W_copy. A model the copy cannot bring within them (a
vocabulary projection that alone is over ``MAX_CHECK_BYTES``), a factory whose initialisation cannot be
replayed, or a copy that does not run is not checked (None), and the plan says so.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import torch
import torch.nn as nn

from autoshard.modelfile import ModelFile
from autoshard.passes.capturing.fold import KEPT, stacks

REDUCED_SEQ_LEN = 16  # tokens per sample of the copy, where the model file takes --seq-len
MAX_REPLAY_NUMEL = 2**30  # elements of the whole model's initialisation replayed to make the copy (~5 s on 2 cores)


def cut_stacks(model: nn.Module) -> list[tuple[str, int, int]]:
    """Cut every repeated stack of ``model`` (in place) to its distinct first layers and KEPT identical ones;
    (path, layers kept, layers before) of each."""
    cut = []
    for path, first in stacks(model):
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        stack = getattr(parent, name)
        parent.register_module(name, stack[: first + KEPT])  # ModuleList / Sequential slices keep their class
        cut.append((path, first + KEPT, len(stack)))
    return cut


def numel(model: nn.Module) -> int:
    """Elements of the model's parameters and buffers, each tensor once."""
    return sum(t.numel() for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


def shorter(model_file: ModelFile, tokens: int) -> ModelFile | None:
    """``model_file`` drawing batches of ``REDUCED_SEQ_LEN`` tokens, or None where that is no reduction or the
    file's ``example_batch`` takes no ``seq_len``."""
    if tokens <= REDUCED_SEQ_LEN:
        return None
    try:
        takes = "seq_len" in inspect.signature(model_file.module.example_batch).parameters
    except (TypeError, ValueError, AttributeError):
        return None
    return replace(model_file, seq_len=REDUCED_SEQ_LEN) if takes else None


def reduced_copy(model_file: ModelFile, seed: int = 0) -> tuple[nn.Module, list[tuple[str, int, int]], int] | None:
    """The model built on meta and cut (``cut_stacks``), its kept tensors made on the CPU by replaying the
    factory's initialisation at ``seed``; what was cut; the whole model's elements. None where there is no
    stack to cut or the initialisation cannot be replayed (module doc)."""
    from autoshard.errors import AutoshardError
    from autoshard.runtime import init_replay

    try:
        model, record = init_replay.record_build(lambda: model_file.build(None))
    except AutoshardError:  # NotReplayable: the factory seeds or draws itself
        return None
    whole = numel(model)
    cut = cut_stacks(model)
    if not cut:
        return None
    init_replay.attach(model, record, seed)
    init_replay.to_empty(model, torch.device("cpu"))
    init_replay.materialize(model, [model], model.state_dict(), lambda: None, lambda name: name)
    return model, cut, whole


def describe(cut: list[tuple[str, int, int]], tokens: int | None) -> str:
    """What the copy keeps, for the plan's note."""
    layers = ", ".join(f"{kept} of {total} ({path})" for path, kept, total in cut)
    return f"layers: {layers}" + (f"; {tokens} tokens" if tokens else "")
