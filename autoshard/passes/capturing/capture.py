"""Capture: a model file becomes an :class:`OpGraph` through ``torch.export`` on meta tensors.

The model is built under ``torch.device("meta")`` (no memory is allocated, so a 175B model
plans on a laptop) and exported with ``torch.export.export(model, inputs, strict=False)``:
the training IR keeps high-level ops (``aten.linear``, ``aten.scaled_dot_product_attention``,
``aten.layer_norm``) and records, on every node, the module stack it ran in.

Each ``call_function`` node of the exported graph becomes one :class:`OpNode`:

    name, target           node.name, str(node.target)           "linear_3", "aten.linear.default"
    module_path, type      innermost entry of nn_module_stack    "h.0.attn.q_proj", "...Linear"
    inputs                 names of the Node arguments, argument order (duplicates kept)
    shape, dtype           node.meta["val"] (first tensor; the others in extra_outputs)
    param_inputs           placeholders read that are parameters / buffers, by qualified name
    attrs                  non-tensor arguments by schema name ({"dim0": 1, "dim1": 2})

Parameters and buffers come from the module itself (``named_parameters(remove_duplicate=False)``),
so tied weights appear once, under their first name, with the others in ``tied_to``.

Export failures become one-line :class:`AutoshardError` messages that name the user's
source line and the fix (``describe_export_failure``).

Ensures: every name in ``OpNode.inputs`` is a node or a key of ``OpGraph.placeholders``;
every ``param_inputs`` name is a ``ParamInfo.name``; nodes are in execution order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import logging
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx
import torch.nn as nn

from autoshard.errors import AutoshardError
from autoshard.ir.graph import OpGraph, OpNode, ParamInfo
from autoshard.modelfile import ModelFile, model_fingerprint
from autoshard.passes.capturing.fold import fold_model, layers_match

# modelfile imports user files under this module-name prefix; class names use the file stem.
_USER_MODULE_PREFIX = "autoshard_user_model_"
# Loggers that print whole graphs on an export failure; the user gets one line instead.
_NOISY_LOGGERS = (
    "torch.fx.experimental.symbolic_shapes",
    "torch._export",
    "torch.export",
    "torch._dynamo",
    "torch.fx.experimental.proxy_tensor",
    "torch._subclasses.fake_tensor",
)


def capture(model_file: ModelFile, batch_size: int = 2, fold: bool = False) -> OpGraph:
    """Build the model on meta, export it on a meta copy of ``example_batch(batch_size)``. With
    ``fold``, only two of its repeated layers are exported (``passes.capturing.fold``; ``unfold`` restores
    the rest after ``annotate``), unless the two turn out different: then the whole model is."""
    model = build_on_meta(model_file)
    fingerprint = model_fingerprint(model)  # of the whole model: plans name it (fold shortens it next)
    folded = fold_model(model) if fold else None
    inputs, targets = model_file.example_batch(batch_size)
    check_targets(model_file, targets)
    meta_inputs = tuple(t.to("meta") for t in inputs)
    try:
        graph = capture_module(model, meta_inputs, where=model_file.spec)
    except AutoshardError as exc:
        raise AutoshardError(_with_length_hint(str(exc), model_file, model, batch_size)) from exc.__cause__
    if folded is not None and not layers_match(graph, folded):
        model = build_on_meta(model_file)
        graph, folded = capture_module(model, meta_inputs, where=model_file.spec), None
    graph.fold, graph.model_fingerprint = folded, fingerprint
    if not any(p.requires_grad for p in model.parameters()):
        raise AutoshardError(
            f"{model_file.spec}: the model has no trainable parameters, so there is nothing to "
            f"train or shard; return the model with its layers from the factory"
        )
    return graph


SHORTER_BY = (2, 8)  # tokens fewer than every position the model has, tried where that length does not trace


def _with_length_hint(message: str, model_file: ModelFile, model: nn.Module, batch_size: int) -> str:
    """``message`` (a capture's refusal, ``spec: why``), or, where the file's own length is every position the model
    has (hf:DIR without --seq-len) and a length ``SHORTER_BY`` fewer traces, a refusal that names that length
    first: a model that reads a row or two past its tokens' positions (ProphetNet's n-gram stream reads position +
    1 of positions numbered from the padding index) fails only there, with a shape error far from its cause."""
    prefix, positions = f"{model_file.spec}: ", model_file.length_at_positions
    if positions is None or not message.startswith(prefix):
        return message
    for fewer in SHORTER_BY:
        shorter = dataclasses.replace(model_file, seq_len=positions - fewer, length_at_positions=None)
        if shorter.seq_len < 1:
            continue
        inputs, _ = shorter.example_batch(batch_size)
        try:
            capture_module(model, tuple(t.to("meta") for t in inputs), where=shorter.spec)
        except AutoshardError:
            continue
        return (
            f"{prefix}at {positions} tokens per sample, every position the model has (hf:DIR's default), it does not "
            f"trace, and at {shorter.seq_len} it does (it reads past its tokens' positions); pass --seq-len "
            f"{shorter.seq_len}: {message[len(prefix) :]}"
        )
    return message


def check_targets(model_file: ModelFile, targets: Any) -> None:
    """The example targets are one tensor: every rank slices its share of the batch and moves it to its
    device, and the loss takes it; anything else (a NumPy array, a list) would fail on every rank."""
    if isinstance(targets, torch.Tensor):
        return
    cls = type(targets)
    kind = cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__.split('.')[0]}.{cls.__name__}"
    fix = "torch.from_numpy(targets)" if cls.__module__.split(".")[0] == "numpy" else "torch.tensor(targets)"
    raise AutoshardError(
        f"{model_file.path}: example_batch returns targets of type {kind}, not a torch tensor; "
        f"every rank slices the targets by the batch and moves them to its device; fix: "
        f"return {fix}"
    )


def check_output(program: torch.export.ExportedProgram, where: str) -> None:
    """The model's forward returns something the loss can use (a tensor, or a structure holding some)."""
    outputs = program.graph_signature.user_outputs
    if not outputs or all(name is None for name in outputs):
        raise AutoshardError(
            f"{where}: the model's forward returns None (or no tensor), so there is no output "
            f"for the loss; fix: end forward with `return` of its output (e.g. the logits)"
        )


