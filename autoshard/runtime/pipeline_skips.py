"""Make every pipeline transfer one torch's stages can run: adjacent, in order, contiguous.

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

Model inputs. The schedule hands the step's inputs to the first stage only, positionally, so
stage 0 must take every model input x_1 .. x_n in the declared order (not the order its code
reads them: ``pipeline()`` gives it placeholders in first-use order), and an input read by a
later stage (nanoGPT's ``forward(idx, targets)``: only the loss in the last stage reads
``targets``) is made adjacent like any other value: it counts as made by stage p(x) = −1, and
stages 0 .. last(x) − 1 carry it (``first_stage_takes_every_input``, then ``route_skipped_values``).
An input no stage reads is taken by stage 0 and left unused.

Model outputs. The schedule returns the last stage's outputs only, and the loss rebuilds the
model's output from them, so the last stage returns every model output leaf in the model's
order; one made earlier (T5's ``encoder_last_hidden_state``) is carried to it like a value it
reads (``last_stage_reads_every_output``).

Receive order. ``_PipelineStage`` sends output i of stage s to its i-th ``getitem`` user and
stage s + 1 receives into its placeholders in order; the two are paired by order alone, so two
tensors of one shape and dtype (an attention mask and a carried input) taken in another order
would be swapped silently. Each stage's inputs are put in the previous stage's output order
(``misordered_transfers`` finds any that are not).

Contiguous transfers. Send and receive buffers must be contiguous (gloo refuses others), but
a stage may hand on a view: the expanded 4-D attention masks of BERT, T5 and ViT, a transposed
bias. Every stage output but the last stage's becomes ``sendable(output)``: ``output.contiguous()``
(the identity on values and gradients, a no-op on a tensor already contiguous), or a copy of a
contiguous view (HF Llama's rotary tables), so no output is a view: the zero-bubble schedules'
split backward detaches each stage output in place (``stage_backward_input``), which autograd
refuses on a view. The receiving placeholders are described with contiguous strides, from which
the stages size their buffers (``make_transfers_contiguous``). Gradients flow back the same way: a stage's inputs'
gradients are what it sends to the stage before, and they are views where its first op on an input is one (a
transpose or permute: DeepSeek-V4's hyper-connection streams), so the inputs of stage s > 0 are read through
``grad_sendable``: the identity, whose backward makes the gradient contiguous where the input needs one.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

ROOT = -1  # the stage "making" a model input


def route_skipped_values(pipe):
    """Make every transfer of ``pipe`` (from ``torch.distributed.pipelining.pipeline()``) adjacent.

    Stage 0 takes every model input; values (model inputs included) read past the next stage
    are carried; the last stage returns every model output; each stage receives in the order
    the previous one sends. Modifies the pipe's graphs in place and returns it.
    """
    graph = pipe.split_gm.graph
    stages = stage_nodes(graph)
    assert not pipe.has_loss_and_backward, "a pipe with its backward in the graph cannot be rerouted"
    changed = first_stage_takes_every_input(pipe.split_gm, stages)
    returned = last_stage_reads_every_output(pipe.split_gm, stages)
    skipping = _skipping_values(graph, stages)
    for value, producer, last in skipping:
        _carry(pipe.split_gm, stages, value, producer, last)
    if returned is not None:
        _return_model_output(pipe.split_gm, stages[-1], returned)
    reordered = _receive_in_send_order(pipe.split_gm, stages)
    if not (changed or returned is not None or skipping or reordered):
        return pipe
    graph.lint()
    pipe.split_gm.recompile()
    pipe.executor = type(pipe.executor)(pipe.split_gm)  # its cached last uses are stale
    assert not skipped_transfers(pipe), skipped_transfers(pipe)
    assert not misordered_transfers(pipe), misordered_transfers(pipe)
    return pipe


def skipped_transfers(pipe) -> list[tuple[str, int, int]]:
    """(value, producer stage, reader stage) for each transfer that is not s → s + 1.

    A model input read by a stage after the first counts (producer ``ROOT`` = −1).
    """
    stages = stage_nodes(pipe.split_gm.graph)
    position = {node: s for s, node in enumerate(stages)}
    transfers = [(arg.name, _producer(arg, position), s) for s, node in enumerate(stages) for arg in node.args]
    return [(name, p, s) for name, p, s in transfers if p is not None and s - p > 1]


def misordered_transfers(pipe) -> list[int]:
    """The stages whose inputs are not, in order, the previous stage's outputs 0, 1, 2, ...

    ``_PipelineStage`` sends output i to the i-th ``getitem`` user of its call and receives into
    the placeholders in order, pairing sends with receives by order alone: tensors of one shape
    and dtype received out of order would be swapped silently.
    """
    stages = stage_nodes(pipe.split_gm.graph)
    wrong = []
    for s in range(1, len(stages)):
        sender = stages[s - 1]
        sends = [i for i, user in enumerate(_getitem_users(sender)) if user.args[1] != i]
        indices = [_own_output_index(arg, sender) for arg in stages[s].args]
        if sends or None in indices or indices != sorted(indices):
            wrong.append(s)
    return wrong


def _getitem_users(node: fx.Node) -> list[fx.Node]:
    return [user for user in node.users if user.target is operator.getitem]


def _receive_in_send_order(split_gm: fx.GraphModule, stages: list[fx.Node]) -> bool:
    """Order each stage's inputs (and placeholders) by the previous stage's output index; whether any moved."""
    moved = False
    for s in range(1, len(stages)):
        node, sender = stages[s], stages[s - 1]
        module = split_gm.get_submodule(node.target)
        pairs = sorted(zip(node.args, _placeholders(module.graph)), key=lambda pair: _own_output_index(pair[0], sender))
        if [arg for arg, _ in pairs] != list(node.args):
            _order_placeholders(module.graph, [inner for _, inner in pairs])
            module.recompile()
            node.args = tuple(arg for arg, _ in pairs)
            moved = True
    return moved


def first_stage_takes_every_input(split_gm: fx.GraphModule, stages: list[fx.Node]) -> bool:
    """Give stage 0 a placeholder for each model input it lacks, all in the model's order.

    The model's order is that of the top-level graph's placeholders (the inputs as fed, see
    ``split_model``); ``pipeline()`` gives stage 0 its placeholders in the order its code first
    reads them, which differs where ``forward`` reads a later input first (a two-tower model
    running its vision tower on ``pixel_values`` before embedding ``input_ids``). Each stage
    placeholder stays bound to the model input it reads (``first.args``), and they are put in
    the model's order. Returns whether stage 0 changed. A new placeholder is unused inside
    stage 0 until a later reader's value is carried through it (``_carry``), or for good
    when no stage reads that input.
    """
    roots = _placeholders(split_gm.graph)
    first = stages[0]
    if tuple(first.args) == tuple(roots):
        return False
    assert all(arg in roots for arg in first.args) and not first.kwargs, (
        f"the first stage {first.name} reads values other than the model's inputs"
    )
    module = split_gm.get_submodule(first.target)
    inner = dict(zip(first.args, _placeholders(module.graph)))
    for root in roots:
        if root not in inner:
            inner[root] = _new_placeholder(module.graph, f"input_{root.name}", _root_meta(split_gm, stages, root))
    _order_placeholders(module.graph, [inner[root] for root in roots])
    module.recompile()
    first.args = tuple(roots)
    return True


def last_stage_reads_every_output(split_gm: fx.GraphModule, stages: list[fx.Node]) -> list[fx.Node] | None:
    """Make the last stage read each model output an earlier stage makes; None if none does.

    The schedule returns only the last stage's outputs, so those must be all of the model's
    (T5's ``encoder_last_hidden_state`` is made by the encoder's stages). Returns, for each
    model output leaf in order, the node inside the last stage that holds it (the old output,
    or the placeholder reading it); ``_return_model_output`` then returns them.
    """
    last = stages[-1]
    module = split_gm.get_submodule(last.target)
    leaves = _output_leaves(split_gm.graph)
    own = _stage_outputs(module)
    inner = []
    for leaf in leaves:
        index = _own_output_index(leaf, last)
        inner.append(own[index] if index is not None else _input_for(last, module, leaf, _value_meta(split_gm, leaf)))
    if inner == own:
        return None
    return inner


def _output_leaves(graph: fx.Graph) -> list[fx.Node]:
    leaves = [leaf for leaf in torch.utils._pytree.tree_leaves(_output_node(graph).args[0]) if leaf is not None]
    assert all(isinstance(leaf, fx.Node) for leaf in leaves), f"the model returns non-tensors: {leaves}"
    return leaves


def _stage_outputs(module: fx.GraphModule) -> list:
    outputs = _output_node(module.graph).args[0]
    return list(outputs) if isinstance(outputs, tuple) else [outputs]


def _own_output_index(leaf: fx.Node, stage: fx.Node) -> int | None:
    """i where ``leaf`` is the stage's output i (``getitem(stage, i)``, or the stage call: 0)."""
    if leaf is stage:
        return 0
    if leaf.target is operator.getitem and leaf.args[0] is stage:
        return leaf.args[1]
    return None


