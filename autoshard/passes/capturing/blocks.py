"""Blocks: the repeated units of a model (transformer layers), found from module paths.

A block is a child of a module list or sequence: a module path whose last component is an
integer — "h.3", "model.layers.3", "transformer.h.11", or "2" for a top-level
``nn.Sequential`` — that owns op nodes. A node belongs to the block whose path prefixes its
``module_path``; with nested containers the outermost wins ("h.3.mlp.0" is in block "h.3").
Nodes outside every block (embeddings, final norm, head) stay unassigned.

For a block b with nodes N_b, in graph order (run after ``annotate``; flops come from it)::

    signature(b)         sha256 of the sequence, for n in N_b, of (target, module path relative
                         to b, output shape and dtype, attrs, inputs: an index into N_b, a
                         parameter path relative to b with its shape, or "ext" with its shape)
    representative(b)    the first block (graph order) with b's signature
    param_count(b)       Σ numel of the parameters (not buffers) owned by modules under b
    flops_fwd(b)         Σ_{n∈N_b} flops(n)
    activation_bytes(b)  Σ_{n∈N_b, n not an alias} output_bytes(n)
    input_bytes(b)       Σ bytes of b's external activation inputs that no other block reads

``activation_bytes`` approximates what autograd saves for backward with no recompute: every
materialised intermediate, in the captured dtype. It over-counts outputs that no backward
formula keeps (e.g. a residual sum read only by a norm that saves its own input) and misses
small extras (norm statistics, dropout masks, attention log-sum-exp); SDPA counts only its
output, as flash attention keeps no L×S matrix. ``input_bytes`` is what full recompute keeps:
the block's input activation; tensors read by several blocks (attention masks, rotary tables)
are kept once for all of them, not per block.
"""

from __future__ import annotations

import hashlib

from autoshard.ir.graph import Block, OpGraph, OpNode
from autoshard.ir.names import block_of
from autoshard.passes.capturing.annotate import is_alias

SIGNATURE_HEX_CHARS = 16


def find_blocks(graph: OpGraph) -> OpGraph:
    """Fill ``graph.blocks`` in graph order (in place; returns graph)."""
    members = block_members(graph)
    readers = _blocks_reading(graph, members)
    param_counts = _param_counts(graph)
    blocks: list[Block] = []
    first_with: dict[str, str] = {}
    for path, nodes in members.items():
        signature = block_signature(graph, path, nodes)
        first_with.setdefault(signature, path)
        blocks.append(
            Block(
                path=path,
                signature=signature,
                representative=first_with[signature],
                node_names=tuple(n.name for n in nodes),
                param_count=param_counts.get(path, 0),
                flops_fwd=sum(n.flops for n in nodes),
                activation_bytes=sum(n.output_bytes for n in nodes if not is_alias(graph, n)),
                input_bytes=_input_bytes(graph, path, nodes, readers),
            )
        )
    graph.blocks = blocks
    return graph


def block_members(graph: OpGraph) -> dict[str, list[OpNode]]:
    """Block path -> its nodes, blocks in the order their first node runs."""
    members: dict[str, list[OpNode]] = {}
    for node in graph.nodes:
        path = block_of(node.module_path)
        if path is not None:
            members.setdefault(path, []).append(node)
    return members


def block_signature(graph: OpGraph, path: str, nodes: list[OpNode]) -> str:
    """Short sha256 of the block's op sequence, wiring, shapes and parameter shapes (module doc)."""
    index = {n.name: i for i, n in enumerate(nodes)}
    items = [
        (
            n.target,
            _relative(n.module_path, path),
            n.shape,
            n.dtype,
            n.extra_outputs,
            sorted(n.attrs.items()),
            [_input_key(graph, name, index, path) for name in n.inputs],
        )
        for n in nodes
    ]
    return hashlib.sha256(repr(items).encode()).hexdigest()[:SIGNATURE_HEX_CHARS]


def _input_key(graph: OpGraph, name: str, index: dict[str, int], path: str) -> tuple:
    if name in index:
        return ("node", index[name])
    shape, dtype = graph.value_meta(name)
    if name in graph.placeholder_params:
        return ("param", _relative(graph.placeholder_params[name], path), shape, dtype)
    return ("ext", shape, dtype)


def _relative(name: str, path: str) -> str:
    """ "h.3.attn.q_proj" relative to "h.3" is ".attn.q_proj"; names outside the block stay whole."""
    if name == path or name.startswith(path + "."):
        return name[len(path) :]
    return name


def _param_counts(graph: OpGraph) -> dict[str | None, int]:
    """Parameters (no buffers) of each block path, in one walk of the parameters rather than one per block."""
    counts: dict[str | None, int] = {}
    for p in graph.params:
        if not p.is_buffer:
            path = block_of(p.module_path)
            counts[path] = counts.get(path, 0) + p.numel
    return counts


def _external_inputs(graph: OpGraph, nodes: list[OpNode]) -> list[str]:
    """Activations a block reads from outside: other nodes' outputs and user inputs, no params."""
    inside = {n.name for n in nodes}
    user_inputs = set(graph.input_names)
    names = (name for n in nodes for name in n.inputs if name not in inside)
    return list(dict.fromkeys(name for name in names if name in user_inputs or name not in graph.placeholders))


def _blocks_reading(graph: OpGraph, members: dict[str, list[OpNode]]) -> dict[str, set[str]]:
    """Value name -> the blocks that read it from outside."""
    readers: dict[str, set[str]] = {}
    for path, nodes in members.items():
        for name in _external_inputs(graph, nodes):
            readers.setdefault(name, set()).add(path)
    return readers


def _input_bytes(graph: OpGraph, path: str, nodes: list[OpNode], readers: dict[str, set[str]]) -> int:
    """Bytes of the block's own input activations; the largest external input if all are shared."""
    external = _external_inputs(graph, nodes)
    own = [name for name in external if readers[name] == {path}]
    if own:
        return sum(graph.value_bytes(name) for name in own)
    return max((graph.value_bytes(name) for name in external), default=0)
