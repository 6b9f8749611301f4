"""Collective communication time: the alpha-beta model on one ``LinkSpec``.

A message of S bytes over a link of latency α (``latency_us``) and per-direction bandwidth
B (``bandwidth_gbps``, GB/s) takes α + S/B. A link calibrated per collective
(``LinkSpec.collectives``) gives each collective its own α and B (``LinkSpec.for_collective``).
For p ranks (docs/reference-numbers.md, "Formulas"):

    ring all-reduce     2(p−1)·α       + 2(p−1)/p · S/B      ``ring_allreduce_s``
    tree all-reduce     2⌈log2 p⌉·α    + 2(p−1)/p · S/B      ``tree_allreduce_s``
    all-reduce          min(ring, tree)  (NCCL picks per size) ``allreduce_s``
    reduce-scatter      (p−1)·α        + (p−1)/p · S/B       ``reduce_scatter_s``
    all-gather          (p−1)·α        + (p−1)/p · S/B       ``all_gather_s``
    broadcast           (p−1)·α        + S/B   (pipelined ring) ``broadcast_s``
    point-to-point      α + S/B                               ``p2p_s``

S is always the size of the whole tensor: the all-reduced buffer, the reduce-scatter input,
the all-gather output. A rank of a ring all-reduce sends (and receives) 2(p−1)/p · S
(``ring_allreduce_bytes_per_rank``); nccl-tests report that as busbw = algbw · 2(p−1)/p,
so B here is comparable to a measured busbw. Send and receive overlap on full-duplex links,
hence B is per direction. One rank communicates nothing: p = 1 costs 0.

Worked (docs/reference-numbers.md, α = 0): 64 MiB over 8 ranks → 112 MiB per rank, ≈ 0.13 ms at 900 GB/s
and ≈ 2.35 ms at 50 GB/s; a 25 MiB bucket ≈ 0.051 ms / ≈ 0.92 ms; 2 GB ≈ 3.9 ms / ≈ 70 ms.

Hierarchical all-reduce over n nodes of g ranks (docs/reference-numbers.md; ``hierarchical_allreduce_s``):
reduce-scatter inside each node, all-reduce of the S/g shard across nodes (the g shards go
in g concurrent groups, one per device, each on its device's NIC share), all-gather inside:

    T = RS(S, g, intra) + AR(S/g, n, inter) + AG(S, g, intra)

When inter is no faster than intra (B_inter ≤ B_intra, α_inter ≥ α_intra) this never
exceeds a flat ring over g·n ranks on the inter link: term by term,
2(g−1)α_intra + 2(n−1)α_inter ≤ 2(gn−1)α_inter and
n(g−1)/B_intra + (n−1)/B_inter ≤ (gn−1)/B_inter.
"""

from __future__ import annotations

import math

from autoshard.ir.topology import LinkSpec


def _alone(ranks: int) -> bool:
    """One rank communicates nothing."""
    assert ranks >= 1, f"a collective needs at least one rank, got {ranks}"
    return ranks == 1


def _alpha_s(link: LinkSpec) -> float:
    return link.latency_us * 1e-6


def _beta_s_per_byte(link: LinkSpec) -> float:
    return 1.0 / (link.bandwidth_gbps * 1e9)


def ring_allreduce_bytes_per_rank(size_bytes: float, ranks: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce: 2(p−1)/p · S."""
    assert ranks >= 1, ranks
    return 2 * (ranks - 1) / ranks * size_bytes


def ring_allreduce_s(size_bytes: float, ranks: int, link: LinkSpec) -> float:
    """2(p−1)·α + 2(p−1)/p · S/B."""
    if _alone(ranks):
        return 0.0
    link = link.for_collective("all_reduce")
    return 2 * (ranks - 1) * _alpha_s(link) + ring_allreduce_bytes_per_rank(size_bytes, ranks) * _beta_s_per_byte(link)


def tree_allreduce_s(size_bytes: float, ranks: int, link: LinkSpec) -> float:
    """2⌈log2 p⌉·α + 2(p−1)/p · S/B: a reduce up and a broadcast down a binary tree, pipelined."""
    if _alone(ranks):
        return 0.0
    link = link.for_collective("all_reduce")
    depth = math.ceil(math.log2(ranks))
    return 2 * depth * _alpha_s(link) + ring_allreduce_bytes_per_rank(size_bytes, ranks) * _beta_s_per_byte(link)


def allreduce_s(size_bytes: float, ranks: int, link: LinkSpec) -> float:
    """The faster of ring and tree, as NCCL picks per message size."""
    return min(ring_allreduce_s(size_bytes, ranks, link), tree_allreduce_s(size_bytes, ranks, link))


def reduce_scatter_s(size_bytes: float, ranks: int, link: LinkSpec) -> float:
    """(p−1)·α + (p−1)/p · S/B, S the unsharded input: half a ring all-reduce."""
    return _half_ring_s(size_bytes, ranks, link.for_collective("reduce_scatter"))


def all_gather_s(size_bytes: float, ranks: int, link: LinkSpec) -> float:
    """(p−1)·α + (p−1)/p · S/B, S the gathered output: the other half of a ring all-reduce."""
    return _half_ring_s(size_bytes, ranks, link.for_collective("all_gather"))


def _half_ring_s(size_bytes: float, ranks: int, link: LinkSpec) -> float:
    if _alone(ranks):
        return 0.0
    return (ranks - 1) * _alpha_s(link) + (ranks - 1) / ranks * size_bytes * _beta_s_per_byte(link)


def broadcast_s(size_bytes: float, ranks: int, link: LinkSpec) -> float:
    """(p−1)·α + S/B: a pipelined ring (NCCL's broadcast), S in chunks down the chain."""
    if _alone(ranks):
        return 0.0
    link = link.for_collective("broadcast")
    return (ranks - 1) * _alpha_s(link) + size_bytes * _beta_s_per_byte(link)


def all_to_all_s(bytes_per_rank_sent: float, ranks: int, link: LinkSpec) -> float:
    """(p − 1)·α + (p − 1)/p · S/B, S the bytes one rank sends in all (S/p stay on the rank):
    p − 1 pairwise exchanges, NCCL's all-to-all (the expert dispatch, ``cost.moe``). 0 for one rank."""
    if _alone(ranks):
        return 0.0
    link = link.for_collective("all_to_all")  # its own fitted pair where calibrate gives one
    return (ranks - 1) * _alpha_s(link) + (ranks - 1) / ranks * bytes_per_rank_sent * _beta_s_per_byte(link)


def p2p_bytes_s(size_bytes: float, link: LinkSpec) -> float:
    """S/B on the p2p fit: bytes sent beside others in one batch of P2P ops, whose latency they share."""
    return size_bytes * _beta_s_per_byte(link.for_collective("p2p"))


def p2p_s(size_bytes: float, link: LinkSpec) -> float:
    """α + S/B: one send/recv pair (a pipeline-stage boundary)."""
    link = link.for_collective("p2p")
    return _alpha_s(link) + size_bytes * _beta_s_per_byte(link)


def hierarchical_allreduce_s(
    size_bytes: float, ranks_per_node: int, nodes: int, intra: LinkSpec, inter: LinkSpec
) -> float:
    """RS(S, g, intra) + AR(S/g, n, inter) + AG(S, g, intra); see the module doc."""
    g, n = ranks_per_node, nodes
    return (
        reduce_scatter_s(size_bytes, g, intra)
        + allreduce_s(size_bytes / g, n, inter)
        + all_gather_s(size_bytes, g, intra)
    )
