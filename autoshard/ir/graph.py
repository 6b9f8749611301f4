"""OpGraph: the captured model as a flat list of operators with shapes and costs.

``passes/capturing/capture`` fills nodes and params from ``torch.export``; ``passes/capturing/annotate`` fills
``flops``/``bytes_*``; ``passes/capturing/blocks`` fills ``blocks``, ``passes/capturing/experts`` ``experts``. Every later pass reads only this
object, never the ``nn.Module``, so plans are made from meta tensors alone.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

# Bytes per element of the dtypes a captured graph can name (``str(torch.dtype)`` minus "torch.").
DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (e.g. "bfloat16" -> 2); 0 for "" (no tensor)."""
    if not dtype:
        return 0
    if dtype not in DTYPE_BYTES:  # a rarer dtype: ask torch (imported only then)
        import torch

        return getattr(torch, dtype).itemsize
    return DTYPE_BYTES[dtype]


def tensor_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a dense tensor: prod(shape) · bytes per element."""
    n = 1
    for d in shape:
        n *= d
    return n * dtype_bytes(dtype)


@dataclass
class OpNode:
    """One ``call_function`` node of the exported graph (placeholders and output excluded)."""

    name: str
    target: str  # e.g. "aten.linear.default"
    module_path: str  # innermost owning module, "" for the root, e.g. "h.0.attn.c_attn"
    module_type: str  # qualified class name of that module, e.g. "torch.nn.modules.linear.Linear"
    inputs: tuple[str, ...]  # names of producer nodes or placeholders, in argument order
    shape: tuple[int, ...]  # shape of the first tensor output, () for scalars / none
    dtype: str  # e.g. "float32"; "" when the node has no tensor output
    param_inputs: tuple[str, ...] = ()  # fully qualified parameter names this node reads
    flops: int = 0  # forward FLOPs (multiply-add = 2)
    bytes_read: int = 0
    bytes_written: int = 0
    # Non-tensor arguments by schema name, as plain Python values, e.g. {"dim0": 1, "dim1": 2},
    # {"p": 0.0, "train": True}; positional ones of non-aten targets are "arg0", "arg1", ...
    attrs: dict[str, Any] = field(default_factory=dict)
    # Tensor outputs after the first, as (shape, dtype), for ops that return several.
    extra_outputs: tuple[tuple[tuple[int, ...], str], ...] = ()

    @property
    def output_numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def output_bytes(self) -> int:
        """Bytes of all tensor outputs (the first and ``extra_outputs``)."""
        extra = sum(tensor_bytes(shape, dtype) for shape, dtype in self.extra_outputs)
        return tensor_bytes(self.shape, self.dtype) + extra


@dataclass
class ParamInfo:
    """A parameter (or buffer with ``is_buffer``). Tied parameters appear once, under ``name``."""

    name: str  # fully qualified, e.g. "h.0.attn.c_attn.weight"
    shape: tuple[int, ...]
    dtype: str
    module_path: str  # owning module, e.g. "h.0.attn.c_attn"
    is_buffer: bool = False
    tied_to: tuple[str, ...] = ()  # other names of the same tensor

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def hidden_backward_units(graph: OpGraph) -> tuple[str, ...]:
    """The FSDP units an autograd Function's own backward runs again out of FSDP2's sight: each block called inside
    one (``hidden_backward``), and each module outside the blocks holding parameters called inside one (the root
    unit's). A block that calls such a Function around its own layers is not one: FSDP2 hooks the block's outputs."""
    inside = set(graph.hidden_backward)
    if not inside:
        return ()
    blocks = tuple(b.path for b in graph.blocks)
    loose = {
        p.module_path
        for p in graph.params
        if not p.is_buffer
        and p.module_path in inside
        and not any(p.module_path == b or p.module_path.startswith(b + ".") for b in blocks)
    }
    return tuple(b for b in blocks if b in inside) + tuple(sorted(loose))


def unread_params(graph: OpGraph) -> tuple[str, ...]:
    """The trainable parameters the captured forward never reads (a vision tower a text-only batch leaves out),
    each under the outermost module all of whose parameters are unread, else its own name, sorted: a short list
    for a program to name. DDP must leave them out of its buckets (their gradients never come); one process leaves
    them untouched."""
    read = {name for node in graph.nodes for name in node.param_inputs}
    params = [p.name for p in graph.params if not p.is_buffer]
    unread = {name for name in params if name not in read}
    if not unread:
        return ()
    read_prefixes = {
        name.rsplit(".", depth)[0] for name in params if name not in unread for depth in range(name.count(".") + 1)
    }
    covered = set()
    for name in sorted(unread):
        parts = name.split(".")
        outermost = next(
            (".".join(parts[:k]) for k in range(1, len(parts)) if ".".join(parts[:k]) not in read_prefixes), name
        )
        covered.add(outermost)
    return tuple(sorted(covered))


@dataclass
class Block:
    """A module that the planner treats as a unit (FSDP wrap, recompute, pipeline cut).

    Repeated blocks (``h.0`` ... ``h.11``) share ``signature``; ``representative`` is the path
    of the first block with that signature, whose numbers stand for all of them.
    """

    path: str  # module path, e.g. "h.3"
    signature: str  # hash of the block's op structure and shapes
    representative: str  # path of the first block with this signature
    node_names: tuple[str, ...]  # OpNodes inside the block, in graph order
    param_count: int  # parameters owned by the block
    flops_fwd: int  # forward FLOPs of the block's nodes
    activation_bytes: int  # bytes saved for backward by the block's nodes (no recompute)
    input_bytes: int  # bytes of the block's input activation (what full recompute keeps)


@dataclass(frozen=True)
class ExpertGroup:
    """A mixture-of-experts layer's experts (``passes.capturing.experts``): one module whose parameters are
    stacked along dim 0, one slice per expert, read only by grouped matmuls (each token-expert pair
    multiplies its own expert's slice), so the experts can live on different ranks.

    Per forward of the captured batch (T tokens): ``pairs`` = T·k token-expert pairs of ``hidden``
    features each are dispatched, and ``flops_fwd`` are the grouped matmuls' FLOPs on them."""

    path: str  # the experts module, e.g. "model.layers.3.mlp.experts"
    experts: int  # E, the stacked dim of every parameter
    top_k: int  # k experts per token: pairs / tokens
    hidden: int  # features of a dispatched token (the first grouped matmul's input width)
    pairs: int  # T·k at the captured batch
    params: tuple[str, ...]  # the stacked parameters
    param_count: int
    flops_fwd: int
    block: str  # the block holding it ("" outside blocks)


@dataclass
class OpGraph:
    """A captured model. ``batch_size`` is the example batch size it was captured at."""

    nodes: list[OpNode]
    params: list[ParamInfo]
    input_shapes: list[tuple[int, ...]]
    batch_size: int
    tokens_per_sample: int  # sequence length for token models, 1 otherwise
    module_types: dict[str, str] = field(default_factory=dict)  # module path -> class name
    blocks: list[Block] = field(default_factory=list)  # filled by passes/capturing/blocks
    experts: list[ExpertGroup] = field(default_factory=list)  # filled by passes/capturing/experts
    # Graph inputs that OpNode.inputs may name besides other nodes (filled by passes/capturing/capture):
    input_names: list[str] = field(default_factory=list)  # user-input placeholders, as input_shapes
    placeholder_params: dict[str, str] = field(default_factory=dict)  # placeholder -> param/buffer name
    placeholders: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)  # -> (shape, dtype)
    fold: Any = None  # passes.capturing.fold.Fold while the repeated layers are captured two of L (until unfold)
    model_fingerprint: str = ""  # runtime.model.model_fingerprint of the captured model (filled by capture)
    # passes/capturing/tp_proof: str(tp) -> {node: why its computation on a tp shard is refused}, for every degree
    # checked against the model's code; None when the graph was never checked (hand-built graphs).
    tp_proofs: dict[str, dict[str, str]] | None = None
    # passes/capturing/cp_proof: str(cp) or "*" (every other degree) -> why a cp rank's program, the model's code on its
    # s/cp tokens, was not shown to compute its share of the one-process one ("" = proven); None when the graph
    # was never checked (hand-built graphs).
    cp_proofs: dict[str, str] | None = None
    # passes/capturing/batch_coupling: why the loss of a batch is not the mean of its shares' losses ("" = it is; None = not
    # checked: a hand-built graph, or a model too large to run for the check).
    batch_coupling: str | None = None
    # passes/capturing/capture: the modules called inside an autograd Function's forward (Reformer's reversible layers),
    # whose backward, which export does not see, may run them again (``hidden_backward_units``). Sorted paths.
    hidden_backward: tuple[str, ...] = ()
    # passes/capturing/tp_proof (``prove_loss_parallel``): why the loss is not shown to be the default cross-entropy on
    # the output projection's logits through elementwise ops only, which loss parallelism computes on vocabulary
    # shards ("" = it is; None = not checked: a hand-built graph)
    loss_parallel_proof: str | None = None
    # passes/capturing/fold's unfold: module path of a copied layer -> the captured layer it was copied from, for
    # the copies whose neighbours are copies too (copy k reads copy k-1 as the source reads the layer before it,
    # and copy k+1 reads copy k as the first copy reads the source), so every per-block figure of the source is
    # the copy's by construction (``per_block``). Empty when nothing was folded.
    layer_twins: dict[str, str] = field(default_factory=dict)

    def node(self, name: str) -> OpNode:
        return self._by_name()[name]

    def _by_name(self) -> dict[str, OpNode]:
        cache = self.__dict__.get("_by_name_cache")
        if cache is None or len(cache) != len(self.nodes):
            cache = {n.name: n for n in self.nodes}
            self.__dict__["_by_name_cache"] = cache
        return cache

    def derived(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per ``key``: a pure function of this graph that the search reads many
        times (a value's readers, weight bytes per node, each unit's parameters). Passes that change
        a graph return a new one, except ``blocks``, which fills ``blocks`` in place: the sizes of
        nodes, params and blocks are part of the key, so a value from before it is not reused."""
        memo = self.__dict__.setdefault("_derived_cache", {})
        full_key = (key, len(self.nodes), len(self.params), len(self.blocks))
        if full_key not in memo:
            memo[full_key] = compute()
        return memo[full_key]

    def per_block(self, key: Hashable, compute: Callable[[Block], Any]) -> tuple[Any, ...]:
        """``compute(block)`` for each block in order, computed once per block that is not a twin
        (``layer_twins``; a twin takes its source's value, which must be immutable), once per ``key``
        (as ``derived``). A 126-layer model folded at capture walks 3 layers instead of 126."""

        def compute_all() -> tuple[Any, ...]:
            by_path = {b.path: compute(b) for b in self.untwinned_blocks()}
            return tuple(
                by_path[b.path] if b.path in by_path else by_path[self.layer_twins[b.path]] for b in self.blocks
            )

        return self.derived(("per_block", key), compute_all)

    def untwinned_blocks(self) -> list[Block]:
        """The blocks ``per_block`` computes: all but the twins (``layer_twins``) whose source is a block."""
        paths = {b.path for b in self.blocks}
        return [b for b in self.blocks if self.layer_twins.get(b.path) not in paths]

    def value_meta(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, dtype) of anything ``OpNode.inputs`` names: a node's first output or a placeholder."""
        node = self._by_name().get(name)
        if node is not None:
            return node.shape, node.dtype
        return self.placeholders[name]

    def value_bytes(self, name: str) -> int:
        return tensor_bytes(*self.value_meta(name))

    def param(self, name: str) -> ParamInfo:
        """The parameter or buffer called ``name`` (or tied to it)."""
        cache = self.__dict__.get("_param_cache")
        if cache is None or len(cache) < len(self.params):
            cache = {alias: p for p in self.params for alias in (p.name, *p.tied_to)}
            self.__dict__["_param_cache"] = cache
        return cache[name]

    @property
    def block_paths(self) -> list[str]:
        return [b.path for b in self.blocks]

    @property
    def param_count(self) -> int:
        return sum(p.numel for p in self.params if not p.is_buffer)

    @property
    def flops_fwd(self) -> int:
        return self.derived("flops_fwd", lambda: sum(n.flops for n in self.nodes))  # read once per priced plan