def _return_model_output(split_gm: fx.GraphModule, last: fx.Node, inner: list[fx.Node]) -> None:
    """The last stage returns ``inner`` (the model's output leaves); the top level returns its outputs."""
    module = split_gm.get_submodule(last.target)
    _output_node(module.graph).args = (tuple(inner),)
    module.recompile()
    graph = split_gm.graph
    top = _output_node(graph)
    old = [user for user in last.users if user.target is operator.getitem]
    with graph.inserting_before(top):
        outputs = [graph.call_function(operator.getitem, (last, i)) for i in range(len(inner))]
    leaves = iter(outputs)
    spec_args = torch.utils._pytree.tree_map(lambda leaf: next(leaves) if leaf is not None else None, top.args[0])
    top.args = (spec_args,)
    for node in old:
        if not node.users:
            graph.erase_node(node)


def _placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [node for node in graph.nodes if node.op == "placeholder"]


def _new_placeholder(graph: fx.Graph, name: str, meta: dict) -> fx.Node:
    placeholders = _placeholders(graph)
    with graph.inserting_after(placeholders[-1] if placeholders else None):
        inner = graph.placeholder(name)
    inner.meta.update({key: meta[key] for key in ("val", "tensor_meta") if key in meta})
    return inner


def _order_placeholders(graph: fx.Graph, ordered: list[fx.Node]) -> None:
    """Move the placeholders to the front of ``graph`` in the order given."""
    anchor = next(node for node in graph.nodes if node.op != "placeholder" or node not in ordered)
    for node in ordered:
        anchor.prepend(node)


