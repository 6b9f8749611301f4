"""Context parallelism: each sample's sequence split over cp ranks, attention as a ring.

A cp rank holds s/cp of the tokens of every sample of its micro-batch (head-tail pairs of chunks where s is
a multiple of 2cp, else contiguous chunks: ``ir.decisions.cp_load_balanced``, ``runtime.context_parallel``). Every op but attention works token by token, so a cp rank computes
what a data-parallel rank computes at a micro-batch of b/cp samples, and its gradients are one
more share of the same mean: the cost model prices cp as dp·cp data-parallel ranks at micro-batch
b/cp (``cp_equivalent``). That one substitution gives the compute of the linear ops, the
activations (÷ cp), the loss's logits (÷ cp), and the gradient reduction and ZeRO sharding over the
dp·cp ranks holding the same parameters (FSDP2 / DDP span them, as torchtitan's dp_shard_cp).
Attention is where cp differs (Liu et al., Ring Attention, 2023; torch's context_parallel):

**Causal imbalance** (``attention_extra_s``). With contiguous chunks, rank r's queries need the
kv chunks 0 .. r: the diagonal block (half the work under a causal mask) and r full blocks. The
ring runs in lockstep, one kv chunk per step, so the step takes the slowest rank's block: a half
block at step 0, a full one at each of the cp − 1 later steps (the last rank)::

    T_attn,cp = T_attn(s)·(cp − ½) / (cp²/2) = T_attn(s)·(2cp − 1)/cp²

against the even share T_attn(s)/cp that ``cp_equivalent`` prices, hence an extra
T_attn(b/cp)·(cp − 1)/cp per attention (forward, backward and a recompute alike); none without a
causal mask (every block is full and every rank busy). **None with head-tail chunks** (load-balanced):
rank r holds chunks r and 2cp − 1 − r of size h = s/(2cp), and torch's balanced ring gives every rank
half a c×c block (c = 2h) at every step (step 0: the local causal 2h×2h; then either all queries against the
first kv half or the second query half against all kv), so the causal work is even: the share is exact.

**Ring exchange** (``ring_exposed_s``), as torch's ring templates run it (``_templated_ring_attention`` and its
backward with torch's default ``_cp_options``; autoshard's runtime and torchtitan both call them). The forward
does not pass k and v around the ring: it all-gathers every rank's k and v chunk once, issued before step 0 and
waited at step 1, so only the local block hides it. The backward all-gathers k and v again the same way, and passes
the dk, dv accumulators (fp32: ``convert_to_f32``) to the next rank after every step (a send/recv pair), each
waited at the next step, behind its block, the last one after the loop with nothing to hide behind. Per attention
and micro-batch, with K the k and v bytes of a rank's chunk (b samples, s/cp tokens), G = K·4/e the fp32 gradient
bytes of the same (e the activations' element bytes), t_0 = T_attn(s)/cp² the local block of step 0 (half a full
block under a causal mask, a full one without), and t_blk a later step's block (the even share T_attn(s)/cp² with
head-tail chunks or without a causal mask; the contiguous ring's busiest rank computes a full block, twice that)::

    exposed = max(0, AG(cp·K) − t_0)                                 the forward's gather
            + max(0, AG(cp·K) − 2.5·t_0)                             the backward's gather
            + (cp − 1)·max(0, p2p(G) − 2.5·t_blk) + p2p(G)           dk, dv passed on
            (+ the forward's gather again under full recompute)

(2.5: FlashAttention's backward over its forward, ``cost.eager``; AG the cp group's all-gather.)

**Ring memory** (``RingCost.backward_bytes``). The same templates hold buffers a plain attention does not: the
backward's all-gathered k and v of every rank (cp·|kv| elements, held through its loop), the chunk of the step
concatenated for that gather (|kv|), the fp32 accumulators of dq, dk and dv (|q| + |kv|), and the fp32 dk, dv
it concatenates for the next rank beside the one it receives (2·|kv|); at a kernel call the previous step's
gradients are still held (|q| + |kv|, in the activations' dtype); with contiguous causal chunks a step a rank
skips makes fp32 zeros for its gradients (|q| + |kv| in fp32, not e). (With head-tail chunks a rank past the first
updates half of the received dk, dv into a fresh fp32 copy: a dry run of cp 4's last rank holds no more than its
first at its peak, ``tests/test_dryrun.py``, so it is not counted.) With |q|, |kv| the elements of a rank's q and
of its k and v chunks (b samples, s/cp tokens, a TP rank's shapes: ``CostTables.rank_share``) and e the
activations' element bytes, an attention's backward holds, beside its own gradients (its output's and its
inputs', ``memory.op_grad_bytes``) and the block's input gradient, at its worst rank::

    R = e·(cp + 1)·|kv| + 4·(|q| + 3·|kv|) + e·(|q| + |kv|)     (+ (4 − e)·(|q| + |kv|) with contiguous causal chunks)

and that moment, I_block + the attention's gradients + R, is a candidate for the block's backward moment beside
its largest op's (``with_ring_bytes``: ``cost.rank_memory``'s T_k, a pipeline stage's T_s alike). The forward's
gathered k and v (e·(cp + 1)·|kv|, and its fp32 output 4·|q|) are smaller and are freed before the block's backward: not priced.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autoshard.cost import eager
from autoshard.cost.comm import all_gather_s, p2p_s
from autoshard.cost.compute import SDPA_TARGET
from autoshard.cost.memory import block_input_bytes, op_grad_bytes
from autoshard.cost.tables import CAPTURED_ELEM_BYTES, CostTables
from autoshard.cost.units import Units, node_forward_s, node_units
from autoshard.ir.decisions import Decisions, Mesh, cp_load_balanced
from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.topology import Cluster, LinkSpec


def cp_equivalent(config: Decisions) -> Decisions:
    """The data-parallel decisions a cp plan computes like (module doc): dp·cp ranks, micro-batch b/cp."""
    mesh = config.mesh
    if mesh.cp == 1:
        return config
    return replace(
        config,
        mesh=Mesh(dp=mesh.dp * mesh.cp, tp=mesh.tp, pp=mesh.pp),
        microbatch_size=config.microbatch_size / mesh.cp,
    )


@dataclass(frozen=True)
class RingCost:
    """Per micro-batch, summed over the model's attentions: compute the even split leaves out
    (``attention_extra_s``, forward / backward / recompute) and the exposed ring exchange; and the largest of
    their backwards' largest moment (``backward_bytes``: the block's input gradient, the attention's gradients and
    the ring's buffers, module doc "Ring memory"; one attention runs at a time)."""

    forward_extra_s: float
    backward_extra_s: float
    recompute_extra_s: float
    exposed_s: float
    backward_bytes: int = 0


