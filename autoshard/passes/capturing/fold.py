"""Fold and unfold: capture three of L identical layers, then copy the last L − 3 times.

Exporting costs about 40 ms per transformer layer, so a 96-layer model spends seconds in
``torch.export`` on layers that are all the same. ``fold_model`` finds the model's stack of
repeated layers (the one ``nn.ModuleList`` / ``nn.Sequential`` whose L ≥ 4 children have one
structure: the same classes, parameter and buffer names, shapes and dtypes, ``fingerprint``) and
keeps its first three children; the model is exported like that; ``unfold`` (after ``annotate``)
rebuilds the L-layer graph. A stack may open with f distinct layers before its run of identical ones
(DeepSeek-V3's three dense layers before 58 mixture-of-experts ones): those f are kept as they are,
and the three kept layers are f, f + 1, f + 2 (below, with f = 0). With P the nodes from the end of
layer 1 to the end of layer 2 (the glue between the layers, then layer 2), copy k = 3 … L−1 of P is P with

    node names         n → n_k            (fresh names; ``inputs`` rewired below)
    module paths       <list>.2… → <list>.k…, parameters and their placeholders likewise
    inputs             a node of P → its copy in k; a node of layer 1 → the same node of layer
                       2 in copy k − 1 (the previous layer); anything else (embeddings, masks,
                       rotary tables, placeholders) unchanged

and every node after layer 2 that read P reads copy L − 1 instead. FLOPs and bytes are copied
with the nodes (they were annotated on the folded graph).

The copies are exact when every layer runs the same ops, which the layers' equal structure
suggests but does not prove (a forward could branch on the layer's index). ``layers_match``
checks what it can: the three captured layers have one ``blocks.block_signature`` and the glue
after layer 0 runs the same ops as the glue after layer 1 (this catches every-other-layer
patterns); else ``capture`` exports the whole model. ``--no-fold`` turns folding off.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from autoshard.ir.graph import OpGraph, OpNode, ParamInfo
from autoshard.passes.capturing.blocks import block_members, block_signature

if TYPE_CHECKING:  # unfold runs on cached graphs, where torch is not imported at all
    import torch.nn as nn

KEPT = 3  # two layers and the glue between them are compared with the next two (module doc)
MIN_LAYERS = KEPT + 1


@dataclass(frozen=True)
class Fold:
    """What ``fold_model`` removed: the stack's module path and its full length."""

    path: str
    layers: int
    first: int = 0  # layers before the identical run, kept as they are (module doc)

    @property
    def kept(self) -> tuple[int, ...]:
        """The indices of the identical layers that are captured."""
        return tuple(range(self.first, self.first + KEPT))


def fingerprint(module: nn.Module) -> str:
    """Structure of one layer: module classes by relative path, parameter and buffer shapes."""
    h = hashlib.sha256()
    for name, m in module.named_modules():
        h.update(f"m {name} {type(m).__qualname__}\n".encode())
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        h.update(f"t {name} {tuple(t.shape)} {t.dtype}\n".encode())
    return h.hexdigest()


def repeated_stack(model: nn.Module) -> str | None:
    """The path of the one stack ending in ≥ MIN_LAYERS identical layers, outermost; None if none or several."""
    found = stacks(model)
    return found[0][0] if len(found) == 1 else None


def stacks(model: nn.Module) -> list[tuple[str, int]]:
    """(path, f) of each stack whose layers f .. L − 1 are identical, L − f ≥ MIN_LAYERS (f the fewest)."""
    import torch.nn as nn

    found = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < MIN_LAYERS:
            continue
        if any(part.isdigit() for part in path.split(".")) or not path:
            continue  # inside another stack, or the model itself is the stack
        prints = [fingerprint(layer) for layer in module]
        first = len(prints) - 1
        while first > 0 and prints[first - 1] == prints[-1]:
            first -= 1
        if len(prints) - first >= MIN_LAYERS:
            found.append((path, first))
    return found


def fold_model(model: nn.Module) -> Fold | None:
    """Keep the distinct first layers and KEPT of the identical ones of the model's repeated stack (in place);
    what was removed."""
    found = stacks(model)
    if len(found) != 1:
        return None
    path, first = found[0]
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    stack = getattr(parent, name)
    parent.register_module(name, stack[: first + KEPT])  # ModuleList / Sequential slices keep their class
    return Fold(path, len(stack), first)


def layers_match(graph: OpGraph, fold: Fold) -> bool:
    """Whether the captured layers run the same ops on the same shapes (``blocks.block_signature``),
    and so does the glue after each of the first two (module doc)."""
    members = block_members(graph)
    layers = [members.get(f"{fold.path}.{i}") for i in fold.kept]
    if (
        not all(layers)
        or len({block_signature(graph, f"{fold.path}.{i}", nodes) for i, nodes in zip(fold.kept, layers)}) != 1
    ):
        return False
    ends = [graph.nodes.index(nodes[-1]) for nodes in layers]
    starts = [graph.nodes.index(nodes[0]) for nodes in layers]
    glue = [
        [(n.target, n.shape, n.dtype, sorted(n.attrs.items())) for n in graph.nodes[ends[i] + 1 : starts[i + 1]]]
        for i in range(KEPT - 1)
    ]
    return glue[0] == glue[1]


