"""Host-overhead probes for ``autoshard calibrate``: what the runtime costs beyond FLOPs and bytes.

A small model trains in a time the roofline cannot see: every op is dispatched by Python and
the ATen dispatcher, autograd records and replays it, FSDP2 runs hooks and copies around every
unit, the optimizer loops over tensors, a pipeline schedule bookkeeps every micro-batch. On GPUs
most of this hides behind kernels that are still running; on CPU ranks it *is* the step. The
probes measure it with the runtime's own parts (``runtime.parallel``, ``runtime.pipeline_parallel``)
on ``ProbeModel``: K transformer blocks of standard ops, so narrow (width 16, 8 tokens) that
their FLOPs and bytes take microseconds and what is left is host time. All ranks run each probe
at once, as in training (CPU ranks share cores).

With N ops in the probe's OpGraph (``probe_graph``, captured like any model: the cost model
counts ops the same way), N_b of them in blocks, N_l of those light (not matmul-class), R(·) the
roofline time of a set of ops on the calibrated device, K blocks, U = K + 1 FSDP units, T tensors,
and t_* the measured medians (``fit_host``; t_fwd, t_selective, t_full and t_split as t_fwd+bwd plus their median
difference from it over PROBE_ROUNDS rounds, ``_paired_medians``)::

    op_forward_us        h_f = (t_fwd − R(all)) / N
    op_backward_us       h_b = (t_fwd+bwd − t_fwd − 2·R(all)) / N
    selective_op_us      (t_selective − t_fwd+bwd − N_l·h_f − R(light)) / (N_b + N_l)
    checkpoint_block_us  (t_full − t_fwd+bwd − N_b·h_f − R(blocks)) / K
    weight_group_us      (t_split − t_fwd+bwd) / G: the backward split as zero-bubble schedules run it (the input's
                         gradient, then one autograd call per parameter group), G the ops that read a parameter
    fsdp_unit_zero{2,3}  r(w) = (t_fsdp − t_fwd+bwd − comm(U units)) / U at two widths w (comm by comm.py
                         on the link): r = a + S·c over the mean unit bytes S; a per unit, c per MiB
    fsdp_accumulate_unit (t_fsdp_nosync − t_fwd+bwd) / U: FSDP2 (ZeRO-2) on a micro-batch that synchronises no gradient
                         (weights gathered by a first call, gradients summed whole, no collective): its hooks alone
    ddp_tensor_us        (t_ddp − t_fwd+bwd − AR(all gradients)) / T
    zero1_tensor_us      (t_zero1 − AdamW(T/N tensors) − AG(all weights)) / T: per tensor, its broadcast's
                         latency as ZeroRedundancyOptimizer issues them (all at once, async) and its loop
    optimizer_tensor_us  (t_adamw − 28·P / W) / T     (P parameters, W memory bandwidth; ``cost.parts``)
    sharded_optimizer…   the same over FSDP2's sharded parameters (P / N per rank)
    pipeline_microbatch  slope of the 1F1B step over micro-batches − the slower stage's ops − 2·p2p
    pipeline_step_us     t(m₀) − (m₀ + 1)·slope: what a step costs beyond its m₀ + p − 1 stage slots
    tp_module_us         (t_tp − t_fwd+bwd − the 4 all-reduces per block) / (6K sharded linears),
                         every rank one TP rank of a pair (colwise q, k, v, fc; rowwise o, proj)
    tp_forward_share     (t_tp_fwd − t_fwd − 2K all-reduces) / (t_tp − t_fwd+bwd − 4K all-reduces): the share of that
                         DTensor time in the forward, which a recomputed forward pays again (``_forward_share``)
    sequence_module_us   (t_tp_sp − t_tp − the sequence collectives + the 4K all-reduces) / M: the same pair in
                         the sequence-parallel layout (``SP_STYLES``), M its modules that shard no weight (the
                         norms on the sequence shard, each sub-block's gather, the scatter in and the gather out)
    collective_wait_us   (t_between − t_matmuls − t_gathers) / K: K all-gathers of a probe activation over a pair of
                         ranks, each issued after a matmul (as a tensor-parallel step issues its collectives), against
                         the K matmuls alone and the K all-gathers back to back. Back to back, the ranks stay in step
                         and the backend's worker thread stays awake; between compute each collective also waits for
                         the other rank and for the worker to wake. The link's fit (and the probes above, whose ops
                         take microseconds) see only the back-to-back time

Every figure is clamped at 0: a negative one means the part is within the noise.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from autoshard.cost import comm
from autoshard.cost.memory import COMPUTE_HEAVY_TARGETS
from autoshard.cost.parts import ADAM_BYTES_PER_PARAM
from autoshard.cost.tp_units import weight_groups
from autoshard.cost.units import node_forward_s
from autoshard.ir.topology import Cluster, HostOverheads
from autoshard.passes.capturing.annotate import annotate

WIDTH, HEADS, TOKENS, BLOCKS = 16, 2, 8, 4
WIDE = 128  # FSDP2's cost grows with a unit's bytes: a second width separates the two
PIPELINE_MICROBATCHES = (2, 8)
K = TypeVar("K")
SHARES = ("tp_forward_share",)  # figures that are shares, not seconds (written as they are, not in µs)
PROBE_ROUNDS = 3  # the step probes, timed in rounds (``_paired_medians``)
BETWEEN_MATMUL_N, BETWEEN_COLLECTIVES = 256, 8  # collective_wait_us: n×n matmuls (≈ 0.3 ms on a CPU rank), K gathers


def probe_model(width: int = WIDTH):
    """K narrow transformer blocks (pre-norm attention + GELU MLP, each a module) and a linear head."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (p(x).view(b, s, -1, width // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(b, s, -1))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            return self.proj(F.gelu(self.fc(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(width), Attention(), nn.LayerNorm(width), MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.head = nn.Linear(width, width)

        def forward(self, x):
            for block in self.h:
                x = block(x)
            return self.head(x)

    return Probe()


