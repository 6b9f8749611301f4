"""Pipeline units: the model as [prefix, block_0, ..., block_{L-1}, suffix], each priced alone.

A pipeline stage is a contiguous run of units (``autoshard.passes.planning.stage_cuts``). Node n
belongs to (``node_units``)::

    prefix (unit 0)        nodes before the first block's first node (embeddings)
    block k (unit k + 1)   the nodes of block k, and nodes after it and before block k + 1
                           (``pipeline()`` keeps such glue in the stage of the block before it)
    suffix (unit L + 1)    nodes after the last block (final norm, head, loss)

Per unit u, for a micro-batch of b samples (captured at b₀; t_fwd from
``compute.op_forward_s``, the same roofline as ``compute.microbatch_compute``, attention priced
by the given kernel; ``node_forward_s``)::

    fwd(u) = Σ_{n∈u} t_fwd(n)          bwd(u) = 2·fwd(u)
    recompute(u) = fwd(u) (full) | Σ_{n∈u, not matmul-class} t_fwd(n) (selective; alternate adds the matmuls
                   it recomputes, ``memory.alternate_recomputed``) | 0   (blocks only)
    params(u) = Σ numel of the distinct parameters u's nodes read (a tied weight counts in every
                unit that reads it: ``pipeline()`` gives each stage its own copy)
    saved(u)  = block_saved_bytes(block, recompute) for blocks, the outputs of the prefix / suffix
                nodes (the suffix also the loss's copy of the logits), all × (b/b₀)·(a/captured)
    workspace(u) = block_workspace_bytes(block, recompute) × the same scale (what one block's
                recomputation makes again: all its activations (full), its non-matmul outputs
                (selective), 0 (none))
    boundary(k) = input_bytes(block k) × the same scale: what a cut before block k sends
    tensors(u) = the distinct parameter tensors u's nodes read (the optimizer loops over them)

Σ_u saved(u) + max_u workspace(u) equals ``memory.activation_bytes`` of the whole model.

**Eager kernels** (``kernels="eager"``, ``compute.KERNELS``; ``cost.eager``): bwd(u) = Σ_{n∈u}
t_bwd(n) per op (``compute.op_backward_s``), and the suffix takes the fp32 loss over n = b·s·V
logits (the model's output, ``eager`` module doc "Loss")::

    fwd(suffix) += T_loss_fwd(n)       bwd(suffix) += T_loss_bwd(n)
    saved(suffix) = outputs of the suffix nodes but the bf16 logits (the upcast frees them) + 4·n
    workspace(suffix) = 8·n            (the loss's two fp32 gradients, at the start of backward)

and with the loss compiled (``compiled_loss``, ``eager`` module doc "Loss"; p the logits' bytes)::

    fwd(suffix) += T_kernel + 2·p·n / W      bwd(suffix) += T_kernel + 2·p·n / W
    saved(suffix) = outputs of the suffix nodes (the logits kept)
    workspace(suffix) = p·n            (the logits' gradient)

**Host time** (``host_times``; figures h from ``autoshard calibrate``, ``ir.specs.HostOverheads``):
with n(u) the unit's ops and l(u) its light ones (blocks only, recompute)::

    host_fwd(u) = n(u)·h_f        host_bwd(u) = n(u)·h_b
    host_recompute(u) = n(u)·h_f + h_ckpt (full) | l(u)·h_f + (n(u) + l(u))·h_sel (selective) | 0

and, with float8 outside compiled blocks, each converted linear's own ops (``add_float8_host``, ``cost.float8``).

On CPU ranks (gloo) the host is the device: these add to the roofline. On GPUs the host runs
ahead of the kernels it launches, so only what it does not hide counts, over the whole micro-batch
(``exposed_host``): the host queues the forward's kernels faster than they run, and that lead hides the
backward's host time where it exceeds the backward's device time (autograd reruns a checkpointed region
as its gradient is reached, so a recompute's host time is the backward's). (Hidden per pass alone, a
selective recompute whose light ops take little device time paid its whole policy cost: +19 % on a 1.5B
Llama on one H200; hidden per unit, +30 %: benchmarks/reports/gpu-h200-2026-11-26.) A compiled block's recompute runs
inside its compiled backward: no checkpoint policy per op, one launch per recomputed kernel
(``compiled_recompute_host``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from autoshard.cost import eager
from autoshard.cost.autocast import Autocast, NodeTraffic, autocast_traffic
from autoshard.cost.compiled import FusedOp, block_kernels, compiled_traffic, fused_ops
from autoshard.cost.compute import (
    BACKWARD_TO_FORWARD,
    CONVOLUTION_TARGETS,
    SDPA_TARGET,
    op_backward_s,
    op_forward_s,
    weight_bytes_per_node,
)
from autoshard.cost.float8 import (
    Float8,
    add_float8_host,
    backward_casts_s,
    float8_device,
    float8_nodes,
    forward_casts_s,
    weight_shapes,
)
from autoshard.cost.memory import (
    COMPUTE_HEAVY_TARGETS,
    alternate_reruns,
    block_backward_bytes,
    block_saved_bytes,
    block_workspace_bytes,
    non_block_saved_bytes,
    output_bytes,
    output_split,
)
from autoshard.cost.saved import WHOLE, RankShare, needs_grad, saved_by, weight_grad_inputs
from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.names import home_index
from autoshard.ir.topology import DeviceSpec, HostOverheads


@dataclass(frozen=True)
class Units:
    """Per-micro-batch costs of the L + 2 units (module doc), in unit order."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    recompute_s: tuple[float, ...]
    params: tuple[int, ...]
    saved_bytes: tuple[int, ...]
    workspace_bytes: tuple[int, ...]
    boundary_bytes: tuple[int, ...]  # per block (L entries): bytes sent at a cut before it
    tensors: tuple[int, ...] = ()  # parameter tensors per unit
    host_forward_s: tuple[float, ...] = ()  # host time not hidden by the device, per unit (module doc)
    host_backward_s: tuple[float, ...] = ()
    host_recompute_s: tuple[float, ...] = ()
    backward_bytes: tuple[int, ...] = ()  # activation gradients a unit's backward holds at once (blocks)

    @functools.cached_property
    def host_s(self) -> tuple[float, ...]:
        """Host time per unit of one micro-batch: forward + backward + recompute."""
        if not self.host_forward_s:
            return (0.0,) * len(self.forward_s)
        return tuple(map(sum, zip(self.host_forward_s, self.host_backward_s, self.host_recompute_s)))

    @functools.cached_property
    def compute_s(self) -> tuple[float, ...]:
        """fwd + bwd + recompute per unit, device and host."""
        return tuple(map(sum, zip(self.forward_s, self.backward_s, self.recompute_s, self.host_s)))

    @property
    def blocks(self) -> int:
        return len(self.forward_s) - 2