NO_RING = RingCost(0.0, 0.0, 0.0, 0.0)


def attention_nodes(graph: OpGraph) -> list[tuple[int, OpNode]]:
    """(graph index, node) of every scaled-dot-product attention."""
    return [(i, n) for i, n in enumerate(graph.nodes) if n.target.startswith(SDPA_TARGET)]


def cp_link(cluster: Cluster, mesh: Mesh) -> LinkSpec:
    """The link of rank 0's cp group: cp ranks tp apart (laid out pp, dp, cp, tp)."""
    return cluster.group_link([c * mesh.tp for c in range(mesh.cp)])


def ring_cost(tables: CostTables, config: Decisions) -> RingCost:
    """The ring's extra attention compute and exposed exchange of one micro-batch (module doc)."""
    return add_rings(unit_ring_costs(tables, config))


def add_rings(rings) -> RingCost:
    """``rings`` together: their times summed, the largest of their buffers (one attention at a time)."""
    rings = list(rings)
    return RingCost(
        sum((r.forward_extra_s for r in rings), 0.0),
        sum((r.backward_extra_s for r in rings), 0.0),
        sum((r.recompute_extra_s for r in rings), 0.0),
        sum((r.exposed_s for r in rings), 0.0),
        max((r.backward_bytes for r in rings), default=0),
    )


def with_ring_bytes(units: Units, rings: tuple[RingCost, ...] | None) -> Units:
    """``units`` whose backward's largest moment is its largest op's or its ring attention's, with the ring's
    buffers (module doc, "Ring memory"); unchanged without a ring."""
    if not rings or not units.backward_bytes:
        return units
    return replace(
        units, backward_bytes=tuple(max(held, r.backward_bytes) for held, r in zip(units.backward_bytes, rings))
    )


def unit_ring_costs(tables: CostTables, config: Decisions) -> tuple[RingCost, ...]:
    """``ring_cost`` per pipeline unit (``cost.units``: prefix, each block, suffix), of the attentions each holds:
    a pipeline prices each stage's ring with its own units (``cost.pipeline_step``)."""
    units = len(tables.graph.blocks) + 2
    if config.mesh.cp == 1:
        return (NO_RING,) * units
    key = ("cp-ring", config.mesh.cp, tables.point_key(config))
    return tables.memo(key, lambda: _unit_ring_costs(tables, config, units))