def probe_input(batch: int = 1, width: int = WIDTH):
    import torch

    return torch.randn(batch, TOKENS, width)


def unit_param_bytes(width: int) -> tuple[int, ...]:
    """fp32 bytes of each FSDP unit of ``probe_model(width)``: K blocks (12w² + 13w), then the head."""
    return (*[4 * (12 * width * width + 13 * width)] * BLOCKS, 4 * (width * width + width))


# --------------------------------------------------------------------------- worker side


def measure(time_op: Callable[[Callable[[], None]], float], ranks: int) -> dict[str, Any]:
    """The probes' medians in seconds (module doc), on every rank at once; ``time_op`` as calibrate's."""
    import torch

    from autoshard.runtime.parallel import apply_recompute

    torch.manual_seed(0)
    x = probe_input()
    blocks = [f"h.{k}" for k in range(BLOCKS)]
    plain = probe_model()
    steps = {
        "fwd": lambda: plain(x),
        "fwd_bwd": fwd_bwd(plain, x),
        **{mode: fwd_bwd(apply_recompute(probe_model(), blocks, mode), x) for mode in ("selective", "full")},
        "split": _split_backward(plain, x),
    }
    out: dict[str, Any] = _paired_medians(time_op, steps, "fwd_bwd")
    out["adamw"], out["tensors"], out["params"] = _optimizer_probe(time_op, plain)
    if ranks > 1:
        out |= _fsdp_probes(time_op, blocks)
        out |= _ddp_probes(time_op, x, plain)
        extra = _tp_probes(time_op, x, plain, sequence_parallel=ranks % 2 == 0)  # 8 tokens split over a pair
        out["tp"] = out["fwd_bwd"] + extra["tp"]
        out["tp_fwd"] = out["fwd"] + extra["tp_fwd"]
        if "tp_sp" in extra:
            out["tp_sp"] = out["tp"] + extra["tp_sp"]
        out |= _collective_wait_probe(time_op, x)
    if ranks > 1 and ranks % 2 == 0:
        out["pipeline"] = {m: _pipeline_probe(time_op, m, ranks) for m in PIPELINE_MICROBATCHES}
    return out