def unfold(graph: OpGraph) -> OpGraph:
    """The L-layer graph from a folded one (module doc); a graph that was not folded as it is."""
    fold = graph.fold
    if fold is None:
        return graph
    assert layers_match(graph, fold), "capture keeps a fold only when its two layers match"
    members = block_members(graph)
    source = fold.kept[-1]  # the last captured layer: every copy is made from it and the one before
    first, second = (members[f"{fold.path}.{i}"] for i in (source - 1, source))
    end0 = graph.nodes.index(first[-1])
    end1 = graph.nodes.index(second[-1])
    pattern = graph.nodes[end0 + 1 : end1 + 1]
    previous = {a.name: b.name for a, b in zip(first, second)}  # layer K−2 node -> same node of layer K−1
    copies, params, placeholders = [], [], {}
    last = {n.name: n.name for n in pattern}  # pattern node -> its name in the latest copy
    for k in range(source + 1, fold.layers):
        names = {n.name: f"{n.name}_l{k}" for n in pattern}
        prev_of = {a: last[b] for a, b in previous.items()}  # layer K−2 names -> copy k−1's layer
        renamer = _Renamer(f"{fold.path}.{source}", f"{fold.path}.{k}")
        copies += [_copy(n, names, prev_of, renamer, graph, placeholders) for n in pattern]
        params += [renamer.param(p) for p in graph.params if p.name.startswith(f"{fold.path}.{source}.")]
        last = {n.name: names[n.name] for n in pattern}
    after = [_rewired(n, last) for n in graph.nodes[end1 + 1 :]]
    module_types = dict(graph.module_types)
    for k in range(source + 1, fold.layers):
        module_types |= _Renamer(f"{fold.path}.{source}", f"{fold.path}.{k}").module_types(graph.module_types)
    placeholder_params = {**graph.placeholder_params, **{new: p for new, (_, p) in placeholders.items()}}
    return replace(
        graph,
        nodes=graph.nodes[: end1 + 1] + copies + after,
        params=_with_copies(graph.params, params, f"{fold.path}.{source}."),
        module_types=module_types,
        placeholder_params=placeholder_params,
        placeholders={**graph.placeholders, **{new: meta for new, (meta, _) in placeholders.items()}},
        blocks=[],
        fold=None,
        layer_twins={f"{fold.path}.{k}": f"{fold.path}.{source}" for k in range(source + 1, fold.layers - 1)},
    )


def _with_copies(params: list[ParamInfo], copies: list[ParamInfo], source: str) -> list[ParamInfo]:
    """``params`` with the copies' parameters after the source layer's last parameter and their buffers
    after its last buffer (capture lists the parameters first, then the buffers, each in module order)."""
    out = list(params)
    for is_buffer in (True, False):  # buffers first: inserting them does not move the parameters' cut
        own = [i for i, p in enumerate(out) if p.is_buffer == is_buffer and p.name.startswith(source)]
        cut = own[-1] + 1 if own else len(out)
        out[cut:cut] = [p for p in copies if p.is_buffer == is_buffer]
    return out


class _Renamer:
    """Paths under the last captured layer as paths under layer k."""

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def path(self, name: str) -> str:
        if name == self.old or name.startswith(self.old + "."):
            return self.new + name[len(self.old) :]
        return name

    def param(self, p: ParamInfo) -> ParamInfo:
        return replace(
            p,
            name=self.path(p.name),
            module_path=self.path(p.module_path),
            tied_to=tuple(self.path(t) for t in p.tied_to),
        )

    def module_types(self, types: dict[str, str]) -> dict[str, str]:
        return {self.path(k): v for k, v in types.items() if self.path(k) != k}


def _copy(
    node: OpNode,
    names: dict[str, str],
    prev_of: dict[str, str],
    renamer: _Renamer,
    graph: OpGraph,
    placeholders: dict[str, tuple],
) -> OpNode:
    inputs = []
    for name in node.inputs:
        if name in names:
            inputs.append(names[name])
        elif name in prev_of:
            inputs.append(prev_of[name])
        elif (
            name in graph.placeholder_params
            and renamer.path(graph.placeholder_params[name]) != graph.placeholder_params[name]
        ):
            new = f"{name}_{renamer.new.replace('.', '_')}"
            placeholders[new] = (graph.placeholders[name], renamer.path(graph.placeholder_params[name]))
            inputs.append(new)
        else:
            inputs.append(name)
    return replace(
        node,
        name=names[node.name],
        module_path=renamer.path(node.module_path),
        inputs=tuple(inputs),
        param_inputs=tuple(renamer.path(p) for p in node.param_inputs),
        attrs=dict(node.attrs),
    )


def _rewired(node: OpNode, last: dict[str, str]) -> OpNode:
    """A node after the stack: what it read of the last captured layer it now reads of the last copy."""
    if not any(name in last for name in node.inputs):
        return node
    return replace(node, inputs=tuple(last.get(name, name) for name in node.inputs))
