"""Experts: the mixture-of-experts layers of a graph whose experts may live on different ranks.

A module M is an expert group (``ir.graph.ExpertGroup``) when the graph proves that each of its
parameters is a stack of E ≥ 2 per-expert slices along dim 0 and that each token-expert pair only
ever reads its own expert's slice:

    every parameter P of M (not a buffer) has rank ≥ 2 and P.shape[0] = E, the same E for all;
    every use of P is, through views that keep dim 0 in place (``transpose`` / ``permute`` of the
    other dims), either the weight of a grouped matmul (``GROUPED_MATMULS``: row r of the input
    multiplies slice e(r) of the weight, e given by the offsets), or the indexed tensor of a row
    gather ``P[expert_ids]`` (a per-expert bias);
    the grouped matmuls' input rows S are a multiple of the captured tokens T: k = S / T experts
    per token.

Anything else (an expert stored as an ``nn.Linear`` in a module list, a stacked weight summed
over dim 0, a loop over experts indexing the weight, which capture could not follow anyway) is
not a group and stays dense: replicated, or sharded by the other axes. The runtime dispatches
tokens to the rank holding their expert through the module's forward contract, transformers'
experts interface ``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``
(``runtime.expert_parallel``), which it checks on the real module.
"""

from __future__ import annotations

from autoshard.ir.graph import ExpertGroup, OpGraph, OpNode
from autoshard.ir.names import block_of

GROUPED_MATMULS = frozenset(
    {
        "aten._grouped_mm.default",  # torch's grouped GEMM (torch.nn.functional.grouped_mm lowers to it)
        "transformers.grouped_mm_fallback.default",  # transformers' loop over the groups where torch has none
    }
)
ROW_GATHERS = frozenset({"aten.index.Tensor"})
# Views that keep dim 0 where it is when dim 0 is not among their dims (attrs checked by ``_keeps_dim0``).
DIM0_VIEWS = frozenset({"aten.transpose.int", "aten.permute.default"})


def find_experts(graph: OpGraph) -> OpGraph:
    """Fill ``graph.experts`` with every expert group, in parameter order (in place; returns graph)."""
    readers = _readers(graph)
    tokens = graph.batch_size * graph.tokens_per_sample
    groups = []
    for path, params in _stacked_modules(graph).items():
        group = _expert_group(graph, path, params, readers, tokens)
        if group is not None:
            groups.append(group)
    graph.experts = groups
    return graph


def _stacked_modules(graph: OpGraph) -> dict[str, list]:
    """Module path -> its parameters, for modules whose parameters all stack E ≥ 2 slices on dim 0."""
    by_module: dict[str, list] = {}
    for p in graph.params:
        if not p.is_buffer:
            by_module.setdefault(p.module_path, []).append(p)
    return {
        path: params
        for path, params in by_module.items()
        if all(len(p.shape) >= 2 for p in params) and len({p.shape[0] for p in params}) == 1 and params[0].shape[0] >= 2
    }


def _expert_group(
    graph: OpGraph, path: str, params: list, readers: dict[str, list[OpNode]], tokens: int
) -> ExpertGroup | None:
    matmuls: list[OpNode] = []
    for p in params:
        uses = _param_uses(graph, p.name, readers)
        if uses is None:
            return None
        matmuls += uses
    matmuls = [n for n in {n.name: n for n in matmuls}.values() if n.target in GROUPED_MATMULS]
    if not matmuls or tokens < 1:
        return None
    pairs = graph.value_meta(matmuls[0].inputs[0])[0][0]
    if pairs % tokens or any(graph.value_meta(n.inputs[0])[0][0] != pairs for n in matmuls):
        return None
    return ExpertGroup(
        path=path,
        experts=params[0].shape[0],
        top_k=pairs // tokens,
        hidden=graph.value_meta(matmuls[0].inputs[0])[0][-1],
        pairs=pairs,
        params=tuple(p.name for p in params),
        param_count=sum(p.numel for p in params),
        flops_fwd=sum(n.flops for n in matmuls),
        block=block_of(path) or "",
    )


def _param_uses(graph: OpGraph, name: str, readers: dict[str, list[OpNode]]) -> list[OpNode] | None:
    """The grouped matmuls and row gathers that read parameter ``name`` (through dim-0-keeping views);
    None when any other op reads it."""
    placeholder = next((k for k, v in graph.placeholder_params.items() if v == name), None)
    frontier = [(n, name if placeholder is None else placeholder) for n in readers.get(name, [])]
    if placeholder is not None:
        frontier += [(n, placeholder) for n in readers.get(placeholder, []) if (n, placeholder) not in frontier]
    uses: list[OpNode] = []
    while frontier:
        node, value = frontier.pop()
        if (
            node.target in GROUPED_MATMULS
            and len(node.inputs) > 1
            and node.inputs[1] == value
            and value not in node.inputs[:1]
        ):
            uses.append(node)
        elif node.target in ROW_GATHERS and node.inputs and node.inputs[0] == value:
            uses.append(node)
        elif node.target in DIM0_VIEWS and _keeps_dim0(node, len(graph.value_meta(value)[0])):
            frontier += [(n, node.name) for n in readers.get(node.name, [])]
        else:
            return None
    return uses


def _keeps_dim0(node: OpNode, rank: int) -> bool:
    """A transpose of two other dims, or a permute whose first dim is 0."""
    if node.target == "aten.transpose.int":
        return 0 not in (node.attrs.get("dim0", 0) % rank, node.attrs.get("dim1", 0) % rank)
    dims = node.attrs.get("dims") or []
    return bool(dims) and dims[0] % rank == 0


def _readers(graph: OpGraph) -> dict[str, list[OpNode]]:
    """Value or parameter name -> the nodes reading it (by input or by ``param_inputs``)."""
    out: dict[str, list[OpNode]] = {}
    for node in graph.nodes:
        for name in dict.fromkeys((*node.inputs, *node.param_inputs)):
            out.setdefault(name, []).append(node)
    return out
