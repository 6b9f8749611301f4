"""A reduced copy of a model too large to run whole for the batch-coupling check (``batch_coupling``).

Whether the loss of a batch is the mean of its shares' losses depends on how the model and its loss treat the
batch dimension, not on how deep or long the model is. So a model over the whole check's bounds is checked on a
copy with:

- **fewer layers**: every repeated stack (an ``nn.ModuleList`` / ``nn.Sequential`` ending in ≥ ``fold.MIN_LAYERS``
  layers of one structure, ``fold.stacks``; a two-tower model has two) cut to its distinct first layers and
  ``fold.KEPT`` of the identical ones, as the capture's fold cuts the one stack it folds. The cut layers'
  structure is that of the kept ones (``fold.fingerprint``), and so must be their plain settings (``settings``:
  every bool, int, float and str attribute of their modules, a layer's own index aside): a flag that makes some
  layers route tokens over the whole batch would otherwise be cut away with them. A stack whose layers' settings
  differ is not cut, and without any cut there is no copy.

The tokens are the model's own: a loss averaged over a count the data decide (padding to the length, an ignore
index) can be even at a short length and uneven at the real one, so no shorter batch is tried.

The copy is built on the meta device with the factory's initialisation recorded (``runtime.init_replay``), cut,
and only its kept tensors made on the CPU by replaying the record: the kept layers hold exactly the weights one
process would give them, and host memory is about the copy's weights, not the model's. What the replay costs is
drawing every random number of the whole model's initialisation (the generator cannot skip ahead): bounded by
``MAX_REPLAY_NUMEL``.

The copy's work is estimated from the whole check's (``batch_coupling.check_work``), each term scaled by what the
copy keeps, for transformer-like models whose FLOPs go with their weights times their tokens:

    FLOPs         F · W_copy / W
    largest value V

and held to the whole check's bounds, as are its weights W_copy. A model the copy cannot bring within them (a
vocabulary projection that alone is over ``MAX_CHECK_BYTES``), a factory whose initialisation cannot be
replayed, or a copy that does not run is not checked (None), and the plan says so.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from autoshard.modelfile import ModelFile
from autoshard.passes.capturing.fold import KEPT, stacks

MAX_REPLAY_NUMEL = 2**30  # elements of the whole model's initialisation replayed to make the copy (~5 s on 2 cores)


def cut_stacks(model: nn.Module) -> list[tuple[str, int, int]]:
    """Cut every repeated stack of ``model`` whose identical layers also share their ``settings`` (in place) to its
    distinct first layers and KEPT identical ones; (path, layers kept, layers before) of each."""
    cut = []
    for path, first in stacks(model):
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        stack = getattr(parent, name)
        if len({settings(layer, i) for i, layer in enumerate(stack) if i >= first} - {None}) != 1:
            continue
        parent.register_module(name, stack[: first + KEPT])  # ModuleList / Sequential slices keep their class
        cut.append((path, first + KEPT, len(stack)))
    return cut


def settings(layer: nn.Module, index: int) -> str:
    """Every bool, int, float and str attribute of ``layer``'s modules by path, those equal to the layer's ``index``
    (``layer_idx``) aside, as one string: what makes layers of one structure run differently."""
    plain = []
    for path, module in layer.named_modules():
        for key, value in sorted(vars(module).items()):
            if (
                key != "training"
                and type(value) in (bool, int, float, str)
                and not (type(value) is int and value == index)
            ):
                plain.append(f"{path}.{key}={value!r}")
    return "\n".join(plain)


def numel(model: nn.Module) -> int:
    """Elements of the model's parameters and buffers, each tensor once."""
    return sum(t.numel() for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


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


def describe(cut: list[tuple[str, int, int]]) -> str:
    """What the copy keeps, for the plan's note."""
    return "layers: " + ", ".join(f"{kept} of {total} ({path})" for path, kept, total in cut)
