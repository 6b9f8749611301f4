"""A reduced copy of a model too large to run whole for the batch-coupling check (``batch_coupling``).

Whether the loss of a batch is the mean of its shares' losses depends on how the model and its loss treat the
batch dimension, not on how deep or long the model is. So a model over the whole check's bounds is checked on a
copy with:

- **fewer layers**: every repeated stack (an ``nn.ModuleList`` / ``nn.Sequential`` ending in ≥ ``fold.MIN_LAYERS``
  layers of one structure, ``fold.stacks``; a two-tower model has two) cut to its distinct first layers and
  ``fold.KEPT`` of the identical ones, as the capture's fold cuts the one stack it folds. The cut layers'
  structure is that of the kept ones (``fold.fingerprint``), and so must be their plain settings (``settings``:
  every bool, int, float, str, None and enum attribute of their modules, and tuples, lists and dicts of them; a
  key holding each layer's own index in every layer aside, ``same_settings``): a stack whose layers' settings
  differ is not cut, and without any cut there is no copy.

Settings cannot show everything that makes a layer run differently (an object's attribute, a branch in the parent
on the layer's index), so a copy that finds no coupling is trusted only where the captured graphs prove it runs
the whole model's ops but for the cut layers (``runs_like_the_whole``): the copy's graph with every cut stack
copied back (``fold.unfold``) must be the whole model's, op for op. Else the model is not checked (None): a flag
that makes some layers (or the glue after them) mix the batch would otherwise be cut away with them.

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

from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from autoshard.ir.graph import OpGraph
from autoshard.modelfile import ModelFile
from autoshard.passes.capturing.fold import KEPT, Fold, layers_match, stacks, unfold

MAX_REPLAY_NUMEL = 2**30  # elements of the whole model's initialisation replayed to make the copy (~5 s on 2 cores)


def cut_stacks(model: nn.Module) -> list[tuple[str, int, int]]:
    """Cut every repeated stack of ``model`` whose identical layers also share their ``settings`` (in place) to its
    distinct first layers and KEPT identical ones; (path, layers kept, layers before) of each."""
    cut = []
    for path, first in stacks(model):
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        stack = getattr(parent, name)
        if not same_settings([settings(layer) for layer in list(stack)[first:]], first):
            continue
        parent.register_module(name, stack[: first + KEPT])  # ModuleList / Sequential slices keep their class
        cut.append((path, first + KEPT, len(stack)))
    return cut


def settings(layer: nn.Module) -> dict[str, object]:
    """Every plain attribute of ``layer``'s modules by path (``_plain``: bool, int, float, str, None, an enum, and
    tuples, lists and dicts of them): what makes layers of one structure run differently."""
    found = {}
    for path, module in layer.named_modules():
        for key, value in sorted(vars(module).items()):
            if key != "training" and _plain(value):
                found[f"{path}.{key}"] = value
    return found


def same_settings(layers: list[dict[str, object]], first: int) -> bool:
    """Whether the layers first, first + 1, … of a stack have one ``settings``, a key aside whose value is the
    layer's own index in every one of them (``layer_idx``); a key equal to the index in one layer only (8 key /
    value heads in layer 8) is compared as any other."""
    index_keys = {
        key
        for key in layers[0]
        if all(type(s.get(key)) is int and s.get(key) == first + i for i, s in enumerate(layers))
    }
    return len({repr(sorted((k, v) for k, v in s.items() if k not in index_keys)) for s in layers}) == 1


def _plain(value: object) -> bool:
    """Whether ``value`` is one whose ``repr`` is the same for equal values in every process (no object address)."""
    import enum

    if value is None or type(value) in (bool, int, float, str) or isinstance(value, enum.Enum):
        return True
    if type(value) in (tuple, list):
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def runs_like_the_whole(
    model_file: ModelFile, graph: OpGraph, copy_graph: OpGraph, cut: list[tuple[str, int, int]]
) -> bool:
    """Whether the captured graphs prove the copy runs the whole model's ops but for the cut layers: the copy's graph
    with each cut stack copied back (``fold.unfold``: layer k, and the glue before it, copies of the last kept layer
    and its glue) is op for op the whole model's (``_ops``: targets, modules, shapes, dtypes, arguments, wiring,
    parameters). A layer or glue that differs (a setting the settings do not show, a branch in the parent on the
    layer's index) fails it. The whole model's graph is ``graph`` when not folded, else captured again unfolded."""
    from autoshard.errors import AutoshardError
    from autoshard.passes.capturing.capture import build_on_meta, capture_module

    if graph.fold is not None:
        inputs = tuple(t.to("meta") for t in model_file.example_batch(graph.batch_size)[0])
        try:
            graph = capture_module(build_on_meta(model_file), inputs, where=model_file.spec)
        except AutoshardError:
            return False
    predicted = copy_graph
    for path, kept, layers in cut:
        fold = Fold(path, layers, kept - KEPT)
        predicted = replace(predicted, fold=fold, blocks=[])
        if not layers_match(predicted, fold):
            return False
        predicted = unfold(predicted)
    return _ops(predicted) == _ops(graph)


def _ops(graph: OpGraph) -> list[tuple]:
    """Each node as what it computes: its target, module, output, arguments, and its inputs as earlier nodes (by
    position), parameters (by name) or the model's inputs (by name); node names aside."""
    from autoshard.passes.capturing.annotate import ESTIMATED

    position = {n.name: i for i, n in enumerate(graph.nodes)}

    def source(name: str) -> tuple:
        if name in position:
            return ("node", position[name])
        return ("param", graph.placeholder_params[name]) if name in graph.placeholder_params else ("input", name)

    return [
        (
            n.target,
            n.module_path,
            n.shape,
            n.dtype,
            n.extra_outputs,
            repr(sorted((k, v) for k, v in n.attrs.items() if k != ESTIMATED)),
            tuple(source(name) for name in n.inputs),
            n.param_inputs,
        )
        for n in graph.nodes
    ]


def numel(model: nn.Module) -> int:
    """Elements of the model's parameters and buffers, each tensor once."""
    return sum(t.numel() for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


@dataclass
class ReducedCopy:
    """A model's reduced copy (module doc) and what it stands on."""

    model: nn.Module  # the kept layers, their weights made on the CPU
    cut: list[tuple[str, int, int]]  # (stack path, layers kept, layers before) of each cut stack
    whole_numel: int  # elements of the whole model's parameters and buffers
    graph: OpGraph  # the copy captured on meta, to compare with the whole model's (``runs_like_the_whole``)


def reduced_copy(model_file: ModelFile, batch_size: int, seed: int = 0) -> ReducedCopy | None:
    """The model built on meta and cut (``cut_stacks``), captured at ``batch_size``, its kept tensors made on the CPU
    by replaying the factory's initialisation at ``seed``. None where there is no stack to cut, the initialisation
    cannot be replayed or the copy cannot be captured (module doc)."""
    from autoshard.errors import AutoshardError
    from autoshard.passes.capturing.capture import capture_module
    from autoshard.runtime import init_replay

    try:
        model, record = init_replay.record_build(lambda: model_file.build(None))
    except AutoshardError:  # NotReplayable: the factory seeds or draws itself
        return None
    whole = numel(model)
    cut = cut_stacks(model)
    if not cut:
        return None
    try:
        inputs = tuple(t.to("meta") for t in model_file.example_batch(batch_size)[0])
        graph = capture_module(model, inputs, where=model_file.spec)
    except AutoshardError:
        return None
    init_replay.attach(model, record, seed)
    init_replay.to_empty(model, torch.device("cpu"))
    init_replay.materialize(model, [model], model.state_dict(), lambda: None, lambda name: name)
    return ReducedCopy(model, cut, whole, graph)


def describe(cut: list[tuple[str, int, int]]) -> str:
    """What the copy keeps, for the plan's note."""
    return "layers: " + ", ".join(f"{kept} of {total} ({path})" for path, kept, total in cut)
