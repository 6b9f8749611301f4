"""float8 training (torchao's ``Float8Linear``) priced: the converted linears' matmuls at the device's float8
peak, and the casts that feed them.

Which linears (``float8_linears``: torchao's constraint and torchtitan's filter): every ``torch.nn.Linear`` whose
weight's two dims are divisible by 16 (``torch._scaled_mm`` needs it, ``ir.decisions.FLOAT8_DIM_MULTIPLE``), less
the output projection: the graph's last linear when it lies outside the repeated blocks (torchtitan's
``module_filter_fn`` skips "output", the LM head, whose logits float8 would round).

A converted linear y = x·Wᵀ (x: M×K, W: N×K, y: M×N) runs its three matmuls (the output, the input gradient,
the weight gradient) in float8 at the device's float8 peak P₈ (``DeviceSpec.float8_tflops``, a datasheet
figure: H100 SXM 1979 dense TFLOP/s, twice its 989 in bf16), with the same efficiency η (``cost.eager``: the
output's tiles and waves; the fused roofline one η) and the same bytes as its bf16 twin::

    t_mm8 = t_mm(the device with P₈ for P)    (``float8_device``; compute-bound: the bf16 time × P / P₈)

Each operand is cast to float8 before its matmul (``Float8Recipe``, ``ir.decisions.FLOAT8_RECIPES``); with a the
bytes of an activation element (2 in bf16) and n the operand's elements::

    one cast   = an amax pass (a reduction: reads n·a) + the scaled cast (reads n·a, writes n bytes)
                 = n·(2a + 1) bytes, 2 kernels
    tensorwise: one cast per operand, and its transposed float8 copy for the matmul that takes the transpose
                (``torch._scaled_mm`` takes its second operand column-major): reads n, writes n, one kernel;
                in a compiled block the cast writes both layouts at once (writes n, no kernel of its own)
    rowwise:    two casts per operand (one scale per row, along each axis), no transposed copy

    forward casts:   x (M·K) and W (N·K)·s_W      backward casts: dy (M·N)
    T_casts = kernels·T_KERNEL + bytes / (c·W)    (``eager.cast_s``: c = 0.62, dtype-converting copies
                                                   measured on one H200, ``cost.eager`` module doc "Casts")

s_W, the share of the weight a rank casts: 1, or 1/dp_shard where FSDP2 gathers the weights in float8
(tensorwise, ``Decisions.float8_all_gather``): each rank casts its shard before the all-gather, with the scale
``precompute_float8_dynamic_scale_for_fsdp`` computed after the optimizer step (one amax per weight shard and
one small all-reduce a step: not priced, 1/(dp·m) of the per-micro-batch weight casts), and the gathered float8
weight needs only its transposed copy. The all-gather's bytes stay the bf16 ones (an upper bound: float8
weights are half). A recomputed forward (full recompute) casts again: its time is the forward's.

Beside tensor parallelism each TP rank runs its shard of a converted linear: the unit's times above scale by the
layout's share per rank (``cost.tp_units``), matmuls and casts alike, which is exact for the matmul and the weight
cast (a shard of W) and, under sequence parallelism, for the input and output-gradient casts too (torchao's float8
TP styles cast the sequence shard before its all-gather). With tensorwise scaling under sequence parallelism
those all-gathers move float8 (``runtime.tensor_parallel``): of a block's collectives, the forward all-gathers
of the column splits' inputs and the backward all-gathers of the row splits' output gradients (half of them, in
bytes, as Megatron-LM counts them: 2 all-gathers and 2 reduce-scatters each way) move 1 byte an element instead
of a, and the reduce-scatters stay in a bytes::

    T_tp8 = T_tp · (1 − ½ + ½ · 1/a)    (a = 2: T_tp · 3/4; ``float8_tp_comm_factor``)

**Host, eager** (``add_float8_host``): outside a compiled block torchao issues each amax, scale and cast as its own
op from Python, through its float8 tensor subclass, and its backward is an ``autograd.Function`` written in Python,
so every op it adds costs the host the calibrated time of a Python-dispatched op, h_f (``cost.units``, "Host
time"). With n_f and n_b the ops one converted linear adds to a forward and to a backward (``EAGER_EXTRA_OPS``)::

    host_fwd(u) += n_f·h_f        host_bwd(u) += n_b·h_f        (per converted linear of unit u; a full recompute
                                                                 reruns the forward's n_f)

Inside a compiled block inductor fuses the casts into the block's kernels: no op of their own. On one H200
(torch 2.11, torchao 0.18, Llama-3.2-1B's shapes, benchmarks/reports/gpu-h200-2026-12-04) eager tensorwise float8
took 2.4× bf16's step, ~2.14 ms more per converted linear and micro-batch, against (32 + 68)·h_f = 2.09 ms at
that machine's h_f = 20.93 µs; the term was written after that run, so the run is not held out for it. Compiled
float8 ran 0.884 of compiled bf16's step, priced 0.916.

Pipeline stages keep TP's collectives in bf16 (``runtime.tensor_parallel_stages``' traced ops), and their
float8 weights are gathered by FSDP2 in bf16 (``Decisions.float8_all_gather`` is off there). Memory is
unchanged: torchao's table moves 0.1 GiB between bf16 and float8 for Llama-3 8B on 8 H100s
(``reference/NUMBERS.md``).
"""

