"""Pipeline units: the model as [prefix, block_0, ..., block_{L-1}, suffix], each priced alone.

A pipeline stage is a contiguous run of units (``autoshard.passes.stage_cuts``). Node n
belongs to (``node_units``)::

    prefix (unit 0)        nodes before the first block's first node (embeddings)
    block k (unit k + 1)   the nodes of block k, and nodes after it and before block k + 1
                           (``pipeline()`` keeps such glue in the stage of the block before it)
    suffix (unit L + 1)    nodes after the last block (final norm, head, loss)

Per unit u, for a micro-batch of b samples (captured at b₀; t_fwd from
``compute.op_forward_s``, the same roofline as ``compute.microbatch_compute``, attention priced
by the given kernel; ``node_forward_s``)::

    fwd(u) = Σ_{n∈u} t_fwd(n)          bwd(u) = 2·fwd(u)
    recompute(u) = fwd(u) (full) | Σ_{n∈u, not matmul-class} t_fwd(n) (selective) | 0   (blocks only)
    params(u) = Σ numel of the distinct parameters u's nodes read (a tied weight counts in every
                unit that reads it: ``pipeline()`` gives each stage its own copy)
    saved(u)  = block_saved_bytes(block, recompute) for blocks, the outputs of the prefix / suffix
                nodes (the suffix also the loss's copy of the logits), all × (b/b₀)·(a/captured)
    workspace(u) = block_workspace_bytes(block, recompute) × the same scale (what one block's
                recomputation makes again: all its activations (full), its non-matmul outputs
                (selective), 0 (none))
    boundary(k) = input_bytes(block k) × the same scale: what a cut before block k sends

Σ_u saved(u) + max_u workspace(u) equals ``memory.activation_bytes`` of the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.cost.compute import BACKWARD_TO_FORWARD, _weight_bytes_per_node, op_forward_s
from autoshard.cost.memory import COMPUTE_HEAVY_TARGETS, block_saved_bytes, block_workspace_bytes
from autoshard.ir.graph import OpGraph
from autoshard.ir.topology import DeviceSpec


@dataclass(frozen=True)
class Units:
    """Per-micro-batch costs of the L + 2 units (module doc), in unit order."""

    forward_s: tuple[float, ...]
    recompute_s: tuple[float, ...]
    params: tuple[int, ...]
    saved_bytes: tuple[int, ...]
    workspace_bytes: tuple[int, ...]
    boundary_bytes: tuple[int, ...]  # per block (L entries): bytes sent at a cut before it

    @property
    def compute_s(self) -> tuple[float, ...]:
        """fwd + bwd + recompute per unit."""
        return tuple((1 + BACKWARD_TO_FORWARD) * f + r for f, r in zip(self.forward_s, self.recompute_s))

    @property
    def blocks(self) -> int:
        return len(self.forward_s) - 2


def node_units(graph: OpGraph) -> list[int]:
    """The unit index (module doc) of every node, in graph order."""
    block_index = {name: k for k, b in enumerate(graph.blocks) for name in b.node_names}
    units, current = [], 0
    for node in graph.nodes:
        if node.name in block_index:
            current = block_index[node.name] + 1
        units.append(current)
    if graph.blocks:  # nodes after the last block's last node form the suffix
        last = max(i for i, n in enumerate(graph.nodes) if n.name in block_index)
        units[last + 1:] = [len(graph.blocks) + 1] * (len(units) - last - 1)
    return units


def node_forward_s(graph: OpGraph, microbatch_size: int, device: DeviceSpec, activation_elem_bytes: int,
                   captured_bytes: int = 4, attention: str = "flash") -> list[float]:
    """t_fwd of every node of one micro-batch, in graph order (``compute.op_forward_s``)."""
    scale = microbatch_size / graph.batch_size
    ratio = activation_elem_bytes / captured_bytes
    weights = _weight_bytes_per_node(graph)
    return [op_forward_s(node, weights.get(node.name, 0), scale, device, ratio, attention, captured_bytes)
            for node in graph.nodes]


def unit_costs(graph: OpGraph, microbatch_size: int, recompute: str, device: DeviceSpec,
               activation_elem_bytes: int, captured_bytes: int = 4, attention: str = "flash") -> Units:
    """The ``Units`` of one micro-batch of ``microbatch_size`` samples (module doc)."""
    count = len(graph.blocks) + 2
    scale = microbatch_size / graph.batch_size
    ratio = activation_elem_bytes / captured_bytes
    units = node_units(graph)
    forward, light = [0.0] * count, [0.0] * count
    times = node_forward_s(graph, microbatch_size, device, activation_elem_bytes, captured_bytes, attention)
    for node, u, t in zip(graph.nodes, units, times):
        forward[u] += t
        if not node.target.startswith(COMPUTE_HEAVY_TARGETS):
            light[u] += t
    recomputed = {"none": [0.0] * count, "full": forward, "selective": light}[recompute]
    recompute_s = [0.0] + list(recomputed[1:-1]) + [0.0] if graph.blocks else [0.0] * count
    byte_scale = scale * ratio
    return Units(
        forward_s=tuple(forward),
        recompute_s=tuple(recompute_s),
        params=unit_params(graph, units),
        saved_bytes=tuple(int(b * byte_scale) for b in _saved_bytes(graph, recompute, units)),
        workspace_bytes=tuple(int(b * byte_scale) for b in _workspace_bytes(graph, recompute)),
        boundary_bytes=tuple(int(b.input_bytes * byte_scale) for b in graph.blocks),
    )


def stage_ranges(cuts: tuple[int, ...], blocks: int) -> list[tuple[int, int]]:
    """[(c_s, c_{s+1})] for every stage, with c_0 = 0 and c_S = L: stage s holds blocks [c_s, c_{s+1})."""
    edges = [0, *cuts, blocks]
    return list(zip(edges, edges[1:]))


def stage_units(block_range: tuple[int, int], blocks: int) -> list[int]:
    """Unit indices of a stage holding blocks [i, j): the prefix with block 0, the suffix with the last."""
    i, j = block_range
    return ([0] if i == 0 else []) + list(range(i + 1, j + 1)) + ([blocks + 1] if j == blocks else [])


def unit_params(graph: OpGraph, units: list[int]) -> tuple[int, ...]:
    """Parameters (not buffers) read by each unit; a tied one in every unit that reads it."""
    seen: list[set[str]] = [set() for _ in range(len(graph.blocks) + 2)]
    for node, u in zip(graph.nodes, units):
        for name in node.param_inputs:
            p = graph.param(name)
            if not p.is_buffer:
                seen[u].add(p.name)
    return tuple(sum(graph.param(n).numel for n in names) for names in seen)


def _saved_bytes(graph: OpGraph, recompute: str, units: list[int]) -> list[int]:
    saved = [0] * (len(graph.blocks) + 2)
    in_block = {n for b in graph.blocks for n in b.node_names}
    for node, u in zip(graph.nodes, units):
        if node.name not in in_block:
            saved[u] += node.bytes_written
    for k, block in enumerate(graph.blocks):
        saved[k + 1] += block_saved_bytes(graph, block, recompute)
    saved[-1] += graph.nodes[-1].bytes_written if graph.nodes else 0  # the loss's copy of the output
    return saved


def _workspace_bytes(graph: OpGraph, recompute: str) -> list[int]:
    return [0] + [block_workspace_bytes(graph, b, recompute) for b in graph.blocks] + [0]