def node_units(graph: OpGraph) -> tuple[int, ...]:
    """The unit index (module doc) of every node, in graph order (once per graph: the search reads it per table)."""
    return graph.derived("node_units", lambda: tuple(_node_units(graph)))


def _node_units(graph: OpGraph) -> list[int]:
    block_index = {name: k for k, b in enumerate(graph.blocks) for name in b.node_names}
    units, current = [], 0
    for node in graph.nodes:
        if node.name in block_index:
            current = block_index[node.name] + 1
        units.append(current)
    if graph.blocks:  # nodes after the last block's last node form the suffix
        last = max(i for i, n in enumerate(graph.nodes) if n.name in block_index)
        units[last + 1 :] = [len(graph.blocks) + 1] * (len(units) - last - 1)
    return units


def node_forward_s(
    graph: OpGraph,
    microbatch_size: int,
    device: DeviceSpec,
    activation_elem_bytes: int,
    captured_bytes: int = 4,
    attention: str = "flash",
    kernels: str = "fused",
    autocast: Autocast | None = None,
    compiled: bool = False,
    float8: Float8 | None = None,
) -> list[float]:
    """t_fwd of every node of one micro-batch, in graph order (``compute.op_forward_s``); computed once
    per graph and arguments (a search asks for each micro-batch size once per TP degree and recompute mode).
    ``autocast``: (autocast dtype, the dtype parameters are read in or None) where eager kernels run under
    autocast: each op's bytes in its own dtypes, with the casts autocast adds (``cost.autocast``).
    ``compiled``: eager kernels with each block compiled (``cost.compiled``). ``float8``: (recipe, the converted
    linears): their matmuls at the float8 peak, with their casts (``cost.float8``)."""
    compiled = compiled and kernels == "eager"  # the fused roofline already prices fused kernels
    key = (
        "node_forward_s",
        microbatch_size,
        device,
        activation_elem_bytes,
        captured_bytes,
        attention,
        kernels,
        autocast,
        compiled,
    ) + ((float8,) if float8 else ())
    return graph.derived(
        key,
        lambda: _node_forward_s(
            graph,
            microbatch_size,
            device,
            activation_elem_bytes,
            captured_bytes,
            attention,
            kernels,
            autocast,
            compiled,
            float8,
        ),
    )