def _paired_medians(
    time_op: Callable[[Callable[[], None]], float], steps: dict[str, Callable[[], None]], base: str
) -> dict[str, float]:
    """Each step's time as ``base``'s median over PROBE_ROUNDS rounds plus the median of its difference from
    ``base`` in the same round (``paired_over_rounds``): the figures are such differences, and a host's speed drifts
    between rounds (on an H200 machine the selective probe's excess over a plain step read 13-34 ms in eight rounds
    in one process, benchmarks/results/gpu-h200-2026-11-27/host-probe-noise.txt); paired, a slow period that falls
    on one round moves that round's pair together and the median drops it."""
    rounds = [{name: time_op(step) for name, step in steps.items()} for _ in range(PROBE_ROUNDS)]
    return paired_over_rounds(rounds, lambda _name: base)


def paired_over_rounds(rounds: list[dict[K, float]], base_of: Callable[[K], K]) -> dict[K, float]:
    """Per key k of the rounds' figures, with b = ``base_of(k)`` timed in the same rounds::

    t(k) = med_r t_r(b) + med_r (t_r(k) − t_r(b))        (t(b) = med_r t_r(b))"""
    return {
        k: statistics.median(r[base_of(k)] for r in rounds) + statistics.median(r[k] - r[base_of(k)] for r in rounds)
        for k in rounds[0]
    }


