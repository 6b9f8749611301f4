"""OpGraph: the captured model as a flat list of operators with shapes and costs.

``passes/capture`` fills nodes and params from ``torch.export``; ``passes/annotate`` fills
``flops``/``bytes_*``; ``passes/blocks`` fills ``blocks``. Every later pass reads only this
object, never the ``nn.Module``, so plans are made from meta tensors alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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

    @property
    def output_numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


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


@dataclass
class OpGraph:
    """A captured model. ``batch_size`` is the example batch size it was captured at."""

    nodes: list[OpNode]
    params: list[ParamInfo]
    input_shapes: list[tuple[int, ...]]
    batch_size: int
    tokens_per_sample: int  # sequence length for token models, 1 otherwise
    module_types: dict[str, str] = field(default_factory=dict)  # module path -> class name
    blocks: list[Block] = field(default_factory=list)  # filled by passes/blocks

    def node(self, name: str) -> OpNode:
        return self._by_name()[name]

    def _by_name(self) -> dict[str, OpNode]:
        cache = self.__dict__.get("_by_name_cache")
        if cache is None or len(cache) != len(self.nodes):
            cache = {n.name: n for n in self.nodes}
            self.__dict__["_by_name_cache"] = cache
        return cache

    @property
    def param_count(self) -> int:
        return sum(p.numel for p in self.params if not p.is_buffer)

    @property
    def flops_fwd(self) -> int:
        return sum(n.flops for n in self.nodes)