def _node_forward_s(
    graph: OpGraph,
    microbatch_size: int,
    device: DeviceSpec,
    activation_elem_bytes: int,
    captured_bytes: int,
    attention: str,
    kernels: str,
    autocast: Autocast | None,
    compiled: bool = False,
    float8: Float8 | None = None,
) -> list[float]:
    scale = microbatch_size / graph.batch_size
    ratio = activation_elem_bytes / captured_bytes
    weights = weight_bytes_per_node(graph)
    fused, in_block = (fused_ops(graph), _block_nodes(graph)) if compiled else ({}, frozenset())
    in_float8, shapes = _float8_nodes(graph, float8)
    times = []
    for node, traffic in zip(graph.nodes, _traffic(graph, kernels, autocast)):
        weight = weights.get(node.name, 0)
        if node.name in fused:
            times.append(_fused_forward_s(fused[node.name], weight, scale * ratio, device))
            continue
        if node.name in in_block:
            traffic = compiled_traffic(traffic)
        if node.name in in_float8:
            t = op_forward_s(
                node, weight, scale, float8_device(device), ratio, attention, captured_bytes, kernels, traffic
            )
            shape = shapes[node.name]
            casts = forward_casts_s(node, shape, scale, float8, activation_elem_bytes, device, node.name in in_block)
            times.append(t + casts)
            continue
        times.append(op_forward_s(node, weight, scale, device, ratio, attention, captured_bytes, kernels, traffic))
    return times


def _float8_nodes(graph: OpGraph, float8: Float8 | None) -> tuple[frozenset[str], dict[str, tuple[int, int]]]:
    """The nodes that run in float8 (``cost.float8``) and each linear's weight shape; none without float8."""
    if not float8:
        return frozenset(), {}
    return float8_nodes(graph, float8[1]), weight_shapes(graph)


def _fused_forward_s(op: FusedOp, weight_bytes: int, byte_scale: float, device: DeviceSpec) -> float:
    """One fused op's share of its group's kernel (``cost.compiled`` module doc)."""
    moved = (op.read_bytes + op.written_bytes) * byte_scale + weight_bytes
    fixed = eager.KERNEL_FIXED_US * 1e-6 if op.starts_kernel else 0.0
    return fixed + moved / eager.bytes_per_s(device)


def _block_nodes(graph: OpGraph) -> frozenset[str]:
    return graph.derived("block_node_names", lambda: frozenset(n for b in graph.blocks for n in b.node_names))


def node_backward_s(
    graph: OpGraph,
    microbatch_size: int,
    device: DeviceSpec,
    activation_elem_bytes: int,
    captured_bytes: int = 4,
    attention: str = "flash",
    kernels: str = "fused",
    autocast: Autocast | None = None,
    compiled: bool = False,
    float8: Float8 | None = None,
) -> list[float]:
    """t_bwd of every node of one micro-batch, in graph order (``compute.op_backward_s``); a fused op of a
    compiled block 2·t_fwd (``cost.compiled``); a float8 linear's gradient matmuls at the float8 peak, after
    the output gradient's casts (``cost.float8``)."""
    forward = node_forward_s(
        graph,
        microbatch_size,
        device,
        activation_elem_bytes,
        captured_bytes,
        attention,
        kernels,
        autocast,
        compiled,
        float8,
    )
    scale = microbatch_size / graph.batch_size
    ratio = activation_elem_bytes / captured_bytes
    weights = weight_bytes_per_node(graph)
    in_float8, shapes = _float8_nodes(graph, float8)
    if kernels != "eager" and not in_float8:
        return [BACKWARD_TO_FORWARD * t for t in forward]
    fused, in_block = (fused_ops(graph), _block_nodes(graph)) if compiled else ({}, frozenset())
    times = []
    for node, t, traffic in zip(graph.nodes, forward, _traffic(graph, kernels, autocast)):
        if node.name in fused:
            times.append(BACKWARD_TO_FORWARD * t)
            continue
        if node.name in in_block:
            traffic = compiled_traffic(traffic)
        if node.name in in_float8:
            times.append(
                _float8_backward_s(
                    node,
                    weights.get(node.name, 0),
                    scale,
                    device,
                    ratio,
                    kernels,
                    traffic,
                    shapes[node.name],
                    float8,
                    activation_elem_bytes,
                    node.name in in_block,
                )
            )
            continue
        if kernels != "eager":
            times.append(BACKWARD_TO_FORWARD * t)
            continue
        times.append(op_backward_s(node, weights.get(node.name, 0), scale, device, ratio, t, kernels, traffic))
    return times