@contextlib.contextmanager
def model_output_to_stderr() -> Iterator[None]:
    """What the model file prints while it is imported, built and exported goes to stderr, so that
    stdout carries only autoshard's own output (``plan --json`` is pure JSON). Both Python's
    ``sys.stdout`` and file descriptor 1 (C extensions, subprocesses) are redirected, then restored."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no descriptor 1 (a closed stdout): Python's level only
        saved = None
    if saved is not None:
        os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def capture_module(model: nn.Module, inputs: tuple[torch.Tensor, ...], where: str = "model") -> OpGraph:
    """Export ``model`` on ``inputs`` (same device as its parameters) and convert the result."""
    with modules_inside_autograd_functions(model) as hidden:
        program = export_module(model, inputs, where)
    check_output(program, where)
    check_static_shapes(program, where)
    check_position_tables(program, where)
    graph = graph_from_export(model, program, inputs)
    graph.hidden_backward = tuple(sorted(hidden))
    return graph


@contextlib.contextmanager
def modules_inside_autograd_functions(model: nn.Module) -> Iterator[set[str]]:
    """The modules of ``model`` called inside an ``autograd.Function``'s forward while the block runs (yielded as a
    set filled then). Such a Function's backward is its own code, which export does not trace: Reformer's reversible
    layers run each layer again there, from the outputs, with gradients on; a reentrant checkpoint alike. An FSDP2
    unit called inside one gets no backward hook (its outputs there need no gradient), so ZeRO-3, which shards its
    parameters again after forward, hands them to that backward sharded ("got mixed torch.Tensor and DTensor")."""
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    depth, found = [0], set()
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        depth[0] += 1
        try:
            return original.__func__(cls, *args, **kwargs)
        finally:
            depth[0] -= 1

    def record(module: nn.Module, _args) -> None:
        if depth[0] and id(module) in names:
            found.add(names[id(module)])

    torch.autograd.Function.apply = classmethod(apply)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        yield found
    finally:
        handle.remove()
        torch.autograd.Function.apply = original


def build_on_meta(model_file: ModelFile) -> nn.Module:
    """Call the factory under ``torch.device("meta")``; a failure says that meta is the problem."""
    try:
        model = model_file.build("meta")
    except AutoshardError as exc:
        cause = exc.__cause__
        if cause is None or isinstance(cause, SystemExit):  # not meta's fault (no module returned, exit())
            raise
        where = user_location(cause)
        if "overflow" in str(cause).lower():  # a size beyond int64: the dimensions are wrong, not meta
            raise AutoshardError(
                f"{model_file.spec}: a tensor is too large to exist ({type(cause).__name__}: {_first_line(cause)}"
                f"{' at ' + where if where else ''}); check the model's dimensions"
            ) from cause
        raise AutoshardError(
            f"{model_file.spec}: the model cannot be built on the meta device "
            f"({type(cause).__name__}: {_first_line(cause)}{' at ' + where if where else ''}); "
            f"make {model_file.factory_name}() work under `with torch.device('meta')`: create tensors "
            f"without a fixed device=, and do not read values (.item(), .tolist(), torch.load) while building"
        ) from cause
    if any(t.device.type != "meta" for t in [*model.parameters(), *model.buffers()]):
        model = model.to("meta")  # the factory pinned a device; planning needs shapes only
    return model


def export_module(model: nn.Module, inputs: tuple[torch.Tensor, ...], where: str) -> torch.export.ExportedProgram:
    """``torch.export.export(strict=False)``; a failure is one line with the user's source line."""
    with quiet_export():
        try:
            return torch.export.export(model, inputs, strict=False)
        except Exception as exc:
            unfit = _inputs_do_not_fit(model, inputs)
            if unfit:
                raise AutoshardError(
                    f"{where}: forward() cannot take the example inputs positionally ({unfit}); "
                    f"example_batch's inputs are passed as forward(*inputs), so make each "
                    f"of them a positional parameter (not keyword-only)"
                ) from exc
            raise AutoshardError(describe_export_failure(exc, where)) from exc


