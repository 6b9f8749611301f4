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
and t_* the measured medians (``fit_host``)::

    op_forward_us        h_f = (t_fwd − R(all)) / N
    op_backward_us       h_b = (t_fwd+bwd − t_fwd − 2·R(all)) / N
    selective_op_us      (t_selective − t_fwd+bwd − N_l·h_f − R(light)) / (N_b + N_l)
    checkpoint_block_us  (t_full − t_fwd+bwd − N_b·h_f − R(blocks)) / K
    fsdp_unit_zero{2,3}  (t_fsdp − t_fwd+bwd − comm(U units)) / U, comm by comm.py on the link
    optimizer_tensor_us  (t_adamw − 28·P / W) / T     (P parameters, W memory bandwidth; ``cost.step``)
    sharded_optimizer…   the same over FSDP2's sharded parameters (P / N per rank)
    pipeline_microbatch  slope of the 1F1B step over micro-batches − the slower stage's ops − 2·p2p

Every figure is clamped at 0: a negative one means the part is within the noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from autoshard.cost import comm
from autoshard.cost.step import ADAM_BYTES_PER_PARAM
from autoshard.ir.topology import Cluster, HostOverheads

WIDTH, HEADS, TOKENS, BLOCKS = 16, 2, 8, 4
PIPELINE_MICROBATCHES = (2, 8)


