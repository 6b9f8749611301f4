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
    full       I_block · (b/b₀) · (a/captured)        only the block input kept

plus, under recompute, the workspace of one block while it is recomputed in backward: what
the recomputed forward regenerates (``block_workspace_bytes``), all of A_block under full
recompute, A_block less the matmul-class outputs under selective (those are kept, already
counted in A_saved, and reused by the recomputation, not made again).
Korthikanti et al.'s per-layer formulas (docs/reference-numbers.md) are a check on these figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.ir.graph import Block, OpGraph

# Ops whose outputs selective recompute keeps (the expensive ones); the rest are recomputed.
COMPUTE_HEAVY_TARGETS = (
    "aten.linear", "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul",
    "aten.scaled_dot_product_attention", "aten._scaled_dot_product", "aten.convolution",
    "aten.conv1d", "aten.conv2d", "aten.embedding",
    "aten._grouped_mm", "aten._scaled_grouped_mm", "transformers.grouped_mm_fallback",  # mixture-of-experts GEMMs
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
        return Precision(f"{_SHORT[dtype]}-params", param_bytes=d, grad_bytes=d, optimizer_bytes=2 * d,
                         activation_bytes=4)
    return BF16_AUTOCAST if backend == "nccl" else FP32


def precision_for_graph(backend: str, graph: OpGraph) -> Precision:
    """``precision_for_backend`` for this model's parameter dtype (``param_dtype``)."""
    return precision_for_backend(backend, param_dtype(graph))


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


def block_saved_bytes(graph: OpGraph, block: Block, recompute: str) -> int:
    """Bytes one block keeps for backward at the captured batch, per recompute mode."""
    if recompute == "full":
        return block.input_bytes
    if recompute == "selective":
        return block.input_bytes + _heavy_bytes(graph, block)
    return block.activation_bytes


def block_workspace_bytes(graph: OpGraph, block: Block, recompute: str) -> int:
    """Bytes the recomputed forward of one block makes again in backward, at the captured batch."""
    if recompute == "full":
        return block.activation_bytes
    if recompute == "selective":
        return max(0, block.activation_bytes - _heavy_bytes(graph, block))
    return 0


def non_block_saved_bytes(graph: OpGraph) -> int:
    """Bytes kept by nodes outside any block (embeddings, final norm, head), plus the loss's copy.

    Cross-entropy keeps its log-softmax, as large as the model output, hence one more output.
    """
    in_block = {n for b in graph.blocks for n in b.node_names}
    outside = sum(n.bytes_written for n in graph.nodes if n.name not in in_block)
    output_bytes = graph.nodes[-1].bytes_written if graph.nodes else 0
    return outside + output_bytes


def activation_bytes(graph: OpGraph, microbatch_size: int, recompute: str, precision: Precision,
                     captured_bytes: int = 4) -> int:
    """Activation bytes per rank for one micro-batch in flight (see module docstring)."""
    scale = (microbatch_size / graph.batch_size) * (precision.activation_bytes / captured_bytes)
    kept = sum(block_saved_bytes(graph, b, recompute) for b in graph.blocks) + non_block_saved_bytes(graph)
    workspace = max((block_workspace_bytes(graph, b, recompute) for b in graph.blocks), default=0)
    return int((kept + workspace) * scale)


def _heavy_bytes(graph: OpGraph, block: Block) -> int:
    """Outputs of the block's matmul-class ops: what selective recompute keeps besides the input."""
    return sum(graph.node(n).bytes_written for n in block.node_names if _is_heavy(graph.node(n).target))


def _is_heavy(target: str) -> bool:
    return target.startswith(COMPUTE_HEAVY_TARGETS)
