"""The TP proof's local program (``tp_proof`` step 2): styled modules stood in for by one tp rank's output shape,
the sequence-parallel hooks' input changes run as custom ops, and what the model's code does with a stood-in
module's parameters outside it watched.

A styled module runs its own code on DTensors at run time; the code between styled modules runs on plain local
tensors, and that is what the proof exports and compares (``tp_proof``'s module doc).
"""

from __future__ import annotations

import traceback
from functools import partial, wraps

import torch
import torch.nn as nn

from autoshard.ir.decisions import MAX_SEQ_DIM
from autoshard.ir.names import op_name
from autoshard.passes.capturing.capture import is_user_file, short_path, target_name


def stand_in_shards(model: nn.Module, styles: dict[str, str], tp: int) -> dict[str, nn.Module]:
    """Each styled module's forward replaced (in place) by a ``_ShardStandIn`` giving its tp-rank output shape;
    each block with ``scatter-seq-input-dim{d}`` slices its first positional input (``_ScatterHook``). Returns the
    stood-in modules by path.

    A styled module runs its own code on DTensors (global shapes, DTensor's own sharding rules), so it
    is not what is checked here; what is checked is the code *between* styled modules, which runs on
    plain local tensors. The module itself stays as ``parallelize_module`` leaves it: its attributes
    (``in_features``, ``num_embeddings``, ``padding_idx``, ...), its methods and type, and its parameters, which
    at run time are DTensors of the whole shape on the module's device and dtype; here they are the meta
    tensors of the whole shape that capture built. What the model's code does with them outside the module is
    watched (``ParamWatch``)."""
    stood: dict[str, nn.Module] = {}
    for path, style in styles.items():
        if style not in STAND_INS and not style.startswith((SCATTER_INPUT, GATHER_MODULE_INPUT, GATHER_INPUT)):
            continue
        try:
            module = model.get_submodule(path)
        except AttributeError:  # a layer that folding removed
            continue
        if style.startswith(SCATTER_INPUT):
            module.register_forward_pre_hook(_ScatterHook(int(style[len(SCATTER_INPUT) :]), tp))
            continue
        if style.startswith(GATHER_MODULE_INPUT):
            module.register_forward_pre_hook(_GatherHook(int(style[len(GATHER_MODULE_INPUT) :]), tp), with_kwargs=True)
            continue
        if style.startswith(GATHER_INPUT):  # PrepareModuleInput: exactly one positional argument
            module.register_forward_pre_hook(
                _GatherHook(int(style[len(GATHER_INPUT) :]), tp, positional=True), with_kwargs=True
            )
            continue
        shard_features, seq = STAND_INS[style]
        features = _features(module)
        module.forward = _ShardStandIn(features // tp if shard_features else features, style, seq, tp)
        stood[path] = module
    return stood


def _stand_ins() -> dict[str, tuple[bool, tuple[str, int] | None]]:
    """style -> (whether its output features are a shard, what it does to the sequence dim: ("gather", d) multiplies
    it by tp, ("split", d) divides it, None keeps it)."""
    out = {
        "colwise": (True, None),
        "colwise-gather": (False, None),
        "rowwise": (False, None),
        "conv1d-colwise": (True, None),
        "conv1d-rowwise": (False, None),
        "vocab-parallel-embedding": (False, None),
    }
    for d in range(MAX_SEQ_DIM):
        out |= {
            f"colwise-seq-input-dim{d}": (True, ("gather", d)),
            f"colwise-gather-seq-input-dim{d}": (False, ("gather", d)),
            f"conv1d-colwise-seq-input-dim{d}": (True, ("gather", d)),
            f"rowwise-seq-output-dim{d}": (False, ("split", d)),
            f"conv1d-rowwise-seq-output-dim{d}": (False, ("split", d)),
            f"vocab-parallel-embedding-seq-output-dim{d}": (False, ("split", d)),
            f"scatter-seq-output-dim{d}": (False, ("split", d)),
        }
    return out


STAND_INS = _stand_ins()
SCATTER_INPUT = "scatter-seq-input-dim"
GATHER_MODULE_INPUT = "gather-seq-module-input-dim"
GATHER_INPUT = "gather-seq-input-dim"
SEQ_HOOKS = (SCATTER_INPUT, GATHER_MODULE_INPUT, GATHER_INPUT)  # styles whose hooks change a module's input


def _features(module: nn.Module) -> int:
    """Output features: a Conv1D's nf, an embedding's dim, an nn.Linear's out_features."""
    if hasattr(module, "nf"):
        return module.nf
    if isinstance(module, nn.Embedding):
        return module.embedding_dim
    return module.weight.shape[0]


class _ShardStandIn:
    """The forward of one tp rank's styled module: (*x.shape[:-1], features), or (*ids.shape, features) for an
    embedding, with the sequence dim gathered (× tp) or split (÷ tp) where the style does so. It is set on the
    module itself (``stand_in_shards``), which keeps everything else."""

    def __init__(self, features: int, style: str, seq: tuple[str, int] | None = None, tp: int = 1):
        self.features, self.seq, self.tp = features, seq, tp
        self.embedding = style.startswith("vocab-parallel-embedding")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = list(x.shape) if self.embedding else list(x.shape[:-1])
        if self.seq is not None:
            how, d = self.seq
            lead[d] = lead[d] * self.tp if how == "gather" else lead[d] // self.tp
        dtype = torch.get_default_dtype() if self.embedding else x.dtype
        return x.new_zeros((*lead, self.features), dtype=dtype)  # made from x: what fed x is used (live_param_uses)


# What the model's code may read of a sharded parameter outside its module: the same on every rank and in
# both runtimes (DTensor parameters; the local shards inside pipeline stages, ``runtime.tensor_parallel_stages``).
SAME_EVERYWHERE = frozenset(
    {
        "device",
        "dtype",
        "layout",
        "requires_grad",
        "is_leaf",
        "grad_fn",
        "ndim",
        "dim",
        "get_device",
        "is_cuda",
        "is_cpu",
        "is_meta",
        "is_mps",
        "is_xpu",
        "is_sparse",
        "is_quantized",
        "is_mkldnn",
        "is_nested",
        "is_floating_point",
        "is_complex",
        "is_signed",
        "element_size",
        "itemsize",
        "names",
    }
)
# Reads that differ between them: a DTensor's size is the whole tensor's, a stage's local shard its own slice.
SIZE_READS = frozenset({"shape", "size", "numel", "nelement", "nbytes", "stride", "__len__", "storage_offset"})


class ParamWatch(torch.overrides.TorchFunctionMode):
    """While the model's forward runs (``around_forward``), every torch call on a stood-in module's parameter:
    ``reads`` holds (parameter, what was called, "size" | "compute", the model's file:line) for each call outside
    ``SAME_EVERYWHERE``. The stand-ins' own forwards never touch their parameters, so every such call is the
    model's code reading a sharded parameter outside its module."""

    def __init__(self, stood: dict[str, nn.Module]):
        super().__init__()
        self.stood = stood
        self.params = {
            f"{path}.{name}" for path, m in stood.items() for name, p in m._parameters.items() if p is not None
        }
        self.owners: dict[int, str] = {}
        self.reads: list[tuple[str, str, str, str]] = []

    def around_forward(self, model: nn.Module) -> None:
        """``model.forward`` (the instance's, so export reads the same signature) run under this watch, with the
        parameters as they are then (export swaps in fake ones for the trace)."""
        if not self.stood:
            return
        bound = model.forward

        @wraps(bound)
        def forward(*args, **kwargs):
            self.owners = {
                id(p): f"{path}.{name}"
                for path, m in self.stood.items()
                for name, p in m._parameters.items()
                if p is not None
            }
            with self:
                return bound(*args, **kwargs)

        model.forward = forward

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = self._watched(args) or (self._watched(kwargs.values()) if kwargs else "")
        if hit:
            what = _called(func)
            if what not in SAME_EVERYWHERE:
                self.reads.append((hit, what, "size" if what in SIZE_READS else "compute", _model_location()))
        return func(*args, **kwargs)

    def _watched(self, values) -> str:
        """The watched parameter among ``values`` (tensors, or lists of them, as torch calls take), or ""."""
        for v in values:
            if isinstance(v, (list, tuple)):
                found = self._watched(v)
                if found:
                    return found
            elif isinstance(v, torch.Tensor) and id(v) in self.owners:
                return self.owners[id(v)]
        return ""


def _called(func) -> str:
    """A torch function's name: an attribute's (``shape``, ``device``) for a property read."""
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") == "__get__" and owner is not None:
        return getattr(owner, "__name__", "__get__")
    return getattr(func, "__name__", str(func))


def _model_location() -> str:
    """ "file.py:7 (`code`)" of the innermost frame of the model's own code on the Python stack."""
    for frame in reversed(traceback.extract_stack()):
        if is_user_file(frame.filename):
            code = f" (`{frame.line.strip()}`)" if frame.line and frame.line.strip() else ""
            return f"{short_path(frame.filename)}:{frame.lineno}{code}"
    return "the model's code"


def live_param_uses(program: torch.export.ExportedProgram, params: set[str]) -> dict[str, set[str]]:
    """The watched parameters that an op of the exported program computes with and whose result reaches the
    program's output, with those ops' names (a call whose result the code drops, or a cast that returns the
    tensor itself, makes no such op). A stand-in's output is made from its input (``x.new_zeros``), so what
    reaches a styled module reaches the output too."""
    nodes = list(program.graph.nodes)
    live, frontier = set(), [n for n in nodes if n.op == "output"]
    while frontier:
        for x in frontier.pop().all_input_nodes:
            if x not in live:
                live.add(x)
                frontier.append(x)
    fqn_of = program.graph_signature.inputs_to_parameters
    out: dict[str, set[str]] = {}
    for n in nodes:
        if n.op == "placeholder" and fqn_of.get(n.name) in params:
            ops = {op_name(target_name(u.target)) for u in n.users if u in live and u.op == "call_function"}
            if ops:
                out[fqn_of[n.name]] = ops
    return out


@torch.library.custom_op("autoshard::tp_proof_scatter", mutates_args=())
def _scatter_op(x: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (the proof's stand-in for ScatterSequenceInput)."""
    return x.narrow(dim, 0, x.shape[dim] // parts).clone()


@_scatter_op.register_fake
def _(x: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] //= parts
    return x.new_empty(shape)


class _ScatterHook:
    """Forward pre-hook: the block's first positional input sliced to 1/tp along dim d, as
    ``runtime.tensor_parallel.ScatterSequenceInput`` does (kwargs untouched: the comparison then finds the
    block reading a whole tensor where the layout has its shard)."""

    def __init__(self, dim: int, tp: int):
        self.dim, self.tp = dim, tp

    def __call__(self, module: nn.Module, args: tuple):
        if args and isinstance(args[0], torch.Tensor):
            return (torch.ops.autoshard.tp_proof_scatter(args[0], self.dim, self.tp), *args[1:])
        return None


@torch.library.custom_op("autoshard::tp_proof_gather", mutates_args=())
def _gather_op(x: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    """``x`` repeated ``parts`` times along ``dim`` (the proof's stand-in for GatherSequenceInput)."""
    return torch.cat([x] * parts, dim)


@_gather_op.register_fake
def _(x: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= parts
    return x.new_empty(shape)


class _GatherHook:
    """Forward pre-hook (with kwargs): the module's first tensor argument, positional or else keyword, gathered
    to tp times its tokens along dim d, as ``runtime.tensor_parallel.GatherSequenceInput`` does; with
    ``positional`` only a sole positional argument, as torch's PrepareModuleInput with one layout takes."""

    def __init__(self, dim: int, tp: int, positional: bool = False):
        self.dim, self.tp, self.positional = dim, tp, positional

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        grow = partial(torch.ops.autoshard.tp_proof_gather, dim=self.dim, parts=self.tp)
        if self.positional:
            return ((grow(args[0]),), kwargs) if len(args) == 1 and isinstance(args[0], torch.Tensor) else None
        if args and isinstance(args[0], torch.Tensor):
            return (grow(args[0]), *args[1:]), kwargs
        key = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
        return (args, {**kwargs, key: grow(kwargs[key])}) if key is not None else None


def is_proof_hook(fx_node) -> bool:
    return "tp_proof_scatter" in str(fx_node.target) or "tp_proof_gather" in str(fx_node.target)