def _unit_ring_costs(tables: CostTables, config: Decisions, units: int) -> tuple[RingCost, ...]:
    graph, cluster, runtime = tables.graph, tables.cluster, tables.runtime
    cp, tp, b = config.mesh.cp, config.mesh.tp, config.microbatch_size
    share = node_forward_s(
        graph,
        b / cp,
        cluster.device,
        tables.precision.activation_bytes,
        CAPTURED_ELEM_BYTES,
        runtime.attention,
        runtime.kernels,
    )
    link = cp_link(cluster, config.mesh)
    balanced = cp_load_balanced(graph.tokens_per_sample, cp)
    recomputes = _recompute_full_attention(graph, config)
    unit_of = node_units(graph)
    out = [NO_RING] * units
    for i, node in attention_nodes(graph):
        t_share = share[i] / tp  # heads split over tp (an attention left whole on each TP rank is rare)
        uneven = node.attrs.get("is_causal") and not balanced
        extra = t_share * (cp - 1) / cp if uneven else 0.0
        elem = tables.precision.activation_bytes
        kv_bytes = _kv_chunk_bytes(node, b / cp, graph.batch_size, elem) / tp
        local_s = t_share / cp
        block_s = local_s / (eager.CAUSAL_WORK if uneven else 1.0)
        forward_exposed, backward_exposed = _exchange_exposed_s(
            kv_bytes, tables.precision.activation_bytes, local_s, block_s, cp, link
        )
        again = i in recomputes
        ring = RingCost(
            extra,
            eager.FLASH_BACKWARD_TO_FORWARD * extra,
            extra if again else 0.0,
            forward_exposed * (2 if again else 1) + backward_exposed,
            ring_moment_bytes(tables, config, node, unit_of[i], balanced),
        )
        out[unit_of[i]] = add_rings((out[unit_of[i]], ring))
    return tuple(out)


RING_GRAD_BYTES = 4  # torch's ring accumulates dq, dk, dv in fp32 and passes dk, dv on so (``convert_to_f32``)


def ring_backward_bytes(q_bytes: float, kv_bytes: float, elem_bytes: int, cp: int, balanced: bool, causal: bool) -> int:
    """R: one attention's ring buffers in its backward at its worst rank (module doc, "Ring memory"), from the
    bytes of a rank's q and of its k and v chunks in the activations' dtype (e bytes an element)."""
    grad = RING_GRAD_BYTES / elem_bytes
    held = (cp + 1) * kv_bytes + grad * (q_bytes + 3 * kv_bytes) + q_bytes + kv_bytes
    if causal and not balanced:
        held += (grad - 1) * (q_bytes + kv_bytes)
    return int(held)


def ring_moment_bytes(tables: CostTables, config: Decisions, node: OpNode, unit: int, balanced: bool) -> int:
    """The largest moment of a ring attention's backward on a rank: the block's input gradient, the attention's own
    gradients and R (module doc, "Ring memory"), on the rank's shapes at b/cp samples."""
    graph, elem = tables.graph, tables.precision.activation_bytes
    equivalent = cp_equivalent(config)
    share = tables.rank_share(equivalent)
    ratio = equivalent.microbatch_size / graph.batch_size * elem / CAPTURED_ELEM_BYTES
    q, k, v = (share.value_bytes(graph, name, ratio) for name in node.inputs[:3])
    block = graph.blocks[unit - 1] if 0 < unit <= len(graph.blocks) else None
    held = block_input_bytes(graph, block, ratio, share) if block is not None else 0
    causal = bool(node.attrs.get("is_causal"))
    return (
        held
        + op_grad_bytes(graph, node.name, ratio, share)
        + ring_backward_bytes(q, k + v, elem, config.mesh.cp, balanced, causal)
    )


def _exchange_exposed_s(
    kv_bytes: float, elem_bytes: int, local_s: float, block_s: float, cp: int, link: LinkSpec
) -> tuple[float, float]:
    """(forward, backward) exposed exchange of one attention's ring (module doc, "Ring exchange")."""
    gather_s = all_gather_s(cp * kv_bytes, cp, link)
    pass_s = p2p_s(kv_bytes * RING_GRAD_BYTES / elem_bytes, link)
    back = eager.FLASH_BACKWARD_TO_FORWARD
    forward = max(0.0, gather_s - local_s)
    backward = max(0.0, gather_s - back * local_s) + (cp - 1) * max(0.0, pass_s - back * block_s) + pass_s
    return forward, backward


def _kv_chunk_bytes(node: OpNode, samples: float, captured_batch: int, elem_bytes: int) -> float:
    """Bytes of the k and v chunks a rank holds: ``samples`` = b/cp of the captured batch's. The graph
    records what the attention reads (q, k, v, a mask) at CAPTURED_ELEM_BYTES; k and v are what is left
    after q (the output's size), at most twice q's: self-attention with k and v at q's head count, which is
    also GQA's where the model repeats its key/value heads before the call (transformers' ``repeat_kv``).
    Fewer only where the attention is handed the grouped heads (``enable_gqa``); a mask read beside them
    counts with them, up to that cap."""
    out_numel = node.output_numel
    kv_numel = min(2 * out_numel, max(0, node.bytes_read // CAPTURED_ELEM_BYTES - out_numel))
    return kv_numel * samples / captured_batch * elem_bytes


def _recompute_full_attention(graph: OpGraph, config: Decisions) -> set[int]:
    """Graph indices of the attentions whose block recomputes its forward (full recompute): those run
    the forward ring again. Selective recompute keeps the attention output."""
    modes = config.block_modes(len(graph.blocks))
    names = {name for block, mode in zip(graph.blocks, modes) if mode == "full" for name in block.node_names}
    return {i for i, n in enumerate(graph.nodes) if n.name in names}
