"""Memory per rank: model state by ZeRO stage and precision, activations per block.

Model state (ZeRO paper, Rajbhandari et al. 2020; Ψ parameters, N_d data-parallel ranks;
p, g, o bytes per parameter of weights, gradients and optimizer state)::

    stage 0 (DDP)   p·Ψ      + g·Ψ      + o·Ψ
    stage 1         p·Ψ      + g·Ψ      + o·Ψ/N_d
    stage 2         p·Ψ      + g·Ψ/N_d  + o·Ψ/N_d     (weights unsharded during the step)
    stage 3         p·Ψ/N_d  + g·Ψ/N_d  + o·Ψ/N_d

With Megatron's mixed precision (p, g, o) = (2, 2, 12): 16Ψ, 4Ψ + 12Ψ/N_d, 2Ψ + 14Ψ/N_d,
16Ψ/N_d, as in docs/reference-numbers.md. The emitted programs keep fp32 weights and use bf16 autocast
on GPUs, so their (p, g, o) is (4, 4, 8): the same 16Ψ, split differently.

Activations of one micro-batch of b samples, per block, from the captured graph (captured at
batch b₀ in ``captured_bytes`` per element, trained with ``a`` bytes per element)::

    none       A_block · (b/b₀) · (a/captured)        every non-alias output kept
    selective  A_saved · (b/b₀) · (a/captured)        the block input and outputs of matmul-class ops kept
    alternate  the same less the outputs of every other weight matmul (the 2nd, 4th, ... in block order) and of
               the batched matmuls (torchtitan's op-level policy, ``runtime.selective``)
    full       I_block · (b/b₀) · (a/captured)        only the block input kept

plus, under recompute, the workspace of one block while it is recomputed in backward: what
the recomputed forward regenerates (``block_workspace_bytes``), all of A_block under full
recompute, A_block less the matmul-class outputs under selective (those are kept, already
counted in A_saved, and reused by the recomputation, not made again).
Korthikanti et al.'s per-layer formulas (docs/reference-numbers.md) are a check on these figures.
Each function takes a ``share`` (``cost.saved.RankShare``): the same rules on one tensor-parallel rank's
shapes (its split values 1/tp; a fully recomputed block's input 1/tp where sequence parallelism splits it).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.cost.saved import (
    FP32_BYTES,
    MATMUL_OPS,
    SDPA_OPS,
    VIEW_OPS,
    WHOLE,
    RankShare,
    needs_grad,
    saved_by,
    saved_set,
    storage_of,
    value_bytes,
)
from autoshard.errors import AutoshardError
from autoshard.ir.graph import Block, OpGraph, OpNode
from autoshard.ir.names import op_name

# Ops whose outputs selective recompute keeps (the expensive ones); the rest are recomputed.
COMPUTE_HEAVY_TARGETS = (
    "aten.linear",
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "aten.matmul",
    "aten.scaled_dot_product_attention",
    "aten._scaled_dot_product",
    "aten.convolution",
    "aten.conv1d",
    "aten.conv2d",
    "aten.embedding",
    "aten._grouped_mm",
    "aten._scaled_grouped_mm",
    "transformers.grouped_mm_fallback",  # mixture-of-experts GEMMs
)


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of state in a training precision."""

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int  # Adam: fp32 m and v (+ fp32 master weights when params are 16-bit)
    activation_bytes: int


FP32 = Precision("fp32", param_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=4)
BF16_AUTOCAST = Precision("bf16-autocast", param_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=2)
MEGATRON_MIXED = Precision("bf16-mixed", param_bytes=2, grad_bytes=2, optimizer_bytes=12, activation_bytes=2)
# --precision bf16-pure on fp32 parameters (cast to bf16): AdamW's m and v made like the bf16 parameter
BF16_PURE = Precision("bf16-pure", param_bytes=2, grad_bytes=2, optimizer_bytes=4, activation_bytes=2)
# --precision fp16: fp32 master weights and gradients, fp16 autocast (the loss scale is one number)
FP16_AUTOCAST = Precision("fp16-autocast", param_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=2)


# Bytes per element of parameter dtypes (ParamInfo.dtype: torch's name without "torch.").
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
_SHORT = {"float64": "fp64", "float16": "fp16", "bfloat16": "bf16"}