def _split_backward(model, x) -> Callable[[], None]:
    """A forward, then the backward as torch's zero-bubble schedules split it: the input's gradient, then the
    weights' with one ``autograd`` call per parameter group (``torch.distributed.pipelining``'s own functions)."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    x = x.detach().requires_grad_(True)  # as a stage past the first receives it: the input pass has work

    def step():
        x.grad = None  # the input pass writes it afresh each call
        out = model(x).clone()  # the split detaches the output in place: not the head's view
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], model.parameters())
        stage_backward_weight(model.parameters(), groups)

    return step


def fwd_bwd(model, x) -> Callable[[], None]:
    def step():
        model(x).sum().backward()

    return step


def _optimizer_probe(time_op, model) -> tuple[float, int, int]:
    import torch

    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    return time_op(opt.step), len(params), sum(p.numel() for p in params)


def _fsdp_probes(time_op, blocks: list[str]) -> dict[str, Any]:
    """FSDP2 (ZeRO-2 and 3) fwd + bwd at both widths, the plain model's at the wide one, and AdamW
    over the sharded parameters."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.runtime.parallel import apply_fsdp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {"fwd_bwd_wide": time_op(fwd_bwd(probe_model(WIDE), probe_input(width=WIDE)))}
    for width, suffix in ((WIDTH, ""), (WIDE, "_wide")):
        x = probe_input(width=width)
        for stage, reshard in ((2, False), (3, True)):
            model = apply_fsdp(probe_model(width), mesh, blocks, reshard_after_forward=reshard)
            out[f"fsdp{stage}{suffix}"] = time_op(fwd_bwd(model, x))
    out["fsdp_accumulate"] = time_op(
        _accumulating_fwd_bwd(apply_fsdp(probe_model(), mesh, blocks, reshard_after_forward=False), probe_input())
    )
    model = apply_fsdp(probe_model(), mesh, blocks, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(probe_input()).sum().backward()
    out["sharded_adamw"] = time_op(opt.step)
    return out


def _accumulating_fwd_bwd(model, x) -> Callable[[], None]:
    """fwd + bwd of an FSDP2 model on a micro-batch that synchronises no gradient, as ZeRO-0/1 beside tp or pp runs
    every micro-batch of a step but its last and a pipeline stage every one (``runtime.parallel.grad_sync``, torch's
    ``PipelineStage.backward_maybe_with_nosync``): the weights stay gathered from a first call, the gradients are
    summed whole, no collective runs."""
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    step = fwd_bwd(model, x)
    step()  # the one all-gather: the weights stay unsharded from here
    return step


TP_STYLES = {
    "attn.q": "colwise",
    "attn.k": "colwise",
    "attn.v": "colwise",
    "attn.o": "rowwise",
    "mlp.fc": "colwise",
    "mlp.proj": "rowwise",
}  # Megatron's layout of the probe's blocks
SP_STYLES = {
    **TP_STYLES,
    "ln_1": "sharded-input-dim1",
    "attn": "gather-seq-module-input-dim1",
    "attn.o": "rowwise-seq-output-dim1",
    "ln_2": "sharded-input-dim1",
    "mlp": "gather-seq-module-input-dim1",
    "mlp.proj": "rowwise-seq-output-dim1",
}  # Megatron's sequence-parallel layout of them, as the planner lays out GPT-2's blocks (norms on the sequence
# shard, each sub-block's input gathered, its output reduce-scattered)
SP_ENDS = {"h.0": "scatter-seq-input-dim1", "head": "gather-seq-input-dim1"}  # into and out of the sequence shard


def sequence_modules() -> int:
    """Modules of the sequence-parallel probe whose style shards no weight (``sequence_module_us``'s divisor)."""
    from autoshard.ir.decisions import SHARDING_STYLES

    return BLOCKS * sum(s not in SHARDING_STYLES for s in SP_STYLES.values()) + len(SP_ENDS)


def _tp_pairs():
    """The TP probes' (dp, tp) mesh: pairs of ranks (the probe's 2 heads split at most 2 ways), all ranks if odd."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    tp = 2 if world % 2 == 0 else world
    return init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))


def _tp_model(sequence_parallel: bool):
    """The probe over pairs of ranks in Megatron's layout, or its sequence-parallel one."""
    from autoshard.runtime.tensor_parallel import apply_tensor_parallel

    layout = SP_STYLES if sequence_parallel else TP_STYLES
    styles = {f"h.{k}.{name}": style for k in range(BLOCKS) for name, style in layout.items()}
    styles |= SP_ENDS if sequence_parallel else {}
    return apply_tensor_parallel(probe_model(), _tp_pairs()["tp"], styles)


def _tp_probes(time_op, x, plain, sequence_parallel: bool) -> dict[str, float]:
    """What tensor parallelism adds to the probe, timed in PROBE_ROUNDS rounds, each figure the median of its
    difference in a round from the step it adds DTensor to (as ``_paired_medians``): Megatron's layout's fwd + bwd
    over the plain fwd + bwd ("tp"), its forward over the plain forward ("tp_fwd"), and the sequence-parallel
    layout's fwd + bwd over Megatron's ("tp_sp"). Timed one by one, a difference of two probes read in different
    periods of a shared machine moved by more than itself (sequence_module_us 0-1,829 µs over nine calibrations
    in 40 minutes, 2026-11-27)."""
    tp = _tp_model(sequence_parallel=False)
    steps = {"plain": fwd_bwd(plain, x), "plain_fwd": lambda: plain(x), "tp": fwd_bwd(tp, x), "tp_fwd": lambda: tp(x)}
    base = {"tp": "plain", "tp_fwd": "plain_fwd"}
    if sequence_parallel:
        steps["tp_sp"], base["tp_sp"] = fwd_bwd(_tp_model(sequence_parallel=True), x), "tp"
    rounds = [{name: time_op(step) for name, step in steps.items()} for _ in range(PROBE_ROUNDS)]
    return {k: statistics.median(r[k] - r[b] for r in rounds) for k, b in base.items()}


def _collective_wait_probe(time_op, x) -> dict[str, float]:
    """K all-gathers of ``x`` over pairs of ranks (the TP probe's groups) through the functional collectives DTensor
    issues, each after an n×n matmul; the matmuls alone; the all-gathers back to back (module doc)."""
    import torch
    import torch.distributed._functional_collectives as funcol

    group = _tp_pairs()["tp"].get_group()
    a = torch.randn(BETWEEN_MATMUL_N, BETWEEN_MATMUL_N)

    def gather() -> None:
        funcol.wait_tensor(funcol.all_gather_single(x, 0, group))

    def matmuls() -> None:
        for _ in range(BETWEEN_COLLECTIVES):
            a @ a

    def between() -> None:
        for _ in range(BETWEEN_COLLECTIVES):
            a @ a
            gather()

    def gathers() -> None:
        for _ in range(BETWEEN_COLLECTIVES):
            gather()

    steps = {"between": between, "matmuls": matmuls, "gathers": gathers}
    return {f"collective_{k}": v for k, v in _paired_medians(time_op, steps, "matmuls").items()}


def _ddp_probes(time_op, x, plain) -> dict[str, Any]:
    """DDP's fwd + bwd (one bucket) and ZeroRedundancyOptimizer's step, over every rank."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from autoshard.runtime.parallel import apply_ddp

    ddp = apply_ddp(probe_model(), bucket_cap_mb=25.0)  # the default group: every rank
    out = {"ddp": time_op(fwd_bwd(ddp, x))}
    zero1 = ZeroRedundancyOptimizer(list(ddp.parameters()), optimizer_class=torch.optim.AdamW, lr=1e-3)
    out["zero1"] = time_op(zero1.step)
    return out


def _pipeline_probe(time_op, microbatches: int, ranks: int) -> float:
    """One 1F1B step of ``microbatches`` over 2 stages (ranks paired), batch = micro-batches."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.runtime import pipeline_parallel as pp

    mesh = init_device_mesh("cpu", (2, ranks // 2), mesh_dim_names=("pp", "dp"))
    model = probe_model()
    x = probe_input(microbatches)
    parts = pp.build_pipeline_stages(
        model,
        (x[:1],),
        [f"h.{BLOCKS // 2}"],
        mesh.get_local_rank("pp"),
        2,
        1,
        torch.device("cpu"),
        mesh.get_group("pp"),
    )
    schedule = pp.make_torch_schedule(parts, microbatches, lambda out, target: out.sum(), "1f1b")
    target = torch.zeros(microbatches)

    def step():
        return pp.pipeline_step(schedule, parts, (x,), target)

    t = time_op(step)
    dist.barrier()
    return t


# --------------------------------------------------------------------------- parent side


@dataclass(frozen=True)
class ProbeCounts:
    """Op counts of the probe's OpGraph and their roofline times on a device (module doc)."""

    ops: int
    block_ops: int
    light_block_ops: int
    roofline_s: float
    block_roofline_s: float
    light_roofline_s: float
    stage_ops: tuple[int, int]  # ops of the two pipeline stages
    stage_roofline_s: tuple[float, float]
    boundary_bytes: int  # one micro-batch's activation between the pipeline stages
    weight_groups: int = 0  # ops that read a parameter: the split backward's autograd calls (weight pass)


def probe_counts(cluster: Cluster) -> ProbeCounts:
    """Capture the probe like a user's model and count its ops (module doc)."""
    import torch

    from autoshard.passes.capturing.capture import capture_module  # torch

    with torch.device("meta"):
        model = probe_model()
    graph = annotate(capture_module(model, (probe_input().to("meta"),), where="probe"))
    times = node_forward_s(graph, 1, cluster.device, 4, 4)
    in_block = [n.module_path.startswith("h.") for n in graph.nodes]
    light = [b and not n.target.startswith(COMPUTE_HEAVY_TARGETS) for n, b in zip(graph.nodes, in_block)]
    first = [n.module_path.startswith(tuple(f"h.{k}." for k in range(BLOCKS // 2))) for n in graph.nodes]
    return ProbeCounts(
        ops=len(graph.nodes),
        block_ops=sum(in_block),
        light_block_ops=sum(light),
        roofline_s=sum(times),
        block_roofline_s=sum(t for t, b in zip(times, in_block) if b),
        light_roofline_s=sum(t for t, b in zip(times, light) if b),
        stage_ops=(sum(first), len(first) - sum(first)),
        stage_roofline_s=(sum(t for t, f in zip(times, first) if f), sum(t for t, f in zip(times, first) if not f)),
        boundary_bytes=4 * TOKENS * WIDTH,
        weight_groups=weight_groups(graph, [n.name for n in graph.nodes]),
    )


def fit_host(t: dict[str, Any], counts: ProbeCounts, cluster: Cluster, ranks: int, source: str) -> HostOverheads:
    """The ``HostOverheads`` the probes' times give (module doc)."""
    c = counts
    h_f = _at_least_0((t["fwd"] - c.roofline_s) / c.ops)
    h_b = _at_least_0((t["fwd_bwd"] - t["fwd"] - 2 * c.roofline_s) / c.ops)
    selective = (t["selective"] - t["fwd_bwd"] - c.light_block_ops * h_f - c.light_roofline_s) / (
        c.block_ops + c.light_block_ops
    )
    full = (t["full"] - t["fwd_bwd"] - c.block_ops * h_f - c.block_roofline_s) / BLOCKS
    bandwidth = cluster.device.memory_bandwidth_gbps * 1e9
    adamw = (t["adamw"] - ADAM_BYTES_PER_PARAM * t["params"] / bandwidth) / t["tensors"]
    figures = {
        "op_forward_us": h_f,
        "op_backward_us": h_b,
        "selective_op_us": selective,
        "checkpoint_block_us": full,
        "optimizer_tensor_us": adamw,
    }
    if "split" in t and c.weight_groups:
        figures["weight_group_us"] = (t["split"] - t["fwd_bwd"]) / c.weight_groups
    if "fsdp2" in t:
        for stage in (2, 3):
            figures[f"fsdp_unit_zero{stage}_us"], figures[f"fsdp_zero{stage}_us_per_mib"] = _fsdp_fit(
                t, cluster, ranks, stage
            )
        if "fsdp_accumulate" in t:
            figures["fsdp_accumulate_unit_us"] = (t["fsdp_accumulate"] - t["fwd_bwd"]) / len(unit_param_bytes(WIDTH))
        figures["sharded_optimizer_tensor_us"] = (
            t["sharded_adamw"] - ADAM_BYTES_PER_PARAM * t["params"] / ranks / bandwidth
        ) / t["tensors"]
        gradient_bytes = 4 * t["params"]
        figures["ddp_tensor_us"] = (
            t["ddp"] - t["fwd_bwd"] - comm.allreduce_s(gradient_bytes, ranks, cluster.intra_node)
        ) / t["tensors"]
        local_adamw = adamw * t["tensors"] / ranks + ADAM_BYTES_PER_PARAM * t["params"] / ranks / bandwidth
        gathered = comm.all_gather_s(gradient_bytes, ranks, cluster.intra_node)
        figures["zero1_tensor_us"] = (t["zero1"] - local_adamw - gathered) / t["tensors"]
        tp = 2 if ranks % 2 == 0 else ranks  # as ``_tp_pairs``
        all_reduces = 4 * BLOCKS * comm.allreduce_s(4 * TOKENS * WIDTH, tp, cluster.intra_node)
        figures["tp_module_us"] = (t["tp"] - t["fwd_bwd"] - all_reduces) / (len(TP_STYLES) * BLOCKS)
        if "tp_fwd" in t:
            figures["tp_forward_share"] = _forward_share(t, cluster, tp)
        if "collective_between" in t:
            figures["collective_wait_us"] = (
                t["collective_between"] - t["collective_matmuls"] - t["collective_gathers"]
            ) / BETWEEN_COLLECTIVES
        if "tp_sp" in t:
            figures["sequence_module_us"] = (t["tp_sp"] - t["tp"] - _sequence_comm_s(cluster, tp) + all_reduces) / (
                sequence_modules()
            )
    if "pipeline" in t:
        figures["pipeline_microbatch_us"], figures["pipeline_step_us"] = _pipeline_residual_s(
            t["pipeline"], c, cluster, h_f, h_b
        )
    shares = {k: float(f"{figures.pop(k):.4g}") for k in SHARES if k in figures}  # not seconds
    return HostOverheads(
        **{k: _us(v) for k, v in figures.items()} | shares | _zeros_for_missing(figures | shares), source=source
    )


def _forward_share(t: dict[str, Any], cluster: Cluster, tp: int) -> float:
    """The share of the TP probe's DTensor time in its forward: its 2K forward all-reduces (the rowwise outputs)
    and the plain forward taken from the forward alone, its 4K all-reduces and the plain step from the step::

        s = (t_tp_fwd − t_fwd − 2K·AR) / (t_tp − t_fwd+bwd − 4K·AR),   clamped to [0, 1]"""
    all_reduce = comm.allreduce_s(4 * TOKENS * WIDTH, tp, cluster.intra_node)
    whole = t["tp"] - t["fwd_bwd"] - 4 * BLOCKS * all_reduce
    forward = t["tp_fwd"] - t["fwd"] - 2 * BLOCKS * all_reduce
    return min(1.0, max(0.0, forward / whole)) if whole > 0 else 0.0


def _sequence_comm_s(cluster: Cluster, tp: int) -> float:
    """The sequence-parallel probe's collectives as the cost model prices them: per block and sub-block an
    all-gather of its input and a reduce-scatter of its output, forward and backward (each the other's
    gradient), and the head's all-gather and its backward; every one of the whole activation's bytes."""
    link, size = cluster.intra_node, 4 * TOKENS * WIDTH
    pair = comm.all_gather_s(size, tp, link) + comm.reduce_scatter_s(size, tp, link)
    return (2 * 2 * BLOCKS + 1) * pair


def _fsdp_fit(t: dict[str, Any], cluster: Cluster, ranks: int, stage: int) -> tuple[float, float]:
    """(a seconds per unit, c µs per MiB as seconds per MiB·1e-6) from the two widths (module doc)."""
    points = []
    for width, suffix in ((WIDTH, ""), (WIDE, "_wide")):
        sizes = unit_param_bytes(width)
        residual = t[f"fsdp{stage}{suffix}"] - t[f"fwd_bwd{suffix}"] - _fsdp_comm_s(sizes, cluster, ranks, stage)
        points.append((sum(sizes) / len(sizes) / 2**20, residual / len(sizes)))
    (s0, r0), (s1, r1) = points
    per_mib = max(0.0, (r1 - r0) / (s1 - s0))
    return r0 - per_mib * s0, per_mib


def _fsdp_comm_s(unit_bytes: tuple[int, ...], cluster: Cluster, ranks: int, stage: int) -> float:
    """The probe's FSDP collectives as the cost model prices them: per unit an all-gather before
    forward (and again before backward for ZeRO-3) and a reduce-scatter after backward."""
    link = cluster.intra_node
    gathers = 2 if stage == 3 else 1
    return sum(gathers * comm.all_gather_s(b, ranks, link) + comm.reduce_scatter_s(b, ranks, link) for b in unit_bytes)


def _pipeline_residual_s(times: dict, c: ProbeCounts, cluster: Cluster, h_f: float, h_b: float) -> tuple[float, float]:
    """Per micro-batch and stage: the step's slope over micro-batches (in 1F1B's steady state each
    micro-batch adds one slowest stage), less what the cost model already prices there (that
    stage's ops, forward and backward, and its two boundary transfers)."""
    (m0, t0), (m1, t1) = sorted((int(m), s) for m, s in times.items())
    slope = (t1 - t0) / (m1 - m0)
    ops = max(n * (h_f + h_b) + 3 * r for n, r in zip(c.stage_ops, c.stage_roofline_s))
    return slope - ops - 2 * comm.p2p_s(c.boundary_bytes, cluster.intra_node), t0 - (m0 + 1) * slope


def _zeros_for_missing(figures: dict[str, float]) -> dict[str, float]:
    names = [f for f in HostOverheads.__dataclass_fields__ if f != "source"]
    return {n: 0.0 for n in names if n not in figures}


def _at_least_0(x: float) -> float:
    return max(0.0, x)


def _us(seconds: float) -> float:
    return float(f"{max(0.0, seconds) * 1e6:.4g}")