def _root_meta(split_gm: fx.GraphModule, stages: list[fx.Node], root: fx.Node) -> dict:
    """The ``meta`` of a model input: its own, else that of a stage placeholder bound to it."""
    if "val" in root.meta:
        return root.meta
    for node in stages:
        if root in node.args:
            return _placeholders(split_gm.get_submodule(node.target).graph)[node.args.index(root)].meta
    return {}


def stage_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The top-level graph's stage calls, in stage order (as ``_PipelineStage`` numbers them)."""
    return [node for node in graph.nodes if node.op == "call_module"]


def _skipping_values(graph: fx.Graph, stages: list[fx.Node]) -> list[tuple[fx.Node, int, int]]:
    """(value, p(v), last(v)) for each top-level value read more than one stage after its maker."""
    position = {node: s for s, node in enumerate(stages)}
    found = [(value, _producer(value, position), _last_reader(value, position)) for value in graph.nodes]
    return [(value, p, last) for value, p, last in found if p is not None and last > p + 1]


def _producer(value, position: dict[fx.Node, int]) -> int | None:
    """The stage making ``value`` (a stage call or an output of one), ``ROOT`` for a model input."""
    if not isinstance(value, fx.Node):
        return None
    if value.op == "placeholder":
        return ROOT
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
        for reader in stages[s + 1 : last + 1]:
            reader.replace_input_with(carried, passed)
        carried = passed


