"""Compute time: a per-op roofline on the device, forward and backward apart.

For an op with F FLOPs that moves M bytes, on a device of peak P FLOP/s (efficiency η on
matmuls) and memory bandwidth W bytes/s (Williams et al., "Roofline", CACM 2009)::

    t_fwd(op) = max(F / (η·P), M / W)
    t_bwd(op) = 2 · t_fwd(op)        (gradients w.r.t. inputs and weights: two matmuls each)

Activation bytes scale with the micro-batch b (captured at b₀); weight bytes do not. A dropout
with p > 0 also writes its one-byte keep mask (M += numel; torch's ``native_dropout``).
Recompute adds a forward: all of each block (full) or its non-matmul ops (selective).

Attention (``scaled_dot_product_attention``, F = 4·n·E FLOPs over n = B·H·L·S scores of head
size E) is priced by the kernel that runs it (``ATTENTION_KERNELS``):

    flash         the roofline above: q, k, v read, the output written; the L×S scores live
                  in on-chip memory (torch SDPA's FlashAttention kernels; autoshard's programs)
    materialized  the scores go through HBM (Megatron-LM's ``CoreAttention``, 2021-22:
                  baddbmm → fused scale-mask-softmax → dropout → bmm), a roofline per kernel
                  (``materialized_attention_s``), a = bytes per activation element:

        QKᵀ       max(F/2 / (η·P), (|q| + |k| + n·a) / W)
        softmax   2·n·a / W                       (read the scores, write the probabilities)
        dropout   (2·a + 1)·n / W  when p > 0     (and a one-byte keep mask)
        PV        max(F/2 / (η·P), (n·a + |v| + |out|) / W)
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.cost.memory import COMPUTE_HEAVY_TARGETS
from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.topology import DeviceSpec

BACKWARD_TO_FORWARD = 2.0  # FLOPs of backward / forward for matmul-dominated models
ATTENTION_KERNELS = ("flash", "materialized")  # module doc
SDPA_TARGET = "aten.scaled_dot_product_attention"
DROPOUT_TARGET = "aten.dropout"
MASK_BYTES = 1  # torch's dropout keeps a bool mask per element


@dataclass(frozen=True)
class ComputeTime:
    forward_s: float
    backward_s: float
    recompute_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s


def op_forward_s(node: OpNode, weight_bytes: int, scale: float, device: DeviceSpec, elem_ratio: float,
                 attention: str = "flash", captured_bytes: int = 4) -> float:
    """Roofline time of one op at ``scale`` times the captured batch (attention by its kernel)."""
    assert attention in ATTENTION_KERNELS, attention
    if attention == "materialized" and node.target.startswith(SDPA_TARGET):
        return materialized_attention_s(node, scale, device, elem_ratio, captured_bytes)
    flops = node.flops * scale
    moved = (node.bytes_read - weight_bytes) * scale * elem_ratio + weight_bytes + node.bytes_written * scale * elem_ratio
    if node.target.startswith(DROPOUT_TARGET) and node.attrs.get("p") and node.attrs.get("train", True):
        moved += MASK_BYTES * node.output_numel * scale
    return max(flops / _matmul_flops_per_s(device), moved / _bytes_per_s(device))


def materialized_attention_s(node: OpNode, scale: float, device: DeviceSpec, elem_ratio: float,
                             captured_bytes: int = 4) -> float:
    """QKᵀ, softmax, dropout and PV through HBM (module doc): n = F / (4·E) scores, E the output's
    head size; q, k and v taken as equal thirds of the bytes read (self-attention, no mask)."""
    flops, a = node.flops * scale, elem_ratio * captured_bytes
    scores = flops / (4 * node.shape[-1])
    qkv, out = node.bytes_read * scale * elem_ratio, node.bytes_written * scale * elem_ratio
    matmul, bandwidth = _matmul_flops_per_s(device), _bytes_per_s(device)
    qk = max(flops / 2 / matmul, (2 / 3 * qkv + scores * a) / bandwidth)
    softmax = 2 * scores * a / bandwidth
    dropout = (2 * a + MASK_BYTES) * scores / bandwidth if node.attrs.get("dropout_p") else 0.0
    pv = max(flops / 2 / matmul, (scores * a + qkv / 3 + out) / bandwidth)
    return qk + softmax + dropout + pv


def _matmul_flops_per_s(device: DeviceSpec) -> float:
    return device.peak_tflops * 1e12 * device.matmul_efficiency


def _bytes_per_s(device: DeviceSpec) -> float:
    return device.memory_bandwidth_gbps * 1e9


def microbatch_compute(graph: OpGraph, microbatch_size: int, recompute: str, device: DeviceSpec,
                       activation_elem_bytes: int = 4, captured_bytes: int = 4, attention: str = "flash") -> ComputeTime:
    """Forward, backward and recompute seconds of one micro-batch on one device."""
    scale = microbatch_size / graph.batch_size
    ratio = activation_elem_bytes / captured_bytes
    weights = _weight_bytes_per_node(graph)
    fwd = {n.name: op_forward_s(n, weights.get(n.name, 0), scale, device, ratio, attention, captured_bytes)
           for n in graph.nodes}
    forward_s = sum(fwd.values())
    return ComputeTime(forward_s, BACKWARD_TO_FORWARD * forward_s, _recompute_s(graph, fwd, recompute))


def model_flops_per_sample(graph: OpGraph) -> float:
    """Forward + backward FLOPs of one sample, recompute not counted (for MFU)."""
    return (1 + BACKWARD_TO_FORWARD) * graph.flops_fwd / graph.batch_size


def _recompute_s(graph: OpGraph, fwd: dict[str, float], recompute: str) -> float:
    if recompute == "none":
        return 0.0
    nodes = [graph.node(n) for b in graph.blocks for n in b.node_names]
    if recompute == "selective":
        nodes = [n for n in nodes if not n.target.startswith(COMPUTE_HEAVY_TARGETS)]
    return sum(fwd[n.name] for n in nodes)


def _weight_bytes_per_node(graph: OpGraph) -> dict[str, int]:
    return graph.derived("weight_bytes_per_node", lambda: _weight_bytes(graph))


def _weight_bytes(graph: OpGraph) -> dict[str, int]:
    size = {p.name: p.numel * _dtype_bytes(p.dtype) for p in graph.params}
    for p in graph.params:
        for alias in p.tied_to:
            size[alias] = size[p.name]
    return {n.name: sum(size.get(p, 0) for p in n.param_inputs) for n in graph.nodes if n.param_inputs}


def _dtype_bytes(dtype: str) -> int:
    return {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1}.get(dtype, 4)