def param_dtype(graph: OpGraph) -> str:
    """The dtype holding most of the model's trainable parameters (elements), "float32" without any."""
    counts: dict[str, int] = {}
    for p in graph.params:
        if not p.is_buffer and p.dtype in DTYPE_BYTES:
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel
    return max(sorted(counts), key=counts.get) if counts else "float32"


def precision_for_backend(backend: str, dtype: str = "float32") -> Precision:
    """What the emitted program trains in: the model's parameters stay in the dtype it built them in,
    so fp32 parameters train under bf16 autocast with NCCL (GPUs) or in fp32 with gloo (CPUs), and
    16-bit (or fp64) parameters train in that dtype: weights and gradients d bytes each, AdamW's m and
    v 2d (torch creates them like the parameter), activations in that dtype too."""
    if dtype in _SHORT:
        d = DTYPE_BYTES[dtype]
        # activations: 4, as the step model scales captured bytes by activation_bytes / 4 and the graph
        # was captured in the model's dtype, so its bytes are already the trained ones
        return Precision(
            f"{_SHORT[dtype]}-params", param_bytes=d, grad_bytes=d, optimizer_bytes=2 * d, activation_bytes=4
        )
    return BF16_AUTOCAST if backend == "nccl" else FP32


def precision_for_graph(backend: str, graph: OpGraph, pinned: str | None = None) -> Precision:
    """``precision_for_backend`` for this model's parameter dtype (``param_dtype``), or the ``--precision`` pinned
    (``pinned_precision``)."""
    if pinned is not None:
        return pinned_precision(pinned, param_dtype(graph))
    return precision_for_backend(backend, param_dtype(graph))


def pinned_precision(pinned: str, dtype: str = "float32") -> Precision:
    """``--precision`` (``ir.decisions.PIN_PRECISIONS``) on a model whose parameters are ``dtype``; the Precision's
    name is the plan's (``ir.decisions.PRECISIONS``): fp32 -> "fp32"; bf16 -> "bf16-autocast"; fp16 ->
    "fp16-autocast"; bf16-pure -> "bf16-params" on bf16 parameters (as unpinned), "bf16-pure" on fp32 ones (the
    program casts them). fp32, bf16 and fp16 keep fp32 master weights, so they need fp32 parameters: any other
    dtype is one line naming the fix."""
    if pinned == "bf16-pure" and dtype == "bfloat16":
        return precision_for_backend("nccl", dtype)
    if dtype != "float32":
        raise AutoshardError(
            f"--precision {pinned}: the model's parameters are {dtype}, and the program keeps the "
            f"dtype a model is built in; build it in float32 (master weights) or pin "
            f"--precision bf16-pure on bfloat16 parameters"
        )
    return {"fp32": FP32, "bf16": BF16_AUTOCAST, "bf16-pure": BF16_PURE, "fp16": FP16_AUTOCAST}[pinned]


