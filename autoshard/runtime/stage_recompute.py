"""Activation recompute inside pipeline stages: checkpoint a block's part of a stage's graph.

torch has no way to do this. ``checkpoint_wrapper`` (``runtime.parallel.apply_recompute``) wraps
an ``nn.Module`` that is called from Python; a stage made by ``torch.distributed.pipelining.
pipeline()`` is a traced ``torch.fx.GraphModule`` (export, then ``unflatten`` per stage), and
replacing its block modules by wrappers would rename every parameter (``_checkpoint_wrapped_module``)
and leave the graph calling the old names. So the graph is rewritten instead.

**Method.** For a block path p with mode r ∈ {selective, full}, the region of p in the stage:

1. *A module call* (what ``pipeline()`` gives today: each stage is unflattened, so block p is one
   ``call_module`` node whose target, joined to the prefix of the graph holding it, is p: GPT's
   ``h.2`` in the stage's own graph, Llama's ``layers.2`` in the graph of ``model``). That node
   is the region; it is contiguous and self-contained by construction. It becomes
   ``checkpointed_call(<the block module, by get_attr>, r, *args, **kwargs)``: the module stays
   where it is, owning its parameters under their original names. (``nn_module_stack`` survives
   the split on the ops inside each unflattened module, but the ``call_module`` node of a block
   carries none: the call is found by its target.)
2. *Flat nodes* (a graph that was not unflattened, e.g. ``torch.export.export(...).module()``): the
   nodes whose ``meta["nn_module_stack"]`` (export's record of the module calls a node ran
   inside) lists p. They must form one contiguous run of the graph's order (``get_attr`` reads
   may sit between them: they read state, compute nothing). The run is outlined into a
   GraphModule G_p whose inputs are every value the run reads from outside (``get_attr``
   parameters and buffers included: they are passed in, not moved, so G_p owns no state) and
   whose outputs are the run's values read after it; the run is replaced by
   ``checkpointed_call(G_p, r, *inputs)`` and ``getitem``s of its outputs. G_p is registered as
   a state-less child ``_recompute_<p>`` of the graph's owner: parameters, buffers and
   state-dict keys are unchanged.

``checkpointed_call`` runs the region under ``torch.utils.checkpoint.checkpoint(use_reentrant=
False)``: full keeps only the region's inputs and reruns it in backward; selective keeps the
outputs of ``runtime.selective.SAVE_IN_SELECTIVE`` (matmuls, attention, and the
forward TP collectives ``tp_reduce``, ``tp_gather``, ``sp_gather``, ``sp_scatter``: the cost model charges the repeated
collectives to full recompute only), and reruns the rest. Recompute reads the same inputs and runs
the same ops, so values and gradients are bit for bit those without it; dropout draws the same
masks because checkpoint restores the RNG state it saved before the forward (``preserve_rng_state``).

**Refused** (``AutoshardError``, one line): a region that is not contiguous, holds a placeholder,
an output, a module call (flat case) or an op that mutates its inputs (a buffer update such as
BatchNorm's running statistics would run twice), a block called more than once, a block already
recomputed (a second application), and an unknown mode. A block with no node and no state in the
stage is another stage's: skipped.

TP stages (``tensor_parallel_stages``): the collectives are custom ops, plain calls in the
graph; full recompute reruns ``tp_reduce``/``tp_gather`` and the sequence ops (Megatron's full recompute repeats the
forward all-reduces), which is sound since every TP rank recomputes the same ops in the same
order. FSDP2 on the stage module afterwards: the stage is one FSDP unit, unsharded by its
pre-backward hook before any recompute runs, and the parameters passed into a region are the
unsharded parameter objects FSDP2 refills in place.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from autoshard.errors import AutoshardError
from autoshard.runtime.selective import selective_kwargs

RECOMPUTE_IN_STAGE = ("selective", "full")
OUTLINED_PREFIX = "_recompute_"  # the child holding an outlined region: _recompute_h_2 for block h.2
OUTLINED_META = "autoshard_recompute_block"  # on the get_attr of an outlined region: the block's path
# (input, weight, bias, running_mean, running_var, training | use_input_stats, ...): they write the running
# statistics in training mode though their schemas mark no argument as written.
RUNNING_STATS_OPS = {
    "batch_norm",
    "native_batch_norm",
    "instance_norm",
    "_batch_norm_impl_index",
    "cudnn_batch_norm",
    "miopen_batch_norm",
    "_native_batch_norm_legit",
}


def apply_recompute_to_stage(stage_module: nn.Module, modes: dict[str, str]) -> list[str]:
    """Checkpoint each block of ``modes`` (path → none | selective | full) held by ``stage_module``,
    in place (module doc); returns the paths wrapped, in ``modes`` order.

    Raises ``AutoshardError`` for an unknown mode or a block whose region is not provably sound.
    """
    wrapped = []
    for path, mode in modes.items():
        if mode == "none":
            continue
        if mode not in RECOMPUTE_IN_STAGE:
            raise AutoshardError(f"recompute mode {mode!r} for block {path}: use none, selective or full")
        if _wrap_block(stage_module, path, mode):
            wrapped.append(path)
    return wrapped


def block_module(stage_module: nn.Module, path: str) -> nn.Module | None:
    """The module block ``path`` runs as in ``stage_module``: its one ``call_module`` (module doc, case 1), or
    the module or outlined region a ``checkpointed_call`` runs for it; None for another stage's block.

    Refused (``AutoshardError``): a block the stage runs as flat nodes without recompute (no module to hand
    on) or calls more than once."""
    found = [
        owner.get_submodule(node.target if node.op == "call_module" else node.args[0].target)
        for prefix, owner in _graph_owners(stage_module)
        for node in owner.graph.nodes
        if (node.op == "call_module" and _block_target(prefix, node.target, path))
        or _wrapped_path(prefix, node) == path
    ]
    if len(found) > 1:
        raise AutoshardError(f"block {path} is called more than once in its pipeline stage; plan --compile off")
    if found:
        return found[0]
    if any(_nodes_of(owner.graph, path) for _, owner in _graph_owners(stage_module)):
        raise AutoshardError(
            f"block {path} runs as loose nodes of its pipeline stage's graph, not as a module; plan --compile off"
        )
    return None


def checkpointed_call(fn: nn.Module, mode: str, *args, **kwargs):
    """``fn(*args, **kwargs)`` under non-reentrant checkpoint in ``mode`` (the call the graph makes)."""
    return checkpoint(fn, *args, use_reentrant=False, **selective_kwargs(mode), **kwargs)


# ---------------------------------------------------------------------------- finding the region


def _graph_owners(stage_module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(prefix, module) of every module in the stage that runs an fx graph (the stage, unflattened children)."""
    return [
        (prefix, module)
        for prefix, module in stage_module.named_modules(remove_duplicate=False)
        if isinstance(getattr(module, "graph", None), torch.fx.Graph)
    ]