def _float8_backward_s(
    node: OpNode,
    weight: int,
    scale: float,
    device: DeviceSpec,
    ratio: float,
    kernels: str,
    traffic: NodeTraffic | None,
    shape: tuple[int, int],
    float8: Float8,
    elem_bytes: int,
    compiled: bool,
) -> float:
    """A float8 linear's two gradient matmuls at the float8 peak and the output gradient's casts (``cost.float8``)."""
    device8 = float8_device(device)
    matmul_s = op_forward_s(node, weight, scale, device8, ratio, kernels=kernels, traffic=traffic)
    own = op_backward_s(node, weight, scale, device8, ratio, matmul_s, kernels, traffic)
    return own + backward_casts_s(node, shape, scale, float8, elem_bytes, device, compiled)


def _traffic(graph: OpGraph, kernels: str, autocast: Autocast | None) -> tuple[NodeTraffic | None, ...]:
    """Each node's bytes and casts under autocast (eager kernels only), else None for each."""
    if autocast is None or kernels != "eager":
        return (None,) * len(graph.nodes)
    return autocast_traffic(graph, *autocast)


def loss_logits(graph: OpGraph, microbatch_size: int) -> float:
    """n = b·s·V: elements of the model's output (the logits) in one micro-batch of b samples."""
    return graph.nodes[-1].output_numel * microbatch_size / graph.batch_size if graph.nodes else 0.0


def unit_costs(
    graph: OpGraph,
    microbatch_size: int,
    recompute: str,
    device: DeviceSpec,
    activation_elem_bytes: int,
    captured_bytes: int = 4,
    attention: str = "flash",
    host: HostOverheads | None = None,
    host_overlaps: bool = False,
    kernels: str = "fused",
    autocast: Autocast | None = None,
    compiled: bool = False,
    float8: Float8 | None = None,
    compiled_loss: bool = False,
) -> Units:
    """The ``Units`` of one micro-batch of ``microbatch_size`` samples (module doc); ``autocast``,
    ``compiled`` and ``float8`` as ``node_forward_s`` takes them; ``compiled_loss``: the loss compiled (module
    doc, "Eager kernels")."""
    count = len(graph.blocks) + 2
    scale = microbatch_size / graph.batch_size
    ratio = activation_elem_bytes / captured_bytes
    units = node_units(graph)
    forward, backward, light = [0.0] * count, [0.0] * count, [0.0] * count
    compiled = compiled and kernels == "eager"
    args = (
        graph,
        microbatch_size,
        device,
        activation_elem_bytes,
        captured_bytes,
        attention,
        kernels,
        autocast,
        compiled,
        float8,
    )
    rerun = alternate_reruns(graph) if recompute == "alternate" else frozenset()
    for node, u, t, b in zip(graph.nodes, units, node_forward_s(*args), node_backward_s(*args)):
        forward[u] += t
        backward[u] += b
        if not node.target.startswith(COMPUTE_HEAVY_TARGETS) or node.name in rerun:
            light[u] += t
    recomputed = {"none": [0.0] * count, "full": list(forward), "selective": light, "alternate": light}[recompute]
    recompute_s = [0.0] + list(recomputed[1:-1]) + [0.0] if graph.blocks else [0.0] * count
    saved, workspace, backward_bytes = unit_activation_bytes(
        graph, microbatch_size, recompute, activation_elem_bytes, captured_bytes, kernels, compiled_loss=compiled_loss
    )
    if kernels == "eager" and graph.nodes:
        add_loss_time = _add_compiled_loss_time if compiled_loss else _add_fp32_loss_time
        add_loss_time(graph, microbatch_size, device, forward, backward, activation_elem_bytes)
    host = host or HostOverheads.none()
    host_f, host_b, host_r = host_times(graph, units, recompute, host)
    if float8:
        add_float8_host(graph, units, float8, recompute, host, (host_f, host_b, host_r))
    if compiled:
        host_f, host_b = compiled_host_times(graph, host_f, host_b)
    if compiled:
        host_r = compiled_recompute_host(graph, host_r, forward, recompute_s)
    if host_overlaps:
        host_f, host_b, host_r = exposed_host(host_f, host_b, host_r, forward, backward, recompute_s)
    return Units(
        forward_s=tuple(forward),
        backward_s=tuple(backward),
        recompute_s=tuple(recompute_s),
        params=unit_params(graph, units),
        saved_bytes=tuple(saved),
        workspace_bytes=tuple(workspace),
        boundary_bytes=tuple(int(b.input_bytes * scale * ratio) for b in graph.blocks),
        tensors=unit_tensors(graph, units),
        host_forward_s=tuple(host_f),
        host_backward_s=tuple(host_b),
        host_recompute_s=tuple(host_r),
        backward_bytes=backward_bytes,
    )