def _inputs_do_not_fit(model: nn.Module, inputs: tuple) -> str | None:
    """Why ``model.forward`` cannot be called on ``inputs`` positionally (a keyword-only input, too many
    inputs), or None when it can or its signature is unknown."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*inputs)
    except TypeError as exc:
        keyword_only = [
            p.name
            for p in signature.parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty
        ]
        return f"{exc}" + (f"; keyword-only: {', '.join(keyword_only)}" if keyword_only else "")
    return None


def check_static_shapes(program: torch.export.ExportedProgram, where: str) -> None:
    """Every op's output shape is a number: one that depends on tensor values cannot be planned."""
    for node in program.graph.nodes:
        values = torch.utils._pytree.tree_leaves(node.meta.get("val"))
        if any(isinstance(t, torch.Tensor) and not all(isinstance(d, int) for d in t.shape) for t in values):
            path, _ = module_of(node)
            raise AutoshardError(
                f"{where}: the output shape of {target_name(node.target)} in module '{path or 'the root'}' "
                f"depends on tensor values (boolean-mask indexing, nonzero, unique); planning needs fixed "
                f"shapes: use torch.where or multiply by the mask instead"
            )


# ops that carry their input's values unchanged (a position index through them is the index it was)
_SAME_VALUES = frozenset(
    {
        "aten.unsqueeze.default",
        "aten.view.default",
        "aten.reshape.default",
        "aten.expand.default",
        "aten._unsafe_view.default",
        "aten.clone.default",
        "aten.contiguous.default",
        "aten.alias.default",
        "aten._to_copy.default",
        "aten.to.dtype",
        "aten.to.device",
        "aten.detach.default",
        "aten.lift_fresh_copy.default",
    }
)


