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

The kernels that run the ops (``KERNELS``, ``tables.Runtime.kernels``):

    fused   the roofline above, one η for every matmul, W for every other op, backward 2·forward:
            fused kernels as Megatron-LM runs them, and CPU ranks (whose figures ``autoshard
            calibrate`` measures)
    eager   eager PyTorch on a GPU (``cost.eager``): matmuls at η(M, N) by their output's tiles and
            waves, forward and backward apart (input and weight gradients); SDPA at FlashAttention-2's
            utilization (causal work halved, backward 2.5× forward); every other op one kernel,
            T_KERNEL + bytes / W, backward 2× forward (it reads the output gradient and the saved
            input, writes the input gradient)
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.cost import eager
from autoshard.cost.autocast import NodeTraffic
from autoshard.cost.memory import COMPUTE_HEAVY_TARGETS, alternate_reruns
from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.topology import DeviceSpec

BACKWARD_TO_FORWARD = 2.0  # FLOPs of backward / forward for matmul-dominated models
ATTENTION_KERNELS = ("flash", "materialized")  # module doc
SDPA_TARGET = "aten.scaled_dot_product_attention"
DROPOUT_TARGET = "aten.dropout"
MASK_BYTES = 1  # torch's dropout keeps a bool mask per element
KERNELS = ("fused", "eager")  # module doc
CONVOLUTION_TARGETS = ("aten.convolution", "aten.conv1d", "aten.conv2d", "aten.conv3d")


@dataclass(frozen=True)
class ComputeTime:
    forward_s: float
    backward_s: float
    recompute_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s


def op_forward_s(
    node: OpNode,
    weight_bytes: int,
    scale: float,
    device: DeviceSpec,
    elem_ratio: float,
    attention: str = "flash",
    captured_bytes: int = 4,
    kernels: str = "fused",
    traffic: NodeTraffic | None = None,
) -> float:
    """Time of one op at ``scale`` times the captured batch: attention by its kernel, the rest by
    ``kernels`` (module doc); ``traffic``: its bytes and casts under autocast (``cost.autocast``, eager only)."""
    assert attention in ATTENTION_KERNELS, attention
    assert kernels in KERNELS, kernels
    if attention == "materialized" and node.target.startswith(SDPA_TARGET):
        return materialized_attention_s(node, scale, device, elem_ratio, captured_bytes)
    flops, moved = node.flops * scale, _moved_bytes(node, weight_bytes, scale, elem_ratio, traffic)
    if kernels == "eager":
        return _eager_forward_s(node, flops, moved, device) + casts_s(traffic, scale, device, backward=False)
    return max(flops / _matmul_flops_per_s(device), moved / _bytes_per_s(device))


def op_backward_s(
    node: OpNode,
    weight_bytes: int,
    scale: float,
    device: DeviceSpec,
    elem_ratio: float,
    forward_s: float,
    kernels: str = "fused",
    traffic: NodeTraffic | None = None,
) -> float:
    """Backward time of one op whose forward takes ``forward_s``: 2·forward (fused); eager: a matmul's
    input and weight gradients priced apart, FlashAttention 2.5·forward, other ops 2·forward, each with
    its autocast casts undone on the gradients (``traffic``)."""
    if kernels != "eager":
        return BACKWARD_TO_FORWARD * forward_s
    casts = casts_s(traffic, scale, device, backward=True)
    own_s = forward_s - casts_s(traffic, scale, device, backward=False)
    if node.target.startswith(eager.MATMUL_2D_TARGETS + eager.MATMUL_BATCHED_TARGETS):
        moved = _moved_bytes(node, weight_bytes, scale, elem_ratio, traffic)
        return eager.matmul_backward_s(node.target, node.shape, node.flops * scale, moved, device) + casts
    if node.target.startswith(SDPA_TARGET):
        return eager.FLASH_BACKWARD_TO_FORWARD * own_s + casts
    return BACKWARD_TO_FORWARD * own_s + casts