def probe_model():
    """K narrow transformer blocks (pre-norm attention + GELU MLP) and a linear head."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (p(x).view(b, s, -1, WIDTH // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(b, s, -1))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(WIDTH), Attention(), nn.LayerNorm(WIDTH)
            self.fc, self.proj = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.proj(F.gelu(self.fc(self.ln_2(x))))

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.head = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            for block in self.h:
                x = block(x)
            return self.head(x)

    return Probe()


def probe_input(batch: int = 1):
    import torch

    return torch.randn(batch, TOKENS, WIDTH)


# --------------------------------------------------------------------------- worker side


def measure(time_op: Callable[[Callable[[], None]], float], ranks: int) -> dict[str, Any]:
    """The probes' medians in seconds (module doc), on every rank at once; ``time_op`` as calibrate's."""
    import torch

    from autoshard.runtime.parallel import apply_recompute

    torch.manual_seed(0)
    x = probe_input()
    blocks = [f"h.{k}" for k in range(BLOCKS)]
    plain = probe_model()
    out: dict[str, Any] = {"fwd": time_op(lambda: plain(x)), "fwd_bwd": time_op(_fwd_bwd(plain, x))}
    for mode in ("selective", "full"):
        out[mode] = time_op(_fwd_bwd(apply_recompute(probe_model(), blocks, mode), x))
    out["adamw"], out["tensors"], out["params"] = _optimizer_probe(time_op, plain)
    if ranks > 1:
        out |= _fsdp_probes(time_op, x, blocks)
    if ranks > 1 and ranks % 2 == 0:
        out["pipeline"] = {m: _pipeline_probe(time_op, m, ranks) for m in PIPELINE_MICROBATCHES}
    return out


def _fwd_bwd(model, x) -> Callable[[], None]:
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


def _fsdp_probes(time_op, x, blocks: list[str]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.runtime.parallel import apply_fsdp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for stage, reshard in ((2, False), (3, True)):
        model = apply_fsdp(probe_model(), mesh, blocks, reshard_after_forward=reshard)
        out[f"fsdp{stage}"] = time_op(_fwd_bwd(model, x))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(x).sum().backward()
    out["sharded_adamw"] = time_op(opt.step)
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
    parts = pp.build_pipeline_stages(model, (x[:1],), [f"h.{BLOCKS // 2}"], mesh.get_local_rank("pp"), 2, 1,
                                     torch.device("cpu"), mesh.get_group("pp"))
    schedule = pp.build_schedule(parts, microbatches, lambda out, target: out.sum(), "1f1b")
    target = torch.zeros(microbatches)
    step = (lambda: pp.pipeline_step(schedule, parts, (x,), target))
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
    unit_param_bytes: tuple[int, ...]  # per FSDP unit: K blocks, then the root (head)
    boundary_bytes: int  # one micro-batch's activation between the pipeline stages


def probe_counts(cluster: Cluster) -> ProbeCounts:
    """Capture the probe like a user's model and count its ops (module doc)."""
    import torch

    from autoshard.cost.memory import COMPUTE_HEAVY_TARGETS
    from autoshard.cost.units import node_forward_s
    from autoshard.passes.annotate import annotate
    from autoshard.passes.capture import capture_module

    with torch.device("meta"):
        model = probe_model()
    graph = annotate(capture_module(model, (probe_input().to("meta"),), where="probe"))
    times = node_forward_s(graph, 1, cluster.device, 4, 4)
    in_block = [n.module_path.startswith("h.") for n in graph.nodes]
    light = [b and not n.target.startswith(COMPUTE_HEAVY_TARGETS) for n, b in zip(graph.nodes, in_block)]
    first = [n.module_path.startswith(tuple(f"h.{k}." for k in range(BLOCKS // 2))) for n in graph.nodes]
    unit_bytes = [4 * sum(p.numel() for p in model.h[k].parameters()) for k in range(BLOCKS)]
    return ProbeCounts(
        ops=len(graph.nodes), block_ops=sum(in_block), light_block_ops=sum(light), roofline_s=sum(times),
        block_roofline_s=sum(t for t, b in zip(times, in_block) if b),
        light_roofline_s=sum(t for t, b in zip(times, light) if b),
        stage_ops=(sum(first), len(first) - sum(first)),
        stage_roofline_s=(sum(t for t, f in zip(times, first) if f), sum(t for t, f in zip(times, first) if not f)),
        unit_param_bytes=(*unit_bytes, 4 * sum(p.numel() for p in model.head.parameters())),
        boundary_bytes=4 * TOKENS * WIDTH)


def fit_host(t: dict[str, Any], counts: ProbeCounts, cluster: Cluster, ranks: int, source: str) -> HostOverheads:
    """The ``HostOverheads`` the probes' times give (module doc)."""
    c = counts
    h_f = _at_least_0((t["fwd"] - c.roofline_s) / c.ops)
    h_b = _at_least_0((t["fwd_bwd"] - t["fwd"] - 2 * c.roofline_s) / c.ops)
    selective = (t["selective"] - t["fwd_bwd"] - c.light_block_ops * h_f - c.light_roofline_s) / \
        (c.block_ops + c.light_block_ops)
    full = (t["full"] - t["fwd_bwd"] - c.block_ops * h_f - c.block_roofline_s) / BLOCKS
    bandwidth = cluster.device.memory_bandwidth_gbps * 1e9
    adamw = (t["adamw"] - ADAM_BYTES_PER_PARAM * t["params"] / bandwidth) / t["tensors"]
    figures = {"op_forward_us": h_f, "op_backward_us": h_b, "selective_op_us": selective,
               "checkpoint_block_us": full, "optimizer_tensor_us": adamw}
    if "fsdp2" in t:
        units = len(c.unit_param_bytes)
        for stage in (2, 3):
            figures[f"fsdp_unit_zero{stage}_us"] = (t[f"fsdp{stage}"] - t["fwd_bwd"] -
                                                     _fsdp_comm_s(c, cluster, ranks, stage)) / units
        figures["sharded_optimizer_tensor_us"] = \
            (t["sharded_adamw"] - ADAM_BYTES_PER_PARAM * t["params"] / ranks / bandwidth) / t["tensors"]
    if "pipeline" in t:
        figures["pipeline_microbatch_us"] = _pipeline_residual_s(t["pipeline"], c, cluster, h_f, h_b)
    return HostOverheads(**{k: _us(v) for k, v in figures.items()} | _zeros_for_missing(figures), source=source)


def _fsdp_comm_s(c: ProbeCounts, cluster: Cluster, ranks: int, stage: int) -> float:
    """The probe's FSDP collectives as the cost model prices them: per unit an all-gather before
    forward (and again before backward for ZeRO-3) and a reduce-scatter after backward."""
    link = cluster.intra_node
    gathers = 2 if stage == 3 else 1
    return sum(gathers * comm.all_gather_s(b, ranks, link) + comm.reduce_scatter_s(b, ranks, link)
               for b in c.unit_param_bytes)


def _pipeline_residual_s(times: dict, c: ProbeCounts, cluster: Cluster, h_f: float, h_b: float) -> float:
    """Per micro-batch and stage: the step's slope over micro-batches (in 1F1B's steady state each
    micro-batch adds one slowest stage), less what the cost model already prices there (that
    stage's ops, forward and backward, and its two boundary transfers)."""
    (m0, t0), (m1, t1) = sorted((int(m), s) for m, s in times.items())
    slope = (t1 - t0) / (m1 - m0)
    ops = max(n * (h_f + h_b) + 3 * r for n, r in zip(c.stage_ops, c.stage_roofline_s))
    return slope - ops - 2 * comm.p2p_s(c.boundary_bytes, cluster.intra_node)


def _zeros_for_missing(figures: dict[str, float]) -> dict[str, float]:
    names = [f for f in HostOverheads.__dataclass_fields__ if f != "source"]
    return {n: 0.0 for n in names if n not in figures}


def _at_least_0(x: float) -> float:
    return max(0.0, x)


def _us(seconds: float) -> float:
    return float(f"{max(0.0, seconds) * 1e6:.4g}")