def _value_meta(split_gm: fx.GraphModule, value: fx.Node) -> dict:
    """The ``meta`` of the producer stage's output node that ``value`` names (of a model input: its own)."""
    if value.op == "placeholder":
        return _root_meta(split_gm, stage_nodes(split_gm.graph), value)
    index = value.args[1] if value.target is operator.getitem else None
    stage = value.args[0] if index is not None else value
    outputs = _output_node(split_gm.get_submodule(stage.target).graph).args[0]
    return (outputs[index] if index is not None else outputs).meta


def _input_for(node: fx.Node, module: fx.GraphModule, value: fx.Node, meta: dict) -> fx.Node:
    """The stage's placeholder bound to ``value``; a new last placeholder (and arg) if it has none."""
    assert not node.kwargs, f"stage {node.name} takes keyword arguments"
    if value in node.args:
        return _placeholders(module.graph)[node.args.index(value)]
    inner = _new_placeholder(module.graph, f"carried_{value.name}", meta)
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


def make_transfers_contiguous(pipe):
    """Every stage output but the last stage's is sent contiguous, into contiguous buffers (module doc).

    Modifies the pipe's graphs in place and returns it.
    """
    stages = stage_nodes(pipe.split_gm.graph)
    for s, node in enumerate(stages):
        module = pipe.split_gm.get_submodule(node.target)
        if s < len(stages) - 1:
            _contiguous_outputs(module)
        if s > 0:
            for inner in _placeholders(module.graph):
                _describe_contiguous(inner)
                _contiguous_gradient(module.graph, inner)
        module.recompile()
    return pipe


def _contiguous_gradient(graph: fx.Graph, placeholder: fx.Node) -> None:
    """Every reader of ``placeholder`` but the stage's outputs reads ``grad_sendable(placeholder)`` instead (module
    doc): a value carried on unchanged stays the input tensor itself (its gradient comes whole from the next
    stage's buffer)."""
    readers = [user for user in placeholder.users if not _is_sendable(user)]
    if not readers:
        return
    with graph.inserting_after(placeholder):
        sent = graph.call_function(grad_sendable, (placeholder,))
    sent.meta.update({k: v for k, v in placeholder.meta.items() if k in ("val", "tensor_meta")})  # in no module
    placeholder.replace_all_uses_with(sent, delete_user_cb=lambda user: user in readers)


def _is_sendable(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is sendable


class _ContiguousGradient(torch.autograd.Function):
    """The identity; its backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grad_sendable(value):
    """``value``; its gradient, where autograd makes one, contiguous (module doc): what the stage before receives."""
    if isinstance(value, torch.Tensor) and value.requires_grad and torch.is_grad_enabled():
        return _ContiguousGradient.apply(value)
    return value


def _contiguous_outputs(module: fx.GraphModule) -> None:
    output = _output_node(module.graph)
    single = not isinstance(output.args[0], tuple)
    values = (output.args[0],) if single else output.args[0]
    made = []
    for value in values:
        with module.graph.inserting_before(output):
            contiguous = module.graph.call_function(sendable, (value,))
        contiguous.meta.update(value.meta)
        _describe_contiguous(contiguous)
        made.append(contiguous)
    output.args = (made[0] if single else tuple(made),)


def sendable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` contiguous and owning its storage (module doc): a copy of a view, else ``contiguous()``."""
    if tensor._base is not None:
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor.contiguous()


def _describe_contiguous(node: fx.Node) -> None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and not val.is_contiguous():
        node.meta["val"] = val.contiguous()
        node.meta.pop("tensor_meta", None)