def _wrap_block(stage_module: nn.Module, path: str, mode: str) -> bool:
    owners = _graph_owners(stage_module)
    if any(_wrapped_path(prefix, node) == path for prefix, owner in owners for node in owner.graph.nodes):
        raise AutoshardError(
            f"recompute: block {path} is already recomputed in this pipeline stage; apply recompute to a stage once"
        )
    calls = [
        (owner, node)
        for prefix, owner in owners
        for node in owner.graph.nodes
        if node.op == "call_module" and _block_target(prefix, node.target, path)
    ]
    if len(calls) > 1 or any("@" in node.target for _, node in calls):
        raise AutoshardError(
            f"recompute: block {path} is called more than once in its pipeline stage; "
            f"recompute cannot wrap it, plan recompute none for it"
        )
    if calls:
        owner, node = calls[0]
        _check_pure(owner.get_submodule(node.target).modules(), path)
        _checkpoint_module_call(owner, node, mode)
        return True
    flat = [(owner, nodes) for _, owner in owners if (nodes := _nodes_of(owner.graph, path))]
    if len(flat) > 1:
        raise AutoshardError(
            f"recompute: block {path} runs in {len(flat)} graphs of its pipeline stage; plan recompute none for it"
        )
    if flat:
        _outline(flat[0][0], flat[0][1], path, mode)
        return True
    if any(name.startswith(path + ".") for name, _ in _state(stage_module)):
        raise AutoshardError(
            f"recompute: block {path} holds state in this pipeline stage but no graph node "
            f"names it; plan recompute none for it"
        )
    return False  # another stage's block


def _block_target(prefix: str, target: str, path: str) -> bool:
    """Whether a call_module target names block ``path`` (unflatten names a second call ``path@1``)."""
    return _join(prefix, target).split("@")[0] == path


def _wrapped_path(prefix: str, node: torch.fx.Node) -> str | None:
    """The block a ``checkpointed_call`` node runs (its module, or its outlined ``_recompute_`` graph)."""
    if node.op != "call_function" or node.target is not checkpointed_call:
        return None
    module_ref = node.args[0]
    return module_ref.meta.get(OUTLINED_META, _join(prefix, module_ref.target))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _nodes_of(graph: torch.fx.Graph, path: str) -> list[torch.fx.Node]:
    """The nodes export recorded as running inside module ``path`` (a placeholder carries the meta of the
    value it receives, so it is an input, never part of a region)."""
    return [
        node
        for node in graph.nodes
        if node.op != "placeholder"
        and any(entry[0] == path for entry in (node.meta.get("nn_module_stack") or {}).values())
    ]