def unit_activation_bytes(
    graph: OpGraph,
    microbatch_size: int,
    recompute: str,
    activation_elem_bytes: int,
    captured_bytes: int = 4,
    kernels: str = "fused",
    share: RankShare = WHOLE,
    compiled_loss: bool = False,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(saved, workspace, backward) bytes per unit of one micro-batch (module doc), on one TP rank of
    ``share`` (``cost.saved.RankShare``: the per-op rules on its shards' shapes); with eager kernels the
    fp32 loss's (``_add_fp32_loss_bytes``: the loss reads the model's output whole on every TP rank, or its
    vocabulary shard under loss parallelism), or with ``compiled_loss`` the compiled loss's
    (``_add_compiled_loss_bytes``)."""

    def compute():
        scale = microbatch_size / graph.batch_size
        ratio = activation_elem_bytes / captured_bytes
        captured_saved, captured_workspace, captured_backward = _unit_bytes_at_capture(graph, recompute, ratio, share)
        saved = [int(b * scale) for b in captured_saved]
        workspace = [int(b * scale) for b in captured_workspace]
        if kernels == "eager" and graph.nodes:
            add_loss_bytes = _add_compiled_loss_bytes if compiled_loss else _add_fp32_loss_bytes
            add_loss_bytes(graph, microbatch_size, scale * ratio, saved, workspace, share)
        backward = (0, *(int(b * scale) for b in captured_backward), 0)
        return tuple(saved), tuple(workspace), backward

    key = ("unit_activation_bytes", microbatch_size, recompute, activation_elem_bytes, captured_bytes, kernels, share)
    key += ("compiled loss",) if compiled_loss else ()
    return graph.derived(key, compute)


def unit_weight_grad_bytes(
    graph: OpGraph, microbatch_size: int, activation_elem_bytes: int, captured_bytes: int = 4, share: RankShare = WHOLE
) -> tuple[int, ...]:
    """Per unit, what a split backward keeps of one micro-batch between its input and weight passes
    (``cost.saved.weight_grad_inputs``), on one TP rank of ``share``, at ``microbatch_size``."""

    def at_capture() -> tuple[int, ...]:
        ratio = activation_elem_bytes / captured_bytes
        by_unit: list[list] = [[] for _ in range(len(graph.blocks) + 2)]
        for node, u in zip(graph.nodes, node_units(graph)):
            by_unit[u].append(node)
        return tuple(weight_grad_inputs(graph, nodes, ratio, share) for nodes in by_unit)

    def scaled() -> tuple[int, ...]:
        captured = graph.derived(("unit_weight_grad_bytes", activation_elem_bytes, captured_bytes, share), at_capture)
        scale = microbatch_size / graph.batch_size
        return tuple(int(b * scale) for b in captured)

    return graph.derived(
        ("unit_weight_grad_bytes", microbatch_size, activation_elem_bytes, captured_bytes, share), scaled
    )


def _unit_bytes_at_capture(
    graph: OpGraph, recompute: str, ratio: float, share: RankShare
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``unit_activation_bytes``'s saved and workspace bytes per unit and backward bytes per block at the captured
    batch, before the micro-batch's scale: one walk of the graph per (recompute, ratio, share), however many
    micro-batch sizes the search prices (each scales these)."""

    def compute():
        return (
            tuple(_saved_bytes(graph, recompute, node_units(graph), ratio, share)),
            tuple(_workspace_bytes(graph, recompute, ratio, share)),
            graph.derived(
                ("block_backward_bytes", ratio, share),  # the same under every recompute mode
                lambda: graph.per_block(
                    ("block_backward_bytes", ratio, share), lambda b: block_backward_bytes(graph, b, ratio, share)
                ),
            ),
        )

    return graph.derived(("unit_bytes_at_capture", recompute, ratio, share), compute)


def kernel_fixed_s(graph: OpGraph, recompute: str) -> float:
    """The device's fixed time per kernel (``eager.KERNEL_FIXED_US``) inside one eager micro-batch:
    T_KERNEL × (3·k + k_light + loss kernels), k the elementwise ops that move bytes (forward once,
    backward twice as ``compute.op_backward_s`` prices them), k_light those of blocks recomputed
    (selective; all of them under full). Part of ``unit_costs``'s times, named for reports."""
    matmuls = eager.MATMUL_2D_TARGETS + eager.MATMUL_BATCHED_TARGETS + CONVOLUTION_TARGETS + (SDPA_TARGET,)
    in_block = {n for b in graph.blocks for n in b.node_names}
    kernels = [n for n in graph.nodes if (n.bytes_read or n.bytes_written) and not n.target.startswith(matmuls)]
    rerun = [n for n in kernels if n.name in in_block] if recompute != "none" else []
    count = (
        (1 + BACKWARD_TO_FORWARD) * len(kernels) + len(rerun) + eager.LOSS_FORWARD_KERNELS + eager.LOSS_BACKWARD_KERNELS
    )
    return count * eager.KERNEL_FIXED_US * 1e-6


def _add_fp32_loss_time(
    graph: OpGraph,
    microbatch_size: int,
    device: DeviceSpec,
    forward: list[float],
    backward: list[float],
    activation_elem_bytes: int,
) -> None:
    """The eager fp32 loss's time in the suffix (module doc, "Eager kernels"); its bytes are fp32's and the
    16-bit logits' whatever ``activation_elem_bytes``."""
    del activation_elem_bytes
    n = loss_logits(graph, microbatch_size)
    forward[-1] += eager.loss_forward_s(n, device)
    backward[-1] += eager.loss_backward_s(n, device)


def _add_compiled_loss_time(
    graph: OpGraph,
    microbatch_size: int,
    device: DeviceSpec,
    forward: list[float],
    backward: list[float],
    activation_elem_bytes: int,
) -> None:
    """The compiled loss's time in the suffix (``cost.eager`` module doc, "Loss": the logits of
    ``activation_elem_bytes`` each read twice forward, read and their gradient written backward)."""
    n = loss_logits(graph, microbatch_size)
    forward[-1] += eager.compiled_loss_forward_s(n, activation_elem_bytes, device)
    backward[-1] += eager.compiled_loss_backward_s(n, activation_elem_bytes, device)


def _add_fp32_loss_bytes(
    graph: OpGraph,
    microbatch_size: int,
    byte_scale: float,
    saved: list[int],
    workspace: list[int],
    share: RankShare = WHOLE,
) -> None:
    """The eager fp32 loss's bytes in the suffix (module doc, "Eager kernels"): the fp32 log-softmax kept in
    place of the logits and the loss's copy, and its two fp32 gradients as workspace; on a TP rank of ``share``
    holding 1/tp of the logits (loss parallelism, ``memory.output_split``) its shard's log-softmax and the three
    fp32 tensors of the shard its backward holds at once."""
    split = output_split(graph, share)
    tp = share.tp if split else 1
    n = loss_logits(graph, microbatch_size) / tp
    logits = int(graph.nodes[-1].bytes_written * byte_scale) // tp
    saved[-1] += int(eager.LOSS_SAVED_BYTES_PER_LOGIT * n) - logits  # in place of the loss's copy _saved_bytes counted
    transient = (
        eager.LOSS_PARALLEL_BACKWARD_TRANSIENT_BYTES_PER_LOGIT
        if split
        else eager.LOSS_BACKWARD_TRANSIENT_BYTES_PER_LOGIT
    )
    workspace[-1] = max(workspace[-1], int(transient * n))


def _add_compiled_loss_bytes(
    graph: OpGraph,
    microbatch_size: int,
    byte_scale: float,
    saved: list[int],
    workspace: list[int],
    share: RankShare = WHOLE,
) -> None:
    """The compiled loss's bytes in the suffix (``cost.eager`` module doc, "Loss"): it keeps the logits
    (``_saved_bytes`` counted them as the loss's input; its fp32 row statistic, 1/V of that, is left out) and
    its backward writes their gradient in their dtype; on a TP rank holding 1/tp of the logits (loss
    parallelism, ``memory.output_split``) its shard's."""
    del microbatch_size, saved
    tp = share.tp if output_split(graph, share) else 1
    logits = int(graph.nodes[-1].bytes_written * byte_scale) // tp
    workspace[-1] = max(workspace[-1], logits)


def host_times(
    graph: OpGraph, units: list[int], recompute: str, host: HostOverheads
) -> tuple[list[float], list[float], list[float]]:
    """Host seconds per unit of one micro-batch: forward, backward, recompute (module doc)."""
    count = len(graph.blocks) + 2
    ops, light = [0] * count, [0] * count
    again = alternate_reruns(graph) if recompute == "alternate" else frozenset()
    for node, u in zip(graph.nodes, units):
        ops[u] += 1
        light[u] += not node.target.startswith(COMPUTE_HEAVY_TARGETS) or node.name in again
    h_f, h_b = host.op_forward_us * 1e-6, host.op_backward_us * 1e-6
    if recompute == "full":
        rerun = [n * h_f + host.checkpoint_block_us * 1e-6 for n in ops]
    elif recompute in ("selective", "alternate"):
        rerun = [l_ * h_f + (n + l_) * host.selective_op_us * 1e-6 for n, l_ in zip(ops, light)]
    else:
        rerun = [0.0] * count
    rerun = [0.0] + rerun[1:-1] + [0.0] if graph.blocks else [0.0] * count  # blocks only, as recompute_s
    return [n * h_f for n in ops], [n * h_b for n in ops], rerun


def compiled_host_times(graph: OpGraph, host_f: list[float], host_b: list[float]) -> tuple[list[float], list[float]]:
    """Host seconds per unit with each block compiled: a block unit's kernels × ``eager.LAUNCH_US``, forward and
    backward (``cost.compiled`` module doc); the prefix and suffix as eager."""
    launch_s = [k * eager.LAUNCH_US * 1e-6 for k in block_kernels(graph).values()]
    return (
        [host_f[0], *launch_s, host_f[-1]] if graph.blocks else host_f,
        [host_b[0], *launch_s, host_b[-1]] if graph.blocks else host_b,
    )


def compiled_recompute_host(
    graph: OpGraph, host_r: list[float], forward: list[float], recompute: list[float]
) -> list[float]:
    """Host seconds of a compiled block's recompute: its share of the block's forward kernels, launched from the
    compiled backward (the partitioner puts the recomputed ops in the backward graph: no checkpoint policy
    runs per op), k(u) × LAUNCH_US × recompute(u) / fwd(u); the prefix and suffix as eager."""
    if not graph.blocks:
        return host_r
    kernels = list(block_kernels(graph).values())
    rerun = [
        k * eager.LAUNCH_US * 1e-6 * (r / f if f > 0 else 0.0)
        for k, r, f in zip(kernels, recompute[1:-1], forward[1:-1])
    ]
    return [host_r[0], *rerun, host_r[-1]]


def exposed_host(
    host_f: list[float],
    host_b: list[float],
    host_r: list[float],
    forward: list[float],
    backward: list[float],
    recompute: list[float],
) -> tuple[list[float], list[float], list[float]]:
    """The host time per unit that the device's work does not hide in one micro-batch (module doc, "Host time").

    The host queues kernels ahead of the device, so the device idles only where the host has fallen behind
    over everything launched so far. With the micro-batch's passes in order (forward units 0..U−1, then each
    unit's recompute and backward from U−1 down to 0), host time h_i and device time d_i per pass::

        E = max(0, max_k Σ_{i≤k} (h_i − d_i))

    E is what the micro-batch exposes (a two-stage flow with the device never ahead of the host). The units
    report it in proportion to each pass's own excess (max(0, h − d) per forward, per backward with its
    recompute, backward's part first), so a stage's units carry the share they cause."""
    per_f = _not_hidden(host_f, forward)
    per_b, per_r = _backward_not_hidden(host_b, host_r, backward, recompute)
    each = sum(per_f) + sum(per_b) + sum(per_r)
    if each <= 0.0:
        return per_f, per_b, per_r
    passes = [h - d for h, d in zip(host_f, forward)] + [
        hb + hr - b - r for hb, hr, b, r in reversed(list(zip(host_b, host_r, backward, recompute)))
    ]
    lead, exposed = 0.0, 0.0
    for excess in passes:
        lead += excess
        exposed = max(exposed, lead)
    share = exposed / each
    return [x * share for x in per_f], [x * share for x in per_b], [x * share for x in per_r]


def _not_hidden(host: list[float], device: list[float]) -> list[float]:
    return [max(0.0, h - d) for h, d in zip(host, device)]


def _backward_not_hidden(
    host_b: list[float], host_r: list[float], backward: list[float], recompute: list[float]
) -> tuple[list[float], list[float]]:
    """The backward pass's host time that its device time (backward and recompute together) does not
    hide, split as (backward's part, recompute's part): backward's first, up to what it alone exposes."""
    exposed = _not_hidden([b + r for b, r in zip(host_b, host_r)], [b + r for b, r in zip(backward, recompute)])
    backward_part = [min(e, max(0.0, h - d)) for e, h, d in zip(exposed, host_b, backward)]
    return backward_part, [e - b for e, b in zip(exposed, backward_part)]


def unit_tensors(graph: OpGraph, units: list[int]) -> tuple[int, ...]:
    """Parameter tensors (not buffers) read by each unit; a tied one in every unit that reads it."""
    return tuple(len(names) for names in _unit_param_names(graph, units))


def stage_ranges(cuts: tuple[int, ...], blocks: int) -> list[tuple[int, int]]:
    """[(c_s, c_{s+1})] for every stage, with c_0 = 0 and c_S = L: stage s holds blocks [c_s, c_{s+1})."""
    edges = [0, *cuts, blocks]
    return list(zip(edges, edges[1:]))


def stage_units(block_range: tuple[int, int], blocks: int) -> list[int]:
    """Unit indices of a stage holding blocks [i, j): the prefix with block 0, the suffix with the last."""
    i, j = block_range
    return ([0] if i == 0 else []) + list(range(i + 1, j + 1)) + ([blocks + 1] if j == blocks else [])


def unit_params(graph: OpGraph, units: list[int]) -> tuple[int, ...]:
    """Parameters (not buffers) held by each unit: those it reads, a tied one in every unit that reads it, and
    each one no unit reads in its home unit (``unread_param_homes``)."""
    held = [sum(graph.param(n).numel for n in names) for names in _unit_param_names(graph, units)]
    for name, home in unread_param_homes(graph, units).items():
        held[home] += graph.param(name).numel
    return tuple(held)


def unread_param_homes(graph: OpGraph, units: list[int]) -> dict[str, int]:
    """The unit that holds each parameter no node reads (a causal-LM decoder's cross-attention, which its forward
    never calls), by name: as a pipeline stage does (``runtime.stage_state.unread_state_homes``), the first
    unit that reads state (parameters or buffers) of its nearest enclosing module, else unit 0. One process and
    the SPMD programs hold it too (``OpGraph.param_count``); only its weight is ever made, but it is priced as
    any parameter, as the SPMD estimate prices it."""
    return graph.derived(("unread_param_homes", tuple(units)), lambda: _unread_param_homes(graph, units))


def _unread_param_homes(graph: OpGraph, units: list[int]) -> dict[str, int]:
    read: list[set[str]] = [set() for _ in range(len(graph.blocks) + 2)]
    for node, u in zip(graph.nodes, units):
        read[u].update(graph.param(n).name for n in node.param_inputs)
    every_read = set().union(*read)
    return {p.name: home_index(p.name, read) for p in graph.params if not p.is_buffer and p.name not in every_read}


def unit_param_names(graph: OpGraph) -> list[set[str]]:
    """The names of the parameters (and buffers) each unit reads, in unit order."""
    return _unit_param_names(graph, node_units(graph))


def _unit_param_names(graph: OpGraph, units: list[int]) -> list[set[str]]:
    return graph.derived(("unit_param_names", tuple(units)), lambda: _param_names_by_unit(graph, units))


def _param_names_by_unit(graph: OpGraph, units: list[int]) -> list[set[str]]:
    seen: list[set[str]] = [set() for _ in range(len(graph.blocks) + 2)]
    for node, u in zip(graph.nodes, units):
        seen[u].update(graph.param(n).name for n in node.param_inputs if not graph.param(n).is_buffer)
    return seen


def _saved_bytes(graph: OpGraph, recompute: str, units: list[int], ratio: float, share: RankShare = WHOLE) -> list[int]:
    """Per unit, what it keeps for backward at the captured batch (``memory``, ``cost.saved``): the ops
    outside blocks in the prefix or suffix, each block by its mode, the tables blocks share in the
    prefix, the loss's copy of the output in the suffix."""
    saved = [0] * (len(graph.blocks) + 2)
    in_block = {n for b in graph.blocks for n in b.node_names}
    grads, seen = needs_grad(graph), set()
    for node, u in zip(graph.nodes, units):
        if node.name not in in_block:
            for key, nbytes in saved_by(graph, node, grads, ratio, share):
                if key not in seen:
                    seen.add(key)
                    saved[u] += nbytes
    outside, output = sum(saved), output_bytes(graph, ratio, share)
    saved[0] += non_block_saved_bytes(graph, ratio, share) - outside - output  # the tables the blocks share
    per_block = graph.per_block(
        ("block_saved_bytes", recompute, ratio, share), lambda b: block_saved_bytes(graph, b, recompute, ratio, share)
    )
    for k, nbytes in enumerate(per_block):
        saved[k + 1] += nbytes
    saved[-1] += output  # the loss's copy of the output
    return saved


def _workspace_bytes(graph: OpGraph, recompute: str, ratio: float, share: RankShare = WHOLE) -> list[int]:
    per_block = graph.per_block(
        ("block_workspace_bytes", recompute, ratio, share),
        lambda b: block_workspace_bytes(graph, b, recompute, ratio, share),
    )
    return [0, *per_block, 0]
