"""What ``torch.autocast`` does to an eager step's memory traffic: the dtype each op runs in, and the casts it adds.

autoshard's GPU programs train fp32 parameters under bf16 autocast (``ir.decisions.PRECISIONS``
"bf16-autocast"). The graph is captured in fp32; this pass replays autocast's dtype rules over it
(torch.amp docs, "Autocast Op Reference", CUDA op lists; ``aten/src/ATen/autocast_mode.cpp``):

    lower precision  matmuls, convolutions, SDPA: every floating input not in the autocast dtype a is
                     cast to a (one copy kernel per input per call; a parameter's cast is cached for
                     the autocast region, so once per micro-batch); the output is in a
    fp32             softmax, log-softmax, layer/group norm, exp, log, pow, sum, losses, ...: every
                     input in a is cast to fp32; the output is fp32
    promote          everything else: no cast kernel (TensorIterator converts while it reads); the
                     output in the widest floating input dtype

Backward undoes each cast on the gradient (``ToCopyBackward``: the gradient of an input cast down
is cast up again, and the reverse), and the gradient of a promoted op w.r.t. an input in a is cast
to a: one more copy of that input's size. A cast of n elements from b₁ to b₂ bytes moves n·(b₁ + b₂)
bytes in one kernel (``cost.eager.elementwise_s``).

Parameters are read in their dtype at use: fp32 under DDP (so autocast casts each weight once per
micro-batch, 4 + 2 bytes per element, and its bf16 gradient back to fp32, 2 + 4), bf16 under FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16)`` (gathered in bf16: no forward cast; the bf16 gradient
cast to the fp32 reduce dtype, 2 + 4). Buffers keep their stored dtype.

Measured on one H200 (``benchmarks/gpu_kernels.py``, Llama-3.2-1B's shape at micro-batch 4 under
DDP, benchmarks/reports/gpu-h200-2026-11-26): copy kernels were 15 % of the step's device time, and the
elementwise ops of the fp32 residual stream and of rotary embeddings (fp32 ``cos``/``sin`` promote
bf16 q and k) moved twice the bytes a uniform 2-byte activation prices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.cost import eager
from autoshard.ir.graph import OpGraph, OpNode, dtype_bytes

LOWER_PRECISION_TARGETS = (
    eager.MATMUL_2D_TARGETS
    + eager.MATMUL_BATCHED_TARGETS
    + (
        "aten.scaled_dot_product_attention",
        "aten.convolution",
        "aten.conv1d",
        "aten.conv2d",
        "aten.conv3d",
        "aten.conv_transpose",
        "aten.prelu",
        "aten.addmv",
        "aten.mv",
        "aten.addr",
        "aten.addbmm",
        "aten.chain_matmul",
        "aten.linalg_multi_dot",
    )
)
FP32_TARGETS = (
    "aten.softmax",
    "aten._softmax",
    "aten.log_softmax",
    "aten._log_softmax",
    "aten.layer_norm",
    "aten.native_layer_norm",
    "aten.group_norm",
    "aten.native_group_norm",
    "aten.exp",
    "aten.expm1",
    "aten.log",
    "aten.log10",
    "aten.log2",
    "aten.log1p",
    "aten.pow",
    "aten.reciprocal",
    "aten.rsqrt",
    "aten.acos",
    "aten.asin",
    "aten.cosh",
    "aten.sinh",
    "aten.tan",
    "aten.erfinv",
    "aten.softplus",
    "aten.sum",
    "aten.prod",
    "aten.cumsum",
    "aten.cumprod",
    "aten.logsumexp",
    "aten.cross_entropy",
    "aten.nll_loss",
    "aten.mse_loss",
    "aten.l1_loss",
    "aten.smooth_l1_loss",
    "aten.huber_loss",
    "aten.kl_div",
    "aten.binary_cross_entropy_with_logits",
    "aten.cosine_similarity",
    "aten.norm",
    "aten.linalg_vector_norm",
    "aten.frobenius_norm",
    "aten.cdist",
    "aten.dist",
    "aten.renorm",
)
FLOATING = ("float32", "float16", "bfloat16", "float64")
Autocast = tuple[str, "str | None"]  # (autocast dtype, the dtype parameters are read in; None: as stored)


@dataclass(frozen=True)
class NodeTraffic:
    """One op's bytes under autocast, at the captured batch except where said.

    ``read_ratio`` / ``write_ratio`` scale its captured activation reads and writes (fp32) to the dtypes
    it runs in; ``weight_read_bytes`` are its parameters' bytes as it reads them; the casts it launches:
    activation casts (scale with the micro-batch) and parameter casts (once per micro-batch, unscaled)."""

    read_ratio: float = 1.0
    write_ratio: float = 1.0
    weight_read_bytes: int = 0
    forward_cast_bytes: int = 0
    forward_cast_kernels: int = 0
    backward_cast_bytes: int = 0
    backward_cast_kernels: int = 0
    weight_forward_cast_bytes: int = 0
    weight_backward_cast_bytes: int = 0
    weight_casts: int = 0
    weight_grad_casts: int = 0


def autocast_traffic(
    graph: OpGraph, autocast_dtype: str = "bfloat16", weight_dtype: str | None = None
) -> tuple[NodeTraffic, ...]:
    """``NodeTraffic`` of every node, in graph order (module doc); ``weight_dtype``: the dtype parameters are
    read in (None: as stored). Computed once per graph and arguments."""
    key = ("autocast_traffic", autocast_dtype, weight_dtype)
    return graph.derived(key, lambda: _traffic(graph, autocast_dtype, weight_dtype))


def _traffic(graph: OpGraph, low: str, weight_dtype: str | None) -> tuple[NodeTraffic, ...]:
    dtype: dict[str, str] = {}  # value name -> the dtype it holds at run time
    for name, param in graph.placeholder_params.items():
        info = graph.param(param)
        dtype[name] = info.dtype if info.is_buffer or weight_dtype is None else weight_dtype
    seen: set[str] = set()  # parameters already read this micro-batch (autocast caches their casts)
    return tuple(_node_traffic(graph, node, low, dtype, seen) for node in graph.nodes)


def _node_traffic(graph: OpGraph, node: OpNode, low: str, dtype: dict[str, str], seen: set[str]) -> NodeTraffic:
    """The op's dtype by autocast's lists, what its kernel reads and writes, and the casts around it."""
    inputs = []  # (name, numel, dtype held, captured dtype)
    for name in dict.fromkeys(node.inputs):
        try:
            shape, captured = graph.value_meta(name)
        except KeyError:  # an input capture left without metadata (annotate's estimated_bytes skips it too)
            continue
        inputs.append((name, math.prod(shape), dtype.get(name, captured), captured))
    floating = [held for _, _, held, _ in inputs if held in FLOATING]
    casting = node.target.startswith(LOWER_PRECISION_TARGETS + FP32_TARGETS)
    if node.target.startswith(LOWER_PRECISION_TARGETS):
        op_dtype = low
    elif node.target.startswith(FP32_TARGETS):
        op_dtype = "float32"
    else:
        op_dtype = max(floating, key=dtype_bytes, default=None)
    dtype[node.name] = op_dtype if op_dtype and node.dtype in FLOATING else node.dtype

    def kernel_reads(held: str) -> str:
        return op_dtype if casting and held in FLOATING else held

    params = graph.placeholder_params
    acts = [i for i in inputs if i[0] not in params]
    act_captured = sum(numel * dtype_bytes(captured) for _, numel, _, captured in acts)
    act_run = sum(numel * dtype_bytes(kernel_reads(held)) for _, numel, held, _ in acts)
    act_casts = [(numel, held) for _, numel, held, _ in acts if kernel_reads(held) != held]
    # a promoted op's gradient w.r.t. a narrower input is cast to that input's dtype
    narrower = (
        []
        if casting or not op_dtype
        else [
            (numel, held)
            for _, numel, held, _ in acts
            if held in FLOATING and dtype_bytes(held) < dtype_bytes(op_dtype)
        ]
    )
    weight_read = weight_fwd = weight_bwd = weight_casts = weight_grad_casts = 0
    for name, numel, held, _ in inputs:
        if name not in params or held not in FLOATING:
            continue
        read, stored = kernel_reads(held), graph.param(params[name]).dtype
        weight_read += numel * dtype_bytes(read)
        if params[name] in seen:
            continue
        seen.add(params[name])
        if read != held:  # autocast's cached cast, and its gradient's cast back
            weight_fwd += numel * (dtype_bytes(held) + dtype_bytes(read))
            weight_casts += 1
        if read != stored and not graph.param(params[name]).is_buffer:  # the gradient cast to the stored dtype
            weight_bwd += numel * (dtype_bytes(read) + dtype_bytes(stored))
            weight_grad_casts += 1
    back = act_casts + narrower
    return NodeTraffic(
        read_ratio=act_run / act_captured if act_captured else 1.0,
        write_ratio=_ratio(dtype[node.name], node.dtype),
        weight_read_bytes=weight_read,
        forward_cast_bytes=sum(numel * (dtype_bytes(held) + dtype_bytes(op_dtype)) for numel, held in act_casts),
        forward_cast_kernels=len(act_casts),
        backward_cast_bytes=sum(numel * (dtype_bytes(held) + dtype_bytes(op_dtype)) for numel, held in back),
        backward_cast_kernels=len(back),
        weight_forward_cast_bytes=weight_fwd,
        weight_backward_cast_bytes=weight_bwd,
        weight_casts=weight_casts,
        weight_grad_casts=weight_grad_casts,
    )


def _ratio(run_dtype: str, captured_dtype: str) -> float:
    if run_dtype not in FLOATING or captured_dtype not in FLOATING:
        return 1.0
    return dtype_bytes(run_dtype) / dtype_bytes(captured_dtype)