def check_position_tables(program: torch.export.ExportedProgram, where: str) -> None:
    """No embedding table is indexed past its rows by positions the model counts itself.

    Meta tensors have no values, so a lookup out of range cannot fail during capture; it would fail only once
    the program runs. The positions a model numbers itself, ``arange(start, end)`` plus a constant (after
    shape-only ops) looked up in a table of learned positions (GPT-2's ``wpe``), are known without values:
    their largest must be below the table's rows. A sequence longer than the model's positions (``--seq-len``
    past ``block_size`` / ``n_positions``) is refused here, with the limit."""
    for node in program.graph.nodes:
        if target_name(node.target) != "aten.embedding.default" or len(node.args) < 2:
            continue
        weight = node.args[0]
        rows = weight.meta["val"].shape[0] if isinstance(getattr(weight, "meta", {}).get("val"), torch.Tensor) else None
        last = _largest_position(node.args[1])
        if rows is None or last is None or last < rows:
            continue
        path, _ = module_of(node)
        raise AutoshardError(
            f"{where}: module '{path or 'the root'}' looks up positions up to {last} in a table of {rows} rows: "
            f"the sequence is longer than the model's positions; plan with --seq-len {rows} or less, or give the "
            f"model more positions"
        )


def _largest_position(node: Any) -> int | None:
    """The largest value of ``node`` when it is ``aten.arange`` of numbers, plus numbers, through ops that keep
    values (``_SAME_VALUES``); None when it is anything else."""
    offset = 0
    while isinstance(node, torch.fx.Node) and node.args:
        target = target_name(node.target)
        if target in _SAME_VALUES:
            node = node.args[0]
        elif (
            target in ("aten.add.Tensor", "aten.add.Scalar")
            and len(node.args) == 2
            and isinstance(node.args[1], int)
            and not isinstance(node.args[1], bool)
        ):
            offset, node = offset + node.args[1], node.args[0]
        elif target.startswith("aten.arange.") and all(isinstance(a, int) for a in node.args):
            start, end, step = (
                (0, node.args[0], 1)
                if len(node.args) == 1
                else (node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else 1)
            )
            if step <= 0 or end <= start:
                return None
            return offset + start + (end - 1 - start) // step * step
        else:
            return None
    return None


def graph_from_export(
    model: nn.Module, program: torch.export.ExportedProgram, inputs: tuple[torch.Tensor, ...]
) -> OpGraph:
    """The OpGraph of an exported program (see the module docstring for the mapping)."""
    sig = program.graph_signature
    params = param_infos(model)
    canonical = {alias: p.name for p in params for alias in (p.name, *p.tied_to)}
    # export may name a tied tensor by any of its names; the OpGraph uses ParamInfo.name
    placeholder_params = {
        ph: canonical.get(_clean_path(fqn), _clean_path(fqn))
        for ph, fqn in {**sig.inputs_to_parameters, **sig.inputs_to_buffers}.items()
    }
    module_types = module_types_of(model)
    graph_nodes = list(program.graph.nodes)
    first = inputs[0] if inputs else None
    return OpGraph(
        nodes=[op_node(n, placeholder_params, module_types) for n in graph_nodes if n.op == "call_function"],
        params=params,
        input_shapes=[tuple(t.shape) for t in inputs],
        batch_size=int(first.shape[0]) if first is not None and first.dim() else 1,
        tokens_per_sample=_tokens_per_sample(first),
        module_types=module_types,
        input_names=[str(name) for name in sig.user_inputs],
        placeholder_params=placeholder_params,
        placeholders={n.name: _outputs(n.meta.get("val"))[:2] for n in graph_nodes if n.op == "placeholder"},
    )