def _state(module: nn.Module):
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def _check_pure(modules, path: str) -> None:
    """No node of the region's graphs mutates an input (it would run again in backward)."""
    for module in modules:
        graph = getattr(module, "graph", None)
        if isinstance(graph, torch.fx.Graph):
            _check_nodes_pure(graph.nodes, path)


def _check_nodes_pure(nodes, path: str) -> None:
    for node in nodes:
        if _mutates(node):
            raise AutoshardError(
                f"recompute: block {path} mutates a tensor in place ({node.name}: {node.target}), "
                f"which recompute would repeat; plan recompute none for it"
            )


def _mutates(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return schema.is_mutable or _updates_running_stats(node, schema.name.split("::")[-1])
    name = getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.endswith("__") and node.target is not operator.getitem


def _updates_running_stats(node: torch.fx.Node, op: str) -> bool:
    """Norms whose schema hides a write: training-mode batch norm updates running_mean/var (args 3, 5)."""
    if op not in RUNNING_STATS_OPS or len(node.args) < 6:
        return False
    return node.args[3] is not None and node.args[5] is not False


# ---------------------------------------------------------------------------- rewriting


def _checkpoint_module_call(owner: nn.Module, node: torch.fx.Node, mode: str) -> None:
    """call_module(p)(*a) → checkpointed_call(get_attr(p), mode, *a): the module stays where it is."""
    graph = owner.graph
    with graph.inserting_before(node):
        module_ref = graph.get_attr(node.target)
        call = graph.call_function(checkpointed_call, (module_ref, mode, *node.args), dict(node.kwargs))
    call.meta = dict(node.meta)
    node.replace_all_uses_with(call)
    graph.erase_node(node)
    _regenerate(owner)


def _outline(owner: nn.Module, nodes: list[torch.fx.Node], path: str, mode: str) -> None:
    """Replace the contiguous run ``nodes`` by a checkpointed call of a state-less GraphModule (module doc, 2)."""
    region = [n for n in nodes if n.op != "get_attr"]
    _check_run(owner.graph, region, path)
    inside = set(region)
    inputs = list(dict.fromkeys(arg for n in region for arg in n.all_input_nodes if arg not in inside))
    outputs = [n for n in region if any(user not in inside for user in n.users)]
    sub = torch.fx.Graph()
    env = {arg: sub.placeholder(f"in_{i}") for i, arg in enumerate(inputs)}
    for n in region:
        env[n] = sub.node_copy(n, lambda arg: env[arg])
    sub.output(tuple(env[n] for n in outputs))
    name = OUTLINED_PREFIX + path.replace(".", "_")
    owner.register_module(name, torch.fx.GraphModule(nn.Module(), sub))
    graph = owner.graph
    with graph.inserting_after(region[-1]):
        module_ref = graph.get_attr(name)
    module_ref.meta[OUTLINED_META] = path
    with graph.inserting_after(module_ref):
        call = graph.call_function(checkpointed_call, (module_ref, mode, *inputs))
    last = call
    for i, n in enumerate(outputs):
        with graph.inserting_after(last):
            last = graph.call_function(operator.getitem, (call, i))
        last.meta = dict(n.meta)
        n.replace_all_uses_with(last, delete_user_cb=lambda user: user not in inside)
    for n in reversed(region):
        graph.erase_node(n)
    _regenerate(owner)


def _check_run(graph: torch.fx.Graph, region: list[torch.fx.Node], path: str) -> None:
    """Sound to outline: one contiguous run (get_attr reads aside), no placeholder, output, module call
    or in-place op."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first, last = order[region[0]], order[region[-1]]
    inside = set(region)
    strays = [n for n in list(graph.nodes)[first : last + 1] if n not in inside and n.op != "get_attr"]
    if strays:
        raise AutoshardError(
            f"recompute: block {path}'s nodes are not one contiguous run of its stage's graph "
            f"({strays[0].name} runs between them); plan recompute none for it"
        )
    bad = next((n for n in region if n.op in ("placeholder", "output", "call_module")), None)
    if bad is not None:
        raise AutoshardError(
            f"recompute: block {path}'s region holds a {bad.op} node ({bad.name}), which cannot "
            f"be outlined; plan recompute none for it"
        )
    _check_nodes_pure(region, path)


def _regenerate(owner: nn.Module) -> None:
    """Make the owner run its edited graph (GraphModule: recompile; unflattened InterpreterModule: finalize)."""
    owner.graph.lint()
    if isinstance(owner, torch.fx.GraphModule):
        owner.recompile()
    else:
        owner.finalize()
