"""Grad-mode regions inlined into the traced graph, so that ``pipeline()`` can split a model that has them.

``torch.export`` keeps a ``torch.no_grad()`` region (a ``torch.enable_grad()`` one alike) as one higher-order op,
``wrap_with_set_grad_enabled(enabled, body, *args)``, whose body is a submodule of the graph. ``pipeline()``'s
splitter cuts that body off from its module (HF Llama's rotary embedding failed at run time with StopIteration).
Here each region becomes its body's nodes in the graph itself, between two calls that set the grad mode and put
it back::

    set_grad_mode(enabled)
    ... the body's nodes, on the region's inputs ...
    set_grad_mode(outer)

which is what the region's ``with`` block does when the model runs eagerly: the values it makes from weights or
activations carry no gradient (a sparse-attention indexer's token scores, a router's choice, a stop-gradient
gate), and everything after it runs in the mode around it. ``outer`` is a constant: gradients on, the mode the
stages' schedules run their forwards in (a nested region's, its enclosing region's), whatever mode the split ran in.
``set_grad_mode`` is registered as a side effect (``torch.fx.node.has_side_effect``), so no pass drops the calls that
set the mode back. It is ``torch._C._set_grad_enabled`` under another name: ``torch.fx.passes.split_module`` treats
that one as global state to carry across partitions, and calls ``pipeline()``'s split callback, which counts the split
points it passes, more than once per node, so the partition numbers it then reads do not exist (KeyError).

A stage boundary must never fall between the two calls: a stage would end with gradients off. ``pipeline()``
begins stages at block calls, and the planner allows a boundary at a block only where no region that reads values
needing gradients lies outside the blocks (``passes.planning.stage_cuts``); a region inside a block's module ends
inside that block. ``check_balanced`` checks each stage after the split all the same.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autoshard.errors import AutoshardError

REGION = torch.ops.higher_order.wrap_with_set_grad_enabled


@fx.node.has_side_effect
def set_grad_mode(enabled: bool) -> None:
    """Gradients on or off from here (a call in a traced graph: module doc)."""
    torch._C._set_grad_enabled(enabled)


def inline_grad_mode_regions(module: fx.GraphModule, outer: bool = True) -> int:
    """Every grad-mode region of ``module``'s graph (nested ones too) inlined, in place; returns how many. ``outer``:
    the mode the graph runs in (a stage's forward in a training schedule: gradients on)."""
    count = 0
    for node in list(module.graph.nodes):
        if node.op == "call_function" and node.target is REGION:
            count += 1 + _inline(module, node, outer)
    if count:
        module.graph.lint()
        module.recompile()
    return count


def _inline(module: fx.GraphModule, node: fx.Node, outer: bool) -> int:
    """``node`` (a region) replaced by its body's nodes between the mode's set and its restore to ``outer``; returns
    the regions nested in the body, inlined first."""
    enabled, body_ref, *args = node.args
    body = getattr(module, body_ref.target)
    nested = inline_grad_mode_regions(body, bool(enabled))
    graph = module.graph
    with graph.inserting_before(node):
        _mode_call(graph, node, set_grad_mode, (bool(enabled),))
        values = dict(zip([n for n in body.graph.nodes if n.op == "placeholder"], args))
        outputs = None
        for inner in body.graph.nodes:
            if inner.op == "output":
                outputs = fx.node.map_arg(inner.args[0], values.__getitem__)
            elif inner.op == "get_attr":
                raise AutoshardError(
                    f"a grad-mode region's body reads {inner.target} as an attribute; cannot inline it"
                )
            elif inner.op != "placeholder":
                values[inner] = graph.node_copy(inner, values.__getitem__)
        _mode_call(graph, node, set_grad_mode, (outer,))
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        else:
            user.replace_input_with(node, outputs)
    graph.erase_node(node)
    if not body_ref.users:
        graph.erase_node(body_ref)
        delattr(module, body_ref.target)
    return nested


def _mode_call(graph: fx.Graph, region: fx.Node, target, args: tuple) -> fx.Node:
    """A call of ``target`` recorded as made where the region was entered (its module stack, which
    ``torch.export.unflatten`` reads to rebuild each stage's module calls)."""
    call = graph.call_function(target, args)
    call.meta = {key: value for key, value in region.meta.items() if key != "val"}
    return call


def check_balanced(module: fx.GraphModule, where: str, outer: bool = True) -> None:
    """Each stage (a child of the split ``module``) ends in the mode it began in, ``outer``: the last call in its
    graphs that sets the grad mode, if any, sets ``outer`` (a stage boundary did not fall inside a region)."""
    for stage, child in module.named_children():
        modes = [
            n.args[0]
            for sub in child.modules()
            if isinstance(graph := getattr(sub, "graph", None), fx.Graph)
            for n in graph.nodes
            if n.op == "call_function" and n.target is set_grad_mode
        ]
        if modes and modes[-1] != outer:
            raise AutoshardError(
                f"{where}: stage {stage} ends with gradients {'on' if modes[-1] else 'off'}: a stage boundary "
                f"falls inside a grad-mode region (torch.no_grad()); pin --pp 1"
            )