# ---------------------------------------------------------------------------- nodes


def op_node(node: torch.fx.Node, placeholder_params: dict[str, str], module_types: dict[str, str]) -> OpNode:
    """One exported ``call_function`` node as an OpNode."""
    path, stack_type = module_of(node)
    inputs = tuple(a.name for a in _node_args(node))
    shape, dtype, extra = _outputs(node.meta.get("val"))
    params = tuple(dict.fromkeys(placeholder_params[i] for i in inputs if i in placeholder_params))
    return OpNode(
        name=node.name,
        target=target_name(node.target),
        module_path=path,
        module_type=module_types.get(path, stack_type),
        inputs=inputs,
        shape=shape,
        dtype=dtype,
        param_inputs=params,
        attrs=_attrs(node) | _region_modules(node),
        extra_outputs=extra,
    )


GRAD_MODE_REGION = torch.ops.higher_order.wrap_with_set_grad_enabled


def _region_modules(node: torch.fx.Node) -> dict[str, list[str]]:
    """For a grad-mode region (``torch.no_grad()``, export's ``wrap_with_set_grad_enabled``): ``body_modules``, the
    modules its body's ops run in (nested regions' too), which say the blocks it spans; {} for another node."""
    if node.target is not GRAD_MODE_REGION:
        return {}
    return {"body_modules": sorted(_body_modules(node))}


def _body_modules(node: torch.fx.Node) -> set[str]:
    body = getattr(node.graph.owning_module, node.args[1].target)
    found = set()
    for inner in body.graph.nodes:
        if inner.op == "call_function":
            found.add(module_of(inner)[0])
            if inner.target is GRAD_MODE_REGION:
                found |= _body_modules(inner)
    return found


def target_name(target: Any) -> str:
    """ "aten.linear.default" for aten ops, "higher_order.cond", "operator.getitem" otherwise."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    module = getattr(target, "__module__", None) or ""
    return f"{module.lstrip('_')}.{getattr(target, '__name__', str(target))}".lstrip(".")


def _node_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Tensor-carrying Node arguments in order; submodule references (get_attr) are not data."""
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return [a for a in found if a.op != "get_attr"]


def _outputs(val: Any) -> tuple[tuple[int, ...], str, tuple[tuple[tuple[int, ...], str], ...]]:
    """(shape, dtype) of the first tensor in ``val`` and (shape, dtype) of the others."""
    tensors = [t for t in torch.utils._pytree.tree_leaves(val) if isinstance(t, torch.Tensor)]
    metas = [(tuple(int(d) for d in t.shape), _dtype_name(t.dtype)) for t in tensors]
    if not metas:
        return (), "", ()
    return metas[0][0], metas[0][1], tuple(metas[1:])


