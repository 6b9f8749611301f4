"""Compiled blocks: ``torch.compile`` (inductor) of each block's forward, as torchtitan compiles them.

``apply_compile`` replaces each block's ``forward`` with its compiled form, in place: the module, its name and
its parameters' names stay as they were (``nn.Module.compile`` would compile ``_call_impl``, hooks included;
``torch.compile(module)`` would wrap it and rename every parameter ``_orig_mod.*``), and the hooks that the
steps after it register on the block (FSDP2's gathers and reduce-scatters, DDP's) run outside the compiled
code, as they do in torchtitan (TP, recompute, compile, then FSDP). The block's recompute wrapper, when it has
one, is what is compiled, so dynamo traces the checkpoint with the block inside it; but a tensor-parallel block
recomputed in full is compiled inside its checkpoint (the wrapped block's forward; the checkpoint runs eager
around it and reruns the compiled forward in backward). In torch 2.13 dynamo's checkpoint of a block holding
DTensors that recomputes everything, DTensor's collectives included, saves the DeviceMesh those collectives
take for backward, and AOT autograd refuses it ("expected all tensors_saved_with_vc_check to be Tensors"); a
selective policy keeps the collectives' outputs, so it traces. Blocks with the same code share one compiled
graph (dynamo caches by code and guards on shapes, not on the module).

Verified like every plan (``autoshard verify``): verify runs with every random op fixed
(``runtime.randomness``). Its function mode (``FixedFunctions``: dropout the identity, attention's
``dropout_p`` 0) is traced into the compiled graph like any other code. Its dispatch mode
(``ExpectedRandomness``) cannot be: dynamo compiles nothing while a dispatch mode is on, so the block would
silently run eager. A compiled block is therefore called with that mode set aside, and its graph is refused
(``RandomOpNotFixed``, naming the op) if it still draws random numbers: inductor's random kernels are not the
ones verify can fix. A checkpoint traced inside the compiled code is a graph of its own (dynamo's
``tag_activation_checkpoint`` body), which the function mode does not reach: its calls are fixed as the mode
fixes them before inductor sees them (``randomness.fix_graph_functions``), and the refusal reads the nested
graphs too.

Beside context parallelism. The ring (``runtime.context_parallel``) is entered as a torch function mode around
the forward and the backward, and dynamo traces the mode's ``__torch_function__`` into the compiled code.
The ring call itself is ``torch.compiler.disable``d (``ContextParallelMode._attention``: torch's ring sends
through ProcessGroup calls dynamo cannot trace), so a compiled block breaks its graph there and runs the ring
eager between two compiled graphs, as a torch function would. A checkpoint traced inside the compiled code
(dynamo's ``tag_activation_checkpoint`` region) does NOT apply a torch function mode to what it traces: the
attention inside it would be the rank's own tokens alone. So beside context parallelism a recomputed block is
compiled inside its recompute (``recompute_outside``): ``checkpoint_wrapper`` stays eager around the compiled
block, and its recomputation reruns the compiled block under the ring's mode (``runtime.selective``). Only
full recompute: selective recompute's policy is a dispatch mode, under which dynamo compiles nothing.

Inside pipeline stages. A stage is a traced graph, and each block it holds is a module it calls (``pipeline()``
unflattens the stage: ``runtime.stage_recompute``), or, recomputed, the module a ``checkpointed_call`` runs.
That module's forward is compiled in place (``compile_stage_blocks``): the stage's own graph, its transfers and
FSDP2's hooks on the stage module stay eager, and the block's recompute, eager around it, reruns the compiled
block (so, as beside context parallelism, full recompute only). Blocks of other stages are skipped. Each is
compiled static (``dynamic=False``): a rank holding several stages (interleaved schedules) meets one block code
with more than one set of guards, and under automatic dynamic shapes dynamo would add a dynamic graph beside the
static one, both matching; the eager recompute could then rerun the other graph, which saves other tensors
(torch.utils.checkpoint's "Recomputed values ... have different metadata", pytorch/pytorch#166926). Static
graphs' guards exclude each other, so the recompute reruns the forward's graph. Beside
tensor parallelism a stage's blocks hold local shards and call TP's collectives as custom ops
(``runtime.tensor_parallel_stages``): dynamo keeps each as one call in the compiled graph, with its own autograd,
so the compiled block communicates as the eager one does (and full recompute reruns those calls). Async TP cannot
apply there: inductor's micro-pipeline pass matches ``_c10d_functional``'s collectives, not these ops
(``ir.decisions.async_tp_refusal``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode_temporarily

from autoshard.errors import AutoshardError
from autoshard.ir.names import RANDOM_OPS, RANDOM_SWITCHES
from autoshard.runtime.model import get_block
from autoshard.runtime.randomness import (
    SDPA_DROPOUT_ARG,
    ExpectedRandomness,
    RandomOpNotFixed,
    base_name,
    fix_graph_functions,
    nested_graphs,
)
from autoshard.runtime.selective import recompute_mode
from autoshard.runtime.stage_recompute import block_module

_WRAPPED = "_checkpoint_wrapped_module"  # checkpoint_wrapper's child: the block it recomputes


def apply_compile(
    model: nn.Module, blocks: tuple[str, ...] | list[str] = (), recompute_outside: bool = False
) -> nn.Module:
    """Compile each block's forward in place (module doc); the whole model's where there are no blocks.
    ``recompute_outside``: a recomputed block's wrapper stays eager and the block inside it is compiled (module
    doc, "Beside context parallelism")."""
    for path in blocks or ("",):
        module = _compiled_module(get_block(model, path) if path else model, recompute_outside)
        module.forward = _compiled_forward(module.forward, path or "the model")
    return model


def apply_async_tp(model: nn.Module, tp_mesh) -> nn.Module:
    """Async TP for the blocks compiled after it, as torchtitan turns it on (``torchtitan.distributed.compile``
    ``_maybe_enable_async_tp``): symmetric memory for the TP group, then inductor's micro-pipeline TP pass, which
    rewrites each all-gather feeding a matmul and each matmul feeding a reduce-scatter into one fused op
    exchanging chunks over symmetric memory while the matmul runs. torch 2.13 deprecates
    ``enable_symm_mem_for_group`` (it says groups no longer need it); torchtitan still calls it, with the warning
    silenced, until torch registers the groups async TP uses by itself. Refused in one line on non-CUDA ranks
    (gloo has no symmetric memory). Returns the model unchanged."""
    if tp_mesh.device_type != "cuda":
        raise AutoshardError(
            f"async TP needs CUDA ranks (symmetric memory), and this program runs on {tp_mesh.device_type} ranks; "
            f"re-plan with --async-tp off (verify runs this plan's twin without it)"
        )
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    torch._inductor.config._micro_pipeline_tp = True
    return model


def compiled_loss(loss_fn: Callable) -> Callable:
    """The loss the step calls, compiled (``Decisions.compile_loss``), as torchtitan's build_cross_entropy_loss
    compiles it under --training.compile (its commit bbb1b616e, 2025-04-02): inductor fuses the fp32 upcast,
    log-softmax and nll into one kernel forward and one backward, keeping the logits and a statistic per row where
    eager keeps the fp32 log-softmax and its backward two fp32 gradients (``cost.eager`` "Loss"). Called like the
    blocks (``_compiled_forward``: verify's fixed randomness set aside so dynamo compiles it); with loss parallelism
    dynamo traces ``loss_parallel``'s DTensor cross-entropy on the vocabulary shards."""
    return _compiled_forward(loss_fn, "the loss")


def compile_stage_blocks(stage_module: nn.Module, blocks: tuple[str, ...] | list[str]) -> list[str]:
    """Compile, in place, each block of ``blocks`` that the pipeline stage ``stage_module`` holds (module doc,
    "Inside pipeline stages"); returns their paths."""
    compiled = []
    for path in blocks:
        module = block_module(stage_module, path)
        if module is not None:
            module.forward = _compiled_forward(module.forward, path, dynamic=False)
            compiled.append(path)
    return compiled


def _compiled_module(block: nn.Module, recompute_outside: bool = False) -> nn.Module:
    """The module whose forward is compiled (module doc): the block's recompute wrapper; under
    ``recompute_outside`` (beside cp, on pipeline stages) the module its ``checkpoint_wrapper`` wraps; and that
    inner module too where the block holds DTensors and recomputes in full (dynamo cannot trace TP's DTensors
    through a checkpoint)."""
    inner = getattr(block, _WRAPPED, None)
    if inner is None:
        return block
    if recompute_outside:
        return inner
    if recompute_mode(block) != "full":
        return block
    return inner if any(isinstance(p, DTensor) for p in inner.parameters()) else block


def _compiled_forward(forward, where: str, dynamic: bool | None = None):
    # one backend for all: dynamo reuses a graph only with it
    compiled = torch.compile(forward, backend=_inductor, dynamic=dynamic)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        global _fixed
        stack = _get_current_dispatch_mode_stack()
        if not (stack and isinstance(stack[-1], ExpectedRandomness)):
            return compiled(*args, **kwargs)
        _fixed = where  # read by _inductor: dynamo sets the mode stacks aside while it compiles
        try:
            with _pop_mode_temporarily():  # module doc: dynamo compiles nothing under a dispatch mode
                return compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            if isinstance(exc.inner_exception, RandomOpNotFixed):
                raise exc.inner_exception from None
            raise
        finally:
            _fixed = ""

    return run


_fixed = ""  # the block being called with verify's random ops fixed, or ""


def _inductor(graph: torch.fx.GraphModule, example_inputs):
    """Inductor, after fixing the random functions of the graphs nested in ``graph`` (a checkpoint's body, which
    verify's function mode does not reach) and refusing a graph, or a graph nested in it, that still draws random
    numbers while randomness is fixed (module doc)."""
    if _fixed:
        fix_graph_functions(graph)
        drawn = [node for module in nested_graphs(graph) for node in module.graph.nodes if _random_op(node)]
        if drawn:
            raise RandomOpNotFixed(
                f"{_random_op(drawn[0])} in {_fixed} draws random numbers inside a compiled block, which verify "
                f"cannot fix; verify the plan with --compile off (the same model, run eager)"
            )
    return torch._dynamo.lookup_backend("inductor")(graph, example_inputs)


def _random_op(node: torch.fx.Node) -> str:
    """The name of a random torch function or method a dynamo graph node calls with its randomness on, or ""."""
    if node.op not in ("call_function", "call_method"):
        return ""
    name = base_name(node.target if isinstance(node.target, str) else getattr(node.target, "__name__", ""))
    if name not in RANDOM_OPS:
        return ""
    switch = RANDOM_SWITCHES.get(name)
    if switch == "dropout_p":
        args = node.args
        value = node.kwargs.get(switch, args[SDPA_DROPOUT_ARG] if len(args) > SDPA_DROPOUT_ARG else 0.0)
        return name if value else ""
    return name