def model_state_bytes(params: int, zero_stage: int, dp: int, precision: Precision) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes per rank; see the module docstring."""
    p, g, o = params * precision.param_bytes, params * precision.grad_bytes, params * precision.optimizer_bytes
    if zero_stage >= 1:
        o = o / dp
    if zero_stage >= 2:
        g = g / dp
    if zero_stage >= 3:
        p = p / dp
    return int(p), int(g), int(o)


def block_saved_bytes(
    graph: OpGraph, block: Block, recompute: str, ratio: float = 1.0, share: RankShare = WHOLE
) -> int:
    """Bytes one block keeps for backward at the captured batch, per recompute mode (module doc),
    its activations at ``ratio`` (trained over captured bytes per element), on a TP rank of ``share``."""
    if recompute == "full":
        return block_input_bytes(graph, block, ratio, share)
    if recompute in ("selective", "alternate"):
        kept = _kept_by_policy(graph, block, recompute, ratio, share)
        return block_input_bytes(graph, block, ratio, share) + sum(kept.values())
    return sum(_block_saved(graph, block, ratio, share=share).values())


def alternate_recomputed(graph: OpGraph, block: Block) -> frozenset[str]:
    """The matmul-class ops of ``block`` whose outputs "alternate" recomputes and "selective" keeps: every other
    weight matmul in block order (the 2nd, 4th, ...; ``runtime.selective`` counts ``mm`` / ``addmm`` as they run),
    and the matmuls of two activations (``bmm``; kept by neither torchtitan's policy nor this one)."""

    def compute():
        matmuls = [graph.node(n) for n in block.node_names if op_name(graph.node(n).target) in MATMUL_OPS]
        weights = [n.name for n in matmuls if n.param_inputs]
        return frozenset(weights[1::2] + [n.name for n in matmuls if not n.param_inputs])

    return graph.derived(("alternate_recomputed", block.path), compute)


def alternate_reruns(graph: OpGraph) -> frozenset[str]:
    """The matmul-class ops that "alternate" recomputes, over every block (``alternate_recomputed``)."""
    return graph.derived(
        "alternate_reruns", lambda: frozenset().union(*(alternate_recomputed(graph, b) for b in graph.blocks))
    )


def _kept_by_policy(graph: OpGraph, block: Block, recompute: str, ratio: float, share: RankShare) -> dict[str, int]:
    if recompute == "alternate":
        return _selective_kept(graph, block, ratio, share, alternate_recomputed(graph, block), scatters_only=True)
    return _selective_kept(graph, block, ratio, share)


def block_input_bytes(graph: OpGraph, block: Block, ratio: float = 1.0, share: RankShare = WHOLE) -> int:
    """I_block at ``ratio``: the block's input, 1/tp of it where the layout splits it (sequence parallelism
    splits the residual stream a block reads)."""
    whole = int(block.input_bytes * ratio)
    return whole // share.tp if share.tp > 1 and _input_split(graph, block, share) else whole


def block_workspace_bytes(
    graph: OpGraph, block: Block, recompute: str, ratio: float = 1.0, share: RankShare = WHOLE
) -> int:
    """Bytes the recomputed forward of one block keeps again for its backward, at the captured batch:
    all it keeps without recompute (full), that less what selective (or alternate) recompute kept."""
    if recompute == "none":
        return 0
    saved = _block_saved(graph, block, ratio, share=share)
    kept = _kept_by_policy(graph, block, recompute, ratio, share) if recompute in ("selective", "alternate") else {}
    return sum(nbytes for key, nbytes in saved.items() if key not in kept)


def block_backward_bytes(graph: OpGraph, block: Block, ratio: float = 1.0, share: RankShare = WHOLE) -> int:
    """The activation gradients one block's backward holds at once, at the captured batch: the gradient
    of the block's output (the residual stream's, I_block), and at its largest op the gradient of its
    output beside those of its inputs that need one: max_n (|out(n)| + Σ_{i ∈ in(n), needs grad} |i|),
    each on the TP rank's shapes."""
    return block_input_bytes(graph, block, ratio, share) + max(
        (op_grad_bytes(graph, n, ratio, share) for n in block.node_names), default=0
    )


def op_grad_bytes(graph: OpGraph, name: str, ratio: float, share: RankShare) -> int:
    """The gradient of ``name``'s output beside those of its inputs that need one (``block_backward_bytes``; a cp
    ring's attention, ``cost.context_parallel``)."""
    grads = _grads(graph)
    node = graph.node(name)
    if name not in grads or op_name(node.target) in VIEW_OPS:
        return 0
    # a parameter's gradient (read directly or through a view: an experts module's transposed weights) is
    # the rank's gradient state, priced as grads
    params = graph.placeholder_params
    ins = {storage for i in node.inputs if i in grads and (storage := storage_of(graph, i)) not in params}
    return share.value_bytes(graph, name, ratio) + sum(share.value_bytes(graph, i, ratio) for i in ins)


def module_bytes(graph: OpGraph, path: str, ratio: float = 1.0, share: RankShare = WHOLE) -> tuple[int, int]:
    """(saved, backward) of the module at ``path`` alone, at the captured batch: what its ops keep for their
    backward (``cost.saved``), and its backward's largest op's gradients (output and inputs, as
    ``block_backward_bytes``): what a module recomputed inside its own backward holds at once."""

    def compute() -> tuple[int, int]:
        names = [n.name for n in graph.nodes if n.module_path == path or n.module_path.startswith(path + ".")]
        saved = saved_set(graph, (graph.node(n) for n in names), ratio, _grads(graph), share)
        return sum(saved.values()), max((op_grad_bytes(graph, n, ratio, share) for n in names), default=0)

    return graph.derived(("module_bytes", path, ratio, share), compute)


def non_block_saved_bytes(graph: OpGraph, ratio: float = 1.0, share: RankShare = WHOLE) -> int:
    """Bytes kept by nodes outside any block (embeddings, final norm, head) and the tables the blocks
    share (rotary angles), plus the loss's copy of the output (cross-entropy keeps its log-softmax, as
    large as the model output), on a TP rank of ``share`` (the loss reads the output whole, or under loss
    parallelism its vocabulary shard: ``output_bytes``)."""
    in_block = {n for b in graph.blocks for n in b.node_names}
    kept = saved_set(graph, (n for n in graph.nodes if n.name not in in_block), ratio, _grads(graph), share)
    for block in graph.untwinned_blocks():  # a twin reads the same tables as its source
        kept.update(
            (key, nbytes)
            for key, nbytes in _block_saved(graph, block, ratio, own=False, share=share).items()
            if key in _shared_values(graph)
        )
    return sum(kept.values()) + output_bytes(graph, ratio, share)


def output_bytes(graph: OpGraph, ratio: float = 1.0, share: RankShare = WHOLE) -> int:
    """The model's output at ``ratio``: what the loss keeps a copy of; on a TP rank of ``share`` 1/tp of it where
    the layout leaves the output split (loss parallelism: the cross-entropy on the vocabulary shards keeps its
    log-softmax of this rank's shard), else whole."""
    if not graph.nodes:
        return 0
    whole = int(graph.nodes[-1].output_bytes * ratio)
    return whole // share.tp if output_split(graph, share) else whole


def output_split(graph: OpGraph, share: RankShare) -> bool:
    """Whether a TP rank of ``share`` holds 1/tp of the model's output (loss parallelism's vocabulary shard)."""
    return share.tp > 1 and bool(graph.nodes) and storage_of(graph, graph.nodes[-1].name) in share.split


def activation_bytes(
    graph: OpGraph, microbatch_size: int, recompute: str, precision: Precision, captured_bytes: int = 4
) -> int:
    """Activation bytes per rank for one micro-batch in flight (see module docstring)."""
    ratio = precision.activation_bytes / captured_bytes
    kept = sum(block_saved_bytes(graph, b, recompute, ratio) for b in graph.blocks) + non_block_saved_bytes(
        graph, ratio
    )
    workspace = max((block_workspace_bytes(graph, b, recompute, ratio) for b in graph.blocks), default=0)
    return int((kept + workspace) * microbatch_size / graph.batch_size)


def _block_saved(
    graph: OpGraph, block: Block, ratio: float, own: bool = True, share: RankShare = WHOLE
) -> dict[str, int]:
    """What the block's ops keep without recompute (``cost.saved``): key -> bytes; ``own`` leaves out
    the tables several blocks read (counted once, outside the blocks)."""

    def compute() -> dict[str, int]:
        return saved_set(graph, (graph.node(n) for n in block.node_names), ratio, _grads(graph), share)

    kept = graph.derived(("block_saved", block.path, ratio, share), compute)
    if not own:
        return kept
    shared = _shared_values(graph)
    return {key: nbytes for key, nbytes in kept.items() if key not in shared}


def _selective_kept(
    graph: OpGraph,
    block: Block,
    ratio: float,
    share: RankShare = WHOLE,
    rerun: frozenset[str] = frozenset(),
    scatters_only: bool = False,
) -> dict[str, int]:
    """What selective recompute keeps besides the block's input, on one TP rank: the outputs of the ops the
    runtime's policy saves (``runtime.selective.SAVE_IN_SELECTIVE``), as the rank holds them; ``rerun``: the
    matmuls whose own outputs the policy recomputes ("alternate": every other one).

    - a matmul's output, its share of the value (1/tp where the layout splits it) ...
    - ... but a row-parallel matmul's output is this rank's partial sum of the whole value
      (``RankShare.partial``; the collective reducing it comes after), and a colwise-gather's is its 1/tp before
      the all-gather;
    - the forward TP collectives' outputs, which the policy keeps too (rerunning them would repeat the
      communication): a row-parallel output's all-reduce (whole) or, with sequence parallelism, reduce-scatter
      (1/tp of the tokens), a colwise-gather's all-gather (whole), and the all-gather of a split input that a
      column-parallel matmul reads gathered (``RankShare.gathers``: once per gathering module);
    - attention's output and its log-sum-exp.

    ``scatters_only`` ("alternate": torchtitan's op-level policy, whose save list holds ``reduce_scatter_tensor``
    and no other collective) keeps of the collectives only the reduce-scatters' outputs (1/tp of the tokens): the
    all-reduces, the all-gathers of the split inputs and a colwise-gather's are rerun in backward
    (``cost.tp.recompute_tp_comm``), so a column-parallel matmul's gathered input is not kept whole.

    On Llama-3-8B at 8,192 tokens, tp 4 with sequence parallelism, this is 456 MiB a block where the output
    values alone were 200 MiB (benchmarks/reports/dryrun-long-tp-2026-12-01/README.md)."""
    kept: dict[str, int] = {}
    grads = _grads(graph)
    for name in block.node_names:
        node = graph.node(name)
        op = op_name(node.target)
        if op in MATMUL_OPS:
            kept.update(_matmul_kept(graph, node, ratio, share, grads, name in rerun, scatters_only))
        elif op in SDPA_OPS:
            kept[name] = share.value_bytes(graph, name, ratio)
            kept.update(
                [share.entry(graph, node, f"{name}:lse", node.output_numel // max(1, node.shape[-1]) * FP32_BYTES)]
            )
    return kept


def _matmul_kept(
    graph: OpGraph, node: OpNode, ratio: float, share: RankShare, grads: set[str], rerun: bool, scatters_only: bool
) -> list[tuple[str, int]]:
    """(key, bytes) a selective policy keeps of one matmul on a TP rank (``_selective_kept``; ``scatters_only``:
    of its collectives only a reduce-scatter's output)."""
    name = node.name
    whole = value_bytes(graph, name, ratio)
    own, collectives = [(name, share.value_bytes(graph, name, ratio))], []
    if name in share.partial:
        own = [(f"{name}:partial", whole)]
        reduced = share.value_bytes(graph, name, ratio)  # reduce-scatter: 1/tp; all-reduce: whole
        collectives = [(name, reduced)] if not scatters_only or reduced < whole else []
    elif name in share.gathered_out:
        own, collectives = [(f"{name}:shard", whole // share.tp)], [] if scatters_only else [(name, whole)]
    gathered = (
        []
        if scatters_only
        else [k_b for k_b in saved_by(graph, node, grads, ratio, share) if k_b[0].endswith(":gathered")]
    )
    return ([] if rerun else own) + collectives + gathered


def _input_split(graph: OpGraph, block: Block, share: RankShare) -> bool:
    """Whether the block's largest input from outside it (the residual stream) is split over the TP ranks. Largest
    in bytes, then by name: a causal mask of (b, 1, s, s) booleans has as many elements as a (b, s, d) residual
    stream where s = d (8,192 tokens at d = 8,192), and a set's order is the process's hash order."""
    inside = set(block.node_names)
    outer = {
        storage_of(graph, i)
        for n in block.node_names
        for i in graph.node(n).inputs
        if i not in inside and i not in graph.placeholder_params and i in graph._by_name()
    }
    largest = max(sorted(outer), key=lambda name: graph.node(name).output_bytes, default=None)
    return largest in share.split


def shared_value_bytes(graph: OpGraph) -> int:
    """Bytes of the values made outside the blocks and read by several of them (rotary tables, masks), as
    captured: what every pipeline stage receives beside the residual stream."""
    return sum(size for size, _ in shared_value_sizes(graph))


def shared_value_sizes(graph: OpGraph) -> tuple[tuple[int, bool], ...]:
    """Each shared value (``shared_value_bytes``), in name order: its bytes as captured and whether it carries a
    gradient (one made from parameters: its gradient goes back across a stage boundary too)."""

    def compute() -> tuple[tuple[int, bool], ...]:
        grads = _grads(graph)
        return tuple((value_bytes(graph, name, 1.0), name in grads) for name in sorted(_shared_values(graph)))

    return graph.derived(("shared_value_sizes",), compute)


def _grads(graph: OpGraph) -> set[str]:
    return needs_grad(graph)


def _shared_values(graph: OpGraph) -> frozenset[str]:
    """Values made outside the blocks and read by more than one block (rotary tables, masks)."""

    def compute() -> frozenset[str]:
        in_block = {n: b.path for b in graph.blocks for n in b.node_names}
        readers: dict[str, set[str]] = {}
        for node in graph.nodes:
            for name in node.inputs:
                if node.name in in_block and name not in in_block:
                    readers.setdefault(storage_of(graph, name), set()).add(in_block[node.name])
        return frozenset(name for name, blocks in readers.items() if len(blocks) > 1)

    return graph.derived(("shared_values",), compute)