def _attrs(node: torch.fx.Node) -> dict[str, Any]:
    """Non-tensor arguments by schema name (defaults filled in); "argN" for non-aten targets."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return {f"arg{i}": _plain(a) for i, a in enumerate(node.args) if not _has_node(a)}
    attrs = {}
    for i, arg in enumerate(node.target._schema.arguments):
        default = arg.default_value if arg.has_default_value() else None
        if i < len(node.args) and not arg.kwarg_only:
            value = node.args[i]
        else:
            value = node.kwargs.get(arg.name, default)
        if not _has_node(value):
            attrs[arg.name] = _plain(value)
    return attrs


def _has_node(value: Any) -> bool:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(value, found.append)
    return bool(found)


def _plain(value: Any) -> Any:
    """A JSON-friendly copy: numbers, strings, None, lists; torch objects as their names."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.dtype):
        return _dtype_name(value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.hint if value.node.has_hint() else str(value)
    return str(value)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------- modules and params


def module_of(node: torch.fx.Node) -> tuple[str, str]:
    """(path, class name) of the innermost module on the node's ``nn_module_stack``; root is ""."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1][:2]
    return _clean_path(path), cls if isinstance(cls, str) else qualified_class_name(cls)


def _clean_path(path: str) -> str:
    """Dotted module path: "L['self'].h[0]" -> "h.0", "_orig_mod.h.0" -> "h.0", "h.0@1" -> "h.0"."""
    path = re.sub(r"^L\['self'\]\.?|^L__self__\.?", "", path)
    path = re.sub(
        r"\._modules\['([^']+)'\]|\['([^']+)'\]|\[(\d+)\]", lambda m: "." + next(g for g in m.groups() if g), path
    )
    path = re.sub(r"@\d+$", "", path)
    path = re.sub(r"(^|\.)_orig_mod(?=\.|$)", "", path)
    return path.strip(".")


def qualified_class_name(cls: type) -> str:
    """ "torch.nn.modules.linear.Linear"; classes of user model files use the file's stem ("gpt.Block")."""
    module = cls.__module__
    if module.startswith(_USER_MODULE_PREFIX):
        file = getattr(sys.modules.get(module), "__file__", None)
        module = Path(file).stem if file else module
    return f"{module}.{cls.__qualname__}"


def module_types_of(model: nn.Module) -> dict[str, str]:
    """Every named module path (root "") -> qualified class name."""
    return {_clean_path(name): qualified_class_name(type(m)) for name, m in model.named_modules()}


def param_infos(model: nn.Module) -> list[ParamInfo]:
    """Parameters, then buffers; a tensor reachable under several names appears once."""
    params = _group_tied(model.named_parameters(remove_duplicate=False), is_buffer=False)
    return params + _group_tied(model.named_buffers(remove_duplicate=False), is_buffer=True)


def _group_tied(named: Iterator[tuple[str, torch.Tensor]], is_buffer: bool) -> list[ParamInfo]:
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in named:
        names.setdefault(id(tensor), []).append(_clean_path(name))
        tensors[id(tensor)] = tensor
    return [
        ParamInfo(
            name=ns[0],
            shape=tuple(tensors[key].shape),
            dtype=_dtype_name(tensors[key].dtype),
            module_path=ns[0].rpartition(".")[0],
            is_buffer=is_buffer,
            tied_to=tuple(ns[1:]),
        )
        for key, ns in names.items()
    ]


def _tokens_per_sample(first: torch.Tensor | None) -> int:
    """Sequence length when the first input is token ids (integer, rank 2), else 1."""
    integer = not (
        first is None or first.dtype.is_floating_point or first.dtype.is_complex or first.dtype == torch.bool
    )
    if not integer or first.dim() != 2:
        return 1
    return int(first.shape[1])


# ---------------------------------------------------------------------------- errors


def describe_export_failure(exc: BaseException, where: str) -> str:
    """One line: what torch.export could not trace, where in the user's code, and the fix."""
    location = user_location(exc)
    at = f" at {location}" if location else ""
    if _is_data_dependent(exc):
        return (
            f"{where}: data-dependent control flow{at}; replace the Python `if` on a tensor value "
            f"with torch.where / torch.cond (shapes and branches must not depend on tensor values)"
        )
    unflattenable = _unflattenable_output(exc)
    if unflattenable:
        return (
            f"{where}: the model returns a {unflattenable}, which torch.export cannot flatten; return "
            f"tensors (or tuples / dicts / dataclasses of them) from forward(); for a Hugging Face "
            f"model set use_cache=False in its config"
        )
    op = _failing_op(exc)
    if op:
        return (
            f"{where}: torch.export cannot trace op {op}{at} on meta tensors "
            f"({type(exc).__name__}: {_first_line(exc)}); use standard torch ops there "
            f"or register a fake (meta) kernel for {op}"
        )
    return (
        f"{where}: torch.export failed{at}: {type(exc).__name__}: {_first_line(exc)}; make forward() "
        f"traceable (no .item()/.tolist()/.numpy(), no Python branches on tensor values); "
        f"--debug shows the traceback"
    )


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes / contexts, outermost first."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _is_data_dependent(exc: BaseException) -> bool:
    names = ("GuardOnDataDependentSymNode", "DataDependentOutputException", "DynamicOutputShapeException")
    for e in _chain(exc):
        text = str(e).lower()
        if type(e).__name__ in names or "data-dependent" in text or "data dependent" in text:
            return True
    return False


def _unflattenable_output(exc: BaseException) -> str:
    """The class name in torch's "Found <class 'X'> in output, which is not a known type"."""
    for e in _chain(exc):
        match = re.search(r"Found <class '([\w.]+)'> in output", str(e))
        if match:
            return match.group(1).rsplit(".", 1)[-1]
    return ""


def _failing_op(exc: BaseException) -> str:
    for e in _chain(exc):
        match = re.search(r"\b(\w+::\w+(?:\.\w+)?)", str(e))
        if match:
            return match.group(1)
    return ""


def user_location(exc: BaseException) -> str:
    """ "file.py:7 (`code`)" for the innermost frame outside torch, the stdlib and autoshard."""
    for e in reversed(_chain(exc)):
        frames = [(f.filename, f.lineno, f.line) for f in traceback.extract_tb(e.__traceback__)]
        frames += re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', str(e))
        user = [f for f in frames if is_user_file(f[0])]
        if user:
            filename, lineno, line = user[-1]
            code = f" (`{line.strip()}`)" if line and line.strip() else ""
            return f"{short_path(filename)}:{lineno}{code}"
    return ""


def _library_dirs() -> tuple[str, ...]:
    dirs = [Path(torch.__file__).parent, Path(__file__).parents[2], Path(sysconfig.get_paths()["stdlib"])]
    return tuple(str(d.resolve()) for d in dirs)


def is_user_file(filename: str) -> bool:
    if not filename or filename.startswith("<"):
        return False
    return not str(Path(filename).resolve()).startswith(_library_dirs())


def short_path(filename: str) -> str:
    path = Path(filename).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__


@contextlib.contextmanager
def quiet_export() -> Iterator[None]:
    """Export fast and quietly; everything is restored after.

    * no per-node stack traces (``torch.fx.config.do_not_emit_stack_traces``): the OpGraph
      does not keep them, and collecting them is ~25% of exporting GPT-3 175B; failures are
      still located from the exception's own traceback (``user_location``);
    * torch's loggers, and its ``print`` of the partial graph to stderr on a failure, are held
      back: the user gets one line instead. Text written to stderr is replayed on success;
    * torch's structured trace log (``TORCH_TRACE``) is settled first: its handler is installed
      unconditionally and removes itself on the first record when no trace directory is set, but
      export's first record carries its call stack, symbolized at ~0.15 s (5% of a cold plan) only
      to be dropped. A record without context (no stack) settles it as well; with ``TORCH_TRACE``
      set it is one extra line in the trace.
    """
    torch._logging.trace_structured("autoshard_capture", suppress_context=True)
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    # torch < 2.13 (a GPU machine's own build) has no such switch: its traces are kept there, nothing else differs
    has_switch = hasattr(torch.fx.config, "do_not_emit_stack_traces")
    emit_stack_traces = torch.fx.config.do_not_emit_stack_traces if has_switch else None
    stderr = io.StringIO()
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    if has_switch:
        torch.fx.config.do_not_emit_stack_traces = True
    try:
        with contextlib.redirect_stderr(stderr):
            yield
        sys.stderr.write(stderr.getvalue())
    finally:
        if has_switch:
            torch.fx.config.do_not_emit_stack_traces = emit_stack_traces
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