from __future__ import annotations

from dataclasses import replace

from autoshard.cost import eager
from autoshard.ir.decisions import FLOAT8_DIM_MULTIPLE, FLOAT8_OFF, FLOAT8_RECIPES, Decisions, Float8Recipe
from autoshard.ir.graph import OpGraph, OpNode
from autoshard.ir.topology import DeviceSpec, HostOverheads

# float8 training as the cost model takes it: (the recipe of ir.decisions.FLOAT8_RECIPES, the converted linears'
# module paths, s_W: the share of each weight a rank casts, module doc); None: off
Float8 = tuple[str, tuple[str, ...], float]

LINEAR_TYPE = "torch.nn.modules.linear.Linear"
LINEAR_TARGETS = ("aten.linear", "aten.mm", "aten.addmm")
FLOAT8_ELEMENT_BYTES = 1  # torch.float8_e4m3fn / e5m2
AMAX_KERNELS = 1  # per cast: the amax reduction
CAST_KERNELS = 1  # per cast: the scaled cast
TRANSPOSE_KERNELS = 1  # tensorwise: the transposed float8 copy
# The ops torchao 0.18's eager Float8Linear adds to nn.Linear's, (n_f per forward, n_b per backward), by recipe:
# torch.profiler's aten events with no aten parent (what Python and autograd enter), one Linear(64, 64) on a CPU
# with emulate=True; tests/test_float8.py recounts them against the installed torchao
EAGER_EXTRA_OPS = {"tensorwise": (32, 68), "rowwise": (39, 82)}


def float8_linears(graph: OpGraph) -> tuple[str, ...]:
    """The module paths torchao converts (module doc), in graph order."""
    return graph.derived("float8_linears", lambda: _float8_linears(graph))


def _float8_linears(graph: OpGraph) -> tuple[str, ...]:
    weights = {p.module_path: p.shape for p in graph.params if p.name.endswith(".weight") and not p.is_buffer}
    linears = list(dict.fromkeys(n.module_path for n in graph.nodes if n.module_type == LINEAR_TYPE))
    in_block = {n for b in graph.blocks for n in b.node_names}
    last = next((n for n in reversed(graph.nodes) if n.module_type == LINEAR_TYPE), None)
    output_projection = last.module_path if last is not None and last.name not in in_block else None
    return tuple(
        path for path in linears if path != output_projection and _divisible(weights.get(path, ()), FLOAT8_DIM_MULTIPLE)
    )


def _divisible(shape: tuple[int, ...], multiple: int) -> bool:
    return len(shape) == 2 and all(d % multiple == 0 for d in shape)


def float8_of(decisions: Decisions, graph: OpGraph) -> Float8 | None:
    """(recipe, the linears it converts, s_W) of a point with float8 on, else None (module doc)."""
    if decisions.float8 == FLOAT8_OFF:
        return None
    share = 1 / decisions.dp_shard if decisions.float8_all_gather else 1.0
    return decisions.float8, float8_linears(graph), share


GATHER_SHARE = 0.5  # a sequence-parallel block's TP bytes that are all-gathers (module doc)


def float8_tp_comm_factor(decisions: Decisions, elem_bytes: float) -> float:
    """T_tp8 / T_tp (module doc): 1 − ½ + ½ · 1/a for tensorwise under sequence parallelism outside pipeline
    stages, else 1."""
    recipe = FLOAT8_RECIPES.get(decisions.float8)
    if recipe is None or not recipe.fsdp_float8_all_gather or not decisions.sequence_parallel or decisions.mesh.pp > 1:
        return 1.0
    return 1 - GATHER_SHARE + GATHER_SHARE * FLOAT8_ELEMENT_BYTES / elem_bytes


def float8_nodes(graph: OpGraph, linears: tuple[str, ...]) -> frozenset[str]:
    """The matmul nodes of the converted linears: what runs in float8."""
    paths = frozenset(linears)
    return graph.derived(
        ("float8_nodes", linears),
        lambda: frozenset(
            n.name for n in graph.nodes if n.module_path in paths and n.target.startswith(LINEAR_TARGETS)
        ),
    )


