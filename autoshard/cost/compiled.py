"""Compiled blocks on a GPU (``--compile on``, ``runtime.compiled``): what inductor's kernels move.

Inductor keeps a block's matmuls and attention as library calls (cuBLAS, FlashAttention: priced as eager,
``cost.eager``) and fuses the block's other ops: each connected run of them (a fusion group: the block's ops
that are neither matmuls, attention nor convolutions, joined where one reads another's output; views join
them and move nothing) becomes one kernel that reads what enters the group and writes what leaves it. For an
op n of group g, with out(i) the bytes of i's output::

    read(n)    = bytes_read(n) − weight(n) − Σ_{i ∈ inputs(n), i a non-view op of g (or a view of one)} out(i)
    written(n) = bytes_written(n) if n's output is read outside g (directly or through views) or by nothing, else 0
    t_fwd(g)   = T_KERNEL + Σ_{n∈g} (read(n)·r + weight(n) + written(n)·r) / W      (r: the micro-batch's scale and
                                                                                   the activation bytes' ratio)
    t_bwd(g)   = 2·t_fwd(g)                        (the eager rule for elementwise ops, on the fused bytes)

A group that moves nothing (views only) is no kernel. Two reads of one outside tensor count twice (inductor
may read it once): an upper bound. Under autocast the activation casts fuse into the kernel that writes the
activation (no copy kernel); a matmul's weight cast stays. The host: inductor's wrapper launches each kernel
without eager dispatch or autograd's per-op bookkeeping, so a compiled block's host time is its kernels
(matmuls, attention, groups) × ``eager.LAUNCH_US``, forward and backward. Memory is priced as eager (what the
AOT partitioner saves for backward is not modelled). Ops outside the blocks (embeddings, the last norm, the
head, the loss) run eager: only blocks are compiled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autoshard.cost import eager
from autoshard.cost.autocast import NodeTraffic
from autoshard.cost.compute import weight_bytes_per_node
from autoshard.ir.graph import OpGraph, OpNode

LIBRARY_TARGETS = (
    *eager.MATMUL_2D_TARGETS,
    *eager.MATMUL_BATCHED_TARGETS,
    "aten.scaled_dot_product_attention",
    "aten.convolution",
    "aten.conv1d",
    "aten.conv2d",
    "aten.conv3d",
)


@dataclass(frozen=True)
class FusedOp:
    """One fused op's bytes at the captured batch (module doc): activations read from outside its group,
    activations written for outside it, and whether it carries its group's kernel."""

    read_bytes: int
    written_bytes: int
    starts_kernel: bool


def is_view(node: OpNode) -> bool:
    return node.bytes_read == 0 and node.bytes_written == 0


def fused_ops(graph: OpGraph) -> dict[str, FusedOp]:
    """``FusedOp`` of every fused op of the blocks (module doc), by node name; computed once per graph."""
    return graph.derived("compiled_fused_ops", lambda: _fused_ops(graph))


def block_kernels(graph: OpGraph) -> dict[str, int]:
    """Kernels per block path when compiled: its library calls and its fusion groups that move bytes."""

    def compute():
        fused = fused_ops(graph)
        kernels = {}
        for block in graph.blocks:
            nodes = [graph.node(n) for n in block.node_names]
            library = sum(n.target.startswith(LIBRARY_TARGETS) for n in nodes)
            kernels[block.path] = library + sum(fused[n.name].starts_kernel for n in nodes if n.name in fused)
        return kernels

    return graph.derived("compiled_block_kernels", compute)


def compiled_traffic(traffic: NodeTraffic | None) -> NodeTraffic | None:
    """A library call's autocast traffic in a compiled block: its activation casts fused away, weights' kept."""
    if traffic is None:
        return None
    return replace(
        traffic, forward_cast_bytes=0, forward_cast_kernels=0, backward_cast_bytes=0, backward_cast_kernels=0
    )


def _fused_ops(graph: OpGraph) -> dict[str, FusedOp]:
    group: dict[str, str] = {}  # fused op -> its group's root (union-find)

    def root(name: str) -> str:
        while group[name] != name:
            group[name] = group[group[name]]
            name = group[name]
        return name

    weights = weight_bytes_per_node(graph)
    consumers: dict[str, list[str]] = {}
    for node in graph.nodes:
        for i in node.inputs:
            consumers.setdefault(i, []).append(node.name)
    for block in graph.blocks:
        members = {n for n in block.node_names if not graph.node(n).target.startswith(LIBRARY_TARGETS)}
        for name in members:
            group[name] = name
        for name in members:
            for i in graph.node(name).inputs:
                if i in members:
                    group[root(i)] = root(name)
    escapes = _escaping(graph, group, root, consumers)
    fused: dict[str, FusedOp] = {}
    kernel_of: set[str] = set()
    for node in graph.nodes:
        if node.name not in group:
            continue
        if is_view(node):
            fused[node.name] = FusedOp(0, 0, False)
            continue
        internal = sum(
            graph.node(i).output_bytes for i in node.inputs if _made_inside(graph, i, node.name, group, root)
        )
        read = max(0, node.bytes_read - weights.get(node.name, 0) - internal)
        written = node.bytes_written if escapes[node.name] else 0
        starts = (read or written or weights.get(node.name)) and root(node.name) not in kernel_of
        if starts:
            kernel_of.add(root(node.name))
        fused[node.name] = FusedOp(read, written, bool(starts))
    return fused


def _made_inside(graph: OpGraph, value: str, reader: str, group: dict[str, str], root) -> bool:
    """Whether ``value`` (an input of ``reader``) is made by a non-view op of reader's group, through views."""
    while value in group and root(value) == root(reader):
        node = graph.node(value)
        if not is_view(node):
            return True
        if not node.inputs:
            return False
        value = node.inputs[0]
    return False


def _escaping(graph: OpGraph, group: dict[str, str], root, consumers: dict[str, list[str]]) -> dict[str, bool]:
    """Each fused op: whether its output is read outside its group (through views) or by nothing."""
    escapes: dict[str, bool] = {}
    for node in reversed(graph.nodes):
        if node.name not in group:
            continue
        readers = consumers.get(node.name, [])
        escapes[node.name] = not readers or any(
            r not in group or root(r) != root(node.name) or (is_view(graph.node(r)) and escapes.get(r, True))
            for r in readers
        )
    return escapes