def _moved_bytes(
    node: OpNode, weight_bytes: int, scale: float, elem_ratio: float, traffic: NodeTraffic | None = None
) -> float:
    """Activation bytes × (b/b₀)·(a/captured), weights once, a dropout's keep mask (module doc); under
    autocast (``traffic``) activations in the dtypes the op reads and writes, weights as it reads them."""
    if traffic is None:
        moved = (
            (node.bytes_read - weight_bytes) * scale * elem_ratio
            + weight_bytes
            + node.bytes_written * scale * elem_ratio
        )
    elif node.bytes_read == 0 and node.bytes_written == 0:  # a view moves nothing
        return 0.0
    else:
        moved = (
            (node.bytes_read - weight_bytes) * scale * traffic.read_ratio
            + traffic.weight_read_bytes
            + node.bytes_written * scale * traffic.write_ratio
        )
    if node.target.startswith(DROPOUT_TARGET) and node.attrs.get("p") and node.attrs.get("train", True):
        moved += MASK_BYTES * node.output_numel * scale
    return moved


def casts_s(traffic: NodeTraffic | None, scale: float, device: DeviceSpec, backward: bool) -> float:
    """The autocast casts around one op (``cost.autocast``): its activations' (× b/b₀) and, on a
    parameter's first read of the micro-batch, the parameter's; one copy kernel each."""
    if traffic is None:
        return 0.0
    if backward:
        acts, kernels = traffic.backward_cast_bytes, traffic.backward_cast_kernels
        weights, weight_kernels = traffic.weight_backward_cast_bytes, traffic.weight_grad_casts
    else:
        acts, kernels = traffic.forward_cast_bytes, traffic.forward_cast_kernels
        weights, weight_kernels = traffic.weight_forward_cast_bytes, traffic.weight_casts
    return eager.cast_s(acts * scale, device, kernels) + eager.cast_s(weights, device, weight_kernels)


def _eager_forward_s(node: OpNode, flops: float, moved: float, device: DeviceSpec) -> float:
    if node.target.startswith(eager.MATMUL_2D_TARGETS + eager.MATMUL_BATCHED_TARGETS):
        return eager.matmul_forward_s(node.target, node.shape, flops, moved, device)
    if node.target.startswith(SDPA_TARGET):
        return eager.flash_forward_s(flops, moved, bool(node.attrs.get("is_causal")), device)
    if node.target.startswith(CONVOLUTION_TARGETS):  # the plain roofline
        return max(flops / _matmul_flops_per_s(device), moved / _bytes_per_s(device))
    return eager.elementwise_s(moved, device)


def materialized_attention_s(
    node: OpNode, scale: float, device: DeviceSpec, elem_ratio: float, captured_bytes: int = 4
) -> float:
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


def microbatch_compute(
    graph: OpGraph,
    microbatch_size: int,
    recompute: str,
    device: DeviceSpec,
    activation_elem_bytes: int = 4,
    captured_bytes: int = 4,
    attention: str = "flash",
) -> ComputeTime:
    """Forward, backward and recompute seconds of one micro-batch on one device."""
    scale = microbatch_size / graph.batch_size
    ratio = activation_elem_bytes / captured_bytes
    weights = weight_bytes_per_node(graph)
    fwd = {
        n.name: op_forward_s(n, weights.get(n.name, 0), scale, device, ratio, attention, captured_bytes)
        for n in graph.nodes
    }
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
    elif recompute == "alternate":
        again = alternate_reruns(graph)
        nodes = [n for n in nodes if not n.target.startswith(COMPUTE_HEAVY_TARGETS) or n.name in again]
    return sum(fwd[n.name] for n in nodes)


def weight_bytes_per_node(graph: OpGraph) -> dict[str, int]:
    return graph.derived("weight_bytes_per_node", lambda: _weight_bytes(graph))


def _weight_bytes(graph: OpGraph) -> dict[str, int]:
    size = {p.name: p.numel * _dtype_bytes(p.dtype) for p in graph.params}
    for p in graph.params:
        for alias in p.tied_to:
            size[alias] = size[p.name]
    direct = {n.name: sum(size.get(p, 0) for p in n.param_inputs) for n in graph.nodes if n.param_inputs}
    # A view of a weight (annotate gives views no bytes: the transposed expert stack a grouped matmul reads)
    # moves nothing itself; the op reading the view reads the weight, once per micro-batch like any weight.
    views = {
        n.name: direct[n.name] for n in graph.nodes if n.name in direct and n.bytes_read == 0 and n.bytes_written == 0
    }
    out = {}
    for n in graph.nodes:
        weight = (0 if n.name in views else direct.get(n.name, 0)) + sum(views.get(i, 0) for i in n.inputs)
        if weight:
            out[n.name] = weight
    return out


def _dtype_bytes(dtype: str) -> int:
    return {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1}.get(dtype, 4)
