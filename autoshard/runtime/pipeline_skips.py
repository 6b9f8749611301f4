"""Route values that skip pipeline stages through every stage in between.

What torch lacks. ``pipeline()`` splits such a model correctly: its top-level graph
(``Pipe.split_gm``) calls stage s as ``submod_s(*args)``, and an arg may be an output of any
earlier stage (``getitem(submod_p, i)``). HF Llama's rotary (cos, sin) tables and attention
mask are made in stage 0 and read by every decoder layer, so with S > 2 stages stage 0 sends
them to stages 1, 2, ... S − 1. The run time cannot execute that:

- ``_PipelineStage._create_grad_recv_info`` takes the gradient of each output from exactly
  one reader stage and raises "Backward of skip connections not supported yet" for an output
  read by several (GPipe and 1F1B with pp > 2);
- ``PipelineScheduleMulti`` (interleaved 1F1B) accepts only receives from s − 1 and sends to
  s + 1 (``_validate_adjacent_stage_communication``) and picks its p2p peers that way.

The fix, on the graph. A value v made by stage p(v) and read by the stages R(v) skips when
last(v) = max R(v) > p(v) + 1. For s = p(v) + 1 .. last(v) − 1, stage s takes v as an input
(a new placeholder unless it reads v already) and returns it unchanged as an extra output;
the readers of v after s read that output instead. Afterwards every transfer is s → s + 1
and every stage output has one reader stage::

    before:  0 ──v──▶ 1,  0 ──v──▶ 2,  0 ──v──▶ 3
    after:   0 ──v──▶ 1 ──v──▶ 2 ──v──▶ 3        (last(v) − p(v) sends instead of |R(v)|)

Gradients stay exact: the carried output is the identity, so stage s's input gradient is
its own use's gradient plus the one stage s + 1 sends back, and by induction stage p(v)
receives ∂L/∂v = Σ_{r ∈ R(v)} ∂L_r/∂v, the sum autograd forms in one process.
"""

from __future__ import annotations

import operator

import torch.fx as fx


def route_skipped_values(pipe):
    """Make every transfer of ``pipe`` (from ``torch.distributed.pipelining.pipeline()``) adjacent.

    Modifies the pipe's graphs in place and returns it.
    """
    graph = pipe.split_gm.graph
    stages = stage_nodes(graph)
    skipping = _skipping_values(graph, stages)
    if not skipping:
        return pipe
    assert not pipe.has_loss_and_backward, "a pipe with its backward in the graph cannot be rerouted"
    for value, producer, last in skipping:
        _carry(pipe.split_gm, stages, value, producer, last)
    graph.lint()
    pipe.split_gm.recompile()
    pipe.executor = type(pipe.executor)(pipe.split_gm)  # its cached last uses are stale
    assert not skipped_transfers(pipe), skipped_transfers(pipe)
    return pipe


def skipped_transfers(pipe) -> list[tuple[str, int, int]]:
    """(value, producer stage, reader stage) for each transfer that is not s → s + 1."""
    stages = stage_nodes(pipe.split_gm.graph)
    position = {node: s for s, node in enumerate(stages)}
    transfers = [(arg.name, _producer(arg, position), s) for s, node in enumerate(stages) for arg in node.args]
    return [(name, p, s) for name, p, s in transfers if p is not None and s - p > 1]


def stage_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The top-level graph's stage calls, in stage order (as ``_PipelineStage`` numbers them)."""
    return [node for node in graph.nodes if node.op == "call_module"]


def _skipping_values(graph: fx.Graph, stages: list[fx.Node]) -> list[tuple[fx.Node, int, int]]:
    """(value, p(v), last(v)) for each top-level value read more than one stage after its maker."""
    position = {node: s for s, node in enumerate(stages)}
    found = [(value, _producer(value, position), _last_reader(value, position)) for value in graph.nodes]
    return [(value, p, last) for value, p, last in found if p is not None and last > p + 1]


def _producer(value, position: dict[fx.Node, int]) -> int | None:
    """The stage making ``value`` (a stage call or an output of one), else None (a root input)."""
    if not isinstance(value, fx.Node):
        return None
    if value.op == "call_function" and value.target is operator.getitem:
        value = value.args[0]
    return position.get(value)


def _last_reader(value: fx.Node, position: dict[fx.Node, int]) -> int:
    return max((position[user] for user in value.users if user in position), default=-1)


def _carry(split_gm: fx.GraphModule, stages: list[fx.Node], value: fx.Node, producer: int, last: int) -> None:
    """Pass ``value`` through stages producer + 1 .. last − 1; later readers take the passed copy."""
    carried = value
    for s in range(producer + 1, last):
        node = stages[s]
        module = split_gm.get_submodule(node.target)
        inner = _input_for(node, module, carried, _value_meta(split_gm, value))
        passed = _add_output(split_gm.graph, node, module, inner)
        for reader in stages[s + 1:last + 1]:
            reader.replace_input_with(carried, passed)
        carried = passed


def _value_meta(split_gm: fx.GraphModule, value: fx.Node) -> dict:
    """The ``meta`` of the producer stage's output node that ``value`` names."""
    index = value.args[1] if value.target is operator.getitem else None
    stage = value.args[0] if index is not None else value
    outputs = _output_node(split_gm.get_submodule(stage.target).graph).args[0]
    return (outputs[index] if index is not None else outputs).meta


def _input_for(node: fx.Node, module: fx.GraphModule, value: fx.Node, meta: dict) -> fx.Node:
    """The stage's placeholder bound to ``value``; a new last placeholder (and arg) if it has none."""
    assert not node.kwargs, f"stage {node.name} takes keyword arguments"
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    if value in node.args:
        return placeholders[node.args.index(value)]
    with module.graph.inserting_after(placeholders[-1] if placeholders else None):
        inner = module.graph.placeholder(f"carried_{value.name}")
    inner.meta.update({key: meta[key] for key in ("val", "tensor_meta") if key in meta})
    node.args = (*node.args, value)
    return inner


def _add_output(graph: fx.Graph, node: fx.Node, module: fx.GraphModule, inner: fx.Node) -> fx.Node:
    """Return ``inner`` as the stage's last output; the top-level ``getitem`` naming it.

    ``_PipelineStage`` numbers outputs by the order of the call's ``getitem`` users, so a
    single-output stage first gets ``getitem(call, 0)`` for its existing readers.
    """
    output = _output_node(module.graph)
    outputs = output.args[0]
    if not isinstance(outputs, tuple):
        _index_single_output(graph, node)
        outputs = (outputs,)
    output.args = ((*outputs, inner),)
    module.recompile()
    with graph.inserting_after(_last_getitem(node)):
        return graph.call_function(operator.getitem, (node, len(outputs)))


def _index_single_output(graph: fx.Graph, node: fx.Node) -> None:
    with graph.inserting_after(node):
        first = graph.call_function(operator.getitem, (node, 0))
    node.replace_all_uses_with(first, delete_user_cb=lambda user: user is not first)


def _last_getitem(node: fx.Node) -> fx.Node:
    """The last of the ``getitem(node, i)`` right after ``node`` (``node`` if none)."""
    last = node
    while last.next.target is operator.getitem and last.next.args[0] is node:
        last = last.next
    return last


def _output_node(graph: fx.Graph) -> fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")