def float8_device(device: DeviceSpec) -> DeviceSpec:
    """The device as a float8 matmul sees it: its float8 peak for P (module doc)."""
    assert device.has_float8, device.name
    return replace(device, peak_tflops=device.float8_tflops)


def cast_bytes_per_element(recipe: Float8Recipe, elem_bytes: float) -> float:
    """Bytes a rank's casts move per operand element (module doc): casts·(2a + 1)."""
    return recipe.casts * (2 * elem_bytes + FLOAT8_ELEMENT_BYTES)


def transpose_bytes_per_element(recipe: Float8Recipe, compiled: bool = False) -> float:
    """tensorwise's transposed float8 copy (module doc): read and write 1 byte each; in a compiled block only the
    write (the cast writes both layouts)."""
    if not recipe.transposed_copy:
        return 0.0
    return FLOAT8_ELEMENT_BYTES * (1 if compiled else 2)


def cast_kernels(recipe: Float8Recipe, compiled: bool = False) -> int:
    """Kernels per operand: an amax and a cast per cast, and the transposed copy's own in eager."""
    transpose = TRANSPOSE_KERNELS if recipe.transposed_copy and not compiled else 0
    return recipe.casts * (AMAX_KERNELS + CAST_KERNELS) + transpose


def operand_casts_s(
    elements: float, cast_share: float, recipe: str, elem_bytes: float, device: DeviceSpec, compiled: bool = False
) -> float:
    """One operand of ``elements``: a rank casts ``cast_share`` of it, and transposes it whole (module doc)."""
    row = FLOAT8_RECIPES[recipe]
    moved = elements * (
        cast_share * cast_bytes_per_element(row, elem_bytes) + transpose_bytes_per_element(row, compiled)
    )
    return eager.cast_s(moved, device, kernels=cast_kernels(row, compiled))


def add_float8_host(
    graph: OpGraph,
    units: list[int],
    float8: Float8,
    recompute: str,
    host: HostOverheads,
    times: tuple[list[float], list[float], list[float]],
) -> None:
    """Each eagerly converted linear's own ops (``cost.float8``, "Host, eager"), added in place to the units' host
    forward, backward and full recompute: n_f·h_f, n_b·h_f, n_f·h_f. A compiled block's are replaced after
    (``cost.units.compiled_host_times``), as its casts are fused."""
    host_f, host_b, host_r = times
    n_f, n_b = EAGER_EXTRA_OPS[float8[0]]
    h_f = host.op_forward_us * 1e-6
    in_float8 = float8_nodes(graph, float8[1])
    last = len(graph.blocks) + 1
    for node, u in zip(graph.nodes, units):
        if node.name not in in_float8:
            continue
        host_f[u] += n_f * h_f
        host_b[u] += n_b * h_f
        if recompute == "full" and graph.blocks and 0 < u < last:
            host_r[u] += n_f * h_f


def linear_dims(node: OpNode, weight_shape: tuple[int, int], scale: float) -> tuple[float, int, int]:
    """(M, N, K) of a linear at ``scale`` times its captured batch: N×K its weight, M = output elements / N."""
    n, k = weight_shape
    return node.output_numel * scale / n, n, k


def forward_casts_s(
    node: OpNode,
    weight_shape: tuple[int, int],
    scale: float,
    float8: Float8,
    elem_bytes: float,
    device: DeviceSpec,
    compiled: bool = False,
) -> float:
    """The casts before the forward matmul: x (M·K), and the rank's share s_W of W (N·K) (module doc)."""
    recipe, _, weight_share = float8
    m, n, k = linear_dims(node, weight_shape, scale)
    return operand_casts_s(m * k, 1.0, recipe, elem_bytes, device, compiled) + operand_casts_s(
        n * k, weight_share, recipe, elem_bytes, device, compiled
    )


def backward_casts_s(
    node: OpNode,
    weight_shape: tuple[int, int],
    scale: float,
    float8: Float8,
    elem_bytes: float,
    device: DeviceSpec,
    compiled: bool = False,
) -> float:
    """The casts before the two gradient matmuls: dy (M·N) (module doc)."""
    m, n, _ = linear_dims(node, weight_shape, scale)
    return operand_casts_s(m * n, 1.0, float8[0], elem_bytes, device, compiled)


def weight_shapes(graph: OpGraph) -> dict[str, tuple[int, int]]:
    """Each linear node's weight shape (N, K), by node name."""
    return graph.derived("float8_weight_shapes", lambda: _weight_shapes(graph))


def _weight_shapes(graph: OpGraph) -> dict[str, tuple[int, int]]:
    shapes = {p.name: p.shape for p in graph.params}
    out = {}
    for node in graph.nodes:
        weight = next((shapes[p] for p in node.param_inputs if p.endswith(".weight") and p in shapes), None)
        if weight is not None and len(weight) == 2:
            out[node.name] = (weight[0], weight[1])
    return out
