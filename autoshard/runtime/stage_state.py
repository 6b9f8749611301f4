"""The state a pipeline stage holds beside what its graph reads (``runtime.pipeline_parallel``): the model's
parameters and buffers no stage's graph reads, each kept by one stage (``unread_state_homes``, ``attach``), and the
leftovers ``pipeline()`` puts in a stage that its graphs never read, removed (``drop_unused_state``)."""

from __future__ import annotations

import torch
import torch.nn as nn

from autoshard.ir.names import home_index


def unread_state_homes(model: nn.Module, pipe) -> dict[int, list[tuple[str, torch.Tensor]]]:
    """The model's state no stage's graph reads, by the stage that keeps it: {stage index: [(name, tensor)]}.

    ``pipeline()`` moves into a stage only what its graph reads, so a parameter the forward never uses (the
    cross-attention of a causal-LM decoder that has no encoder: Blenderbot's ``encoder_attn``) would be in no
    stage, neither trained nor saved, where one process keeps it unchanged. Each such tensor is kept by one
    stage, whole, under its own name: the first stage that reads state of its nearest enclosing module (its
    layer's), else the first stage. A name whose tensor a stage reads under another name (a tie, an alias) is
    held already. The same on every rank: every rank splits the whole model."""
    used_names: list[set[str]] = []
    used_ids: set[int] = set()
    for index in range(pipe.num_stages):
        stage = pipe.get_stage_module(index)
        names = _used_state_names(stage)
        used_names.append(names)
        held = {
            **dict(stage.named_parameters(remove_duplicate=False)),
            **dict(stage.named_buffers(remove_duplicate=False)),
        }
        used_ids |= {id(held[name]) for name in names if name in held}
    every_used = set().union(*used_names)
    names_of: dict[int, list[str]] = {}
    state = model.state_dict(keep_vars=True)  # parameters and persistent buffers, every name of a tied one
    for name, tensor in state.items():
        names_of.setdefault(id(tensor), []).append(name)
    homes: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for key, names in names_of.items():
        if key in used_ids or any(name in every_used for name in names):
            continue
        home = home_index(names[0], used_names)
        homes.setdefault(home, []).extend((name, state[name]) for name in names)
    return homes


def attach(stage_module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """``tensor`` registered in ``stage_module`` under ``name``, its parent modules made where the stage has none."""
    parent = stage_module
    *path, leaf = name.split(".")
    for part in path:
        child = getattr(parent, part, None)
        if not isinstance(child, nn.Module):
            child = nn.Module()
            parent.add_module(part, child)
        parent = child
    if isinstance(tensor, nn.Parameter):
        parent.register_parameter(leaf, tensor)
    else:
        parent.register_buffer(leaf, tensor)


def drop_unused_state(stage_module: nn.Module) -> list[str]:
    """Remove parameters and buffers the stage's graphs never read; returns their names. A name of a tensor the
    graphs read under another name stays (a tie made one parameter: RoBERTa's copy of its word embeddings,
    listed in ``Pipe.replicated_params`` under that name, which its head reads as ``lm_head.decoder.weight``)."""
    used = _used_state_names(stage_module)
    named = list(stage_module.named_parameters(remove_duplicate=False))
    named += list(stage_module.named_buffers(remove_duplicate=False))
    read = {id(tensor) for name, tensor in named if name in used}
    dropped = [name for name, tensor in named if name not in used and id(tensor) not in read]
    for name in dropped:
        parent_path, _, leaf = name.rpartition(".")
        delattr(stage_module.get_submodule(parent_path), leaf)
    return dropped


def _used_state_names(module: nn.Module, scope: str = "") -> set[str]:
    """Names read by ``get_attr`` in the (nested) graphs, plus all state of graph-less called modules."""
    graph = getattr(module, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return {_join(scope, name) for name, _ in module.named_parameters(remove_duplicate=False)} | {
            _join(scope, name) for name, _ in module.named_buffers(remove_duplicate=False)
        }
    used = {_join(scope, n.target) for n in graph.nodes if n.op == "get_attr"}
    called = {n.target for n in graph.nodes if n.op == "call_module"}
    for name, child in module.named_children():
        if isinstance(getattr(child, "graph", None), torch.fx.Graph) or name in called:
            used |= _used_state_names(child, _join(scope, name))
    return used


def _join(scope: str, name: str) -> str:
    return f"{scope}.{name}" if scope else name
