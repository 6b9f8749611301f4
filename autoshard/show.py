"""Rich tables for people reviewing a plan (``autoshard plan`` and ``autoshard inspect``)."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table

from autoshard.ir.plan import Plan, Predicted

MIB = 2**20
GIB = 2**30


WIDTH_WHEN_PIPED = 120  # rich's 80-column default for non-terminals wraps the alternatives table


def render_plan(plan: Plan, console: Console | None = None) -> None:
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, WIDTH_WHEN_PIPED)
    console.print(Group(decision_table(plan), memory_table(plan), time_table(plan), stages_table(plan),
                        alternatives_table(plan)))


def decision_table(plan: Plan) -> Table:
    c = plan.cluster
    t = Table(title=f"Plan for {plan.model['spec']}", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    t.add_row("model", f"{plan.model['params']:,} parameters, {plan.model['layers']} blocks")
    t.add_row("cluster", f"{c['name']}: {c['nodes']} node(s) x {c['devices_per_node']} devices ({c['backend']})")
    t.add_row("mesh", f"{plan.mesh}  ({plan.world_size} ranks)")
    t.add_row("ZeRO stage", f"{plan.zero_stage}  ({_zero_how(plan)})")
    t.add_row("batch", f"global {plan.global_batch} = {plan.mesh.dp} dp x {plan.num_microbatches} micro-batches "
                       f"x {plan.microbatch_size}")
    t.add_row("recompute", plan.recompute)
    t.add_row("schedule", plan.schedule)
    t.add_row("precision", plan.precision)
    if plan.zero_stage <= 1 and plan.mesh.dp > 1:
        t.add_row("DDP buckets", f"{plan.ddp_bucket_cap_mb:g} MiB")
    t.add_row("pinned by you", ", ".join(plan.pinned) or "nothing")
    return t


def memory_table(plan: Plan) -> Table:
    m = plan.predicted.memory
    device = plan.cluster["device"]["memory_bytes"]
    t = Table(title="Memory per rank (predicted peak)", title_justify="left")
    t.add_column("part")
    t.add_column("MiB", justify="right")
    for name, value in (("weights", m.params_bytes), ("gradients", m.grads_bytes), ("optimizer state", m.optimizer_bytes),
                        ("activations", m.activations_bytes), ("transient", m.transient_bytes)):
        t.add_row(name, f"{value / MIB:,.1f}")
    t.add_row("[bold]peak[/bold] (+ allocator slack)", f"[bold]{m.peak_bytes / MIB:,.1f}[/bold]")
    t.add_row("device memory", f"{device / MIB:,.0f}  ({m.peak_bytes / device:.1%} used)")
    return t


def time_table(plan: Plan) -> Table:
    p = plan.predicted
    t = Table(title="Time per step (predicted)", title_justify="left")
    t.add_column("part")
    t.add_column("ms", justify="right")
    t.add_row("compute (fwd + bwd + recompute + optimizer)", f"{p.compute_s * 1e3:,.3f}")
    t.add_row("exposed communication", f"{p.comm_exposed_s * 1e3:,.3f}")
    t.add_row("  (all communication, hidden or not)", f"{p.comm_total_s * 1e3:,.3f}")
    t.add_row("pipeline bubble", f"{p.bubble_s * 1e3:,.3f}")
    t.add_row("[bold]step[/bold]", f"[bold]{p.step_time_s * 1e3:,.3f}[/bold]")
    t.add_row("throughput", f"{p.tokens_per_s:,.0f} tokens/s, {p.samples_per_s:,.1f} samples/s")
    t.add_row("MFU", f"{p.mfu:.1%}")
    return t


def stages_table(plan: Plan) -> Table:
    t = Table(title="Stages and tensor parallelism", title_justify="left")
    t.add_column("stage")
    t.add_column("ranks")
    t.add_column("modules")
    for s in plan.stages:
        t.add_row(str(s.index), _ranks(s.ranks), ", ".join(s.modules))
    tp = ", ".join(f"{k}: {v}" for k, v in plan.tensor_parallel.items()) or "none (tp=1)"
    t.caption = f"tensor parallel styles: {tp}"
    return t


def alternatives_table(plan: Plan) -> Table:
    t = Table(title="Alternatives considered", title_justify="left")
    for col in ("dp x tp x pp", "ZeRO", "micro-batch", "recompute", "step ms", "peak MiB", "why not chosen"):
        t.add_column(col, justify="right" if col in ("step ms", "peak MiB", "micro-batch") else "left")
    t.add_row(_mesh(plan.mesh), str(plan.zero_stage), str(plan.microbatch_size), plan.recompute,
              *_time_mem(plan.predicted), "[green]chosen[/green]")
    for a in plan.alternatives:
        t.add_row(_mesh(a.mesh), str(a.zero_stage), str(a.microbatch_size), a.recompute, *_time_mem(a.predicted),
                  a.why_not)
    return t


def _mesh(mesh) -> str:
    return f"{mesh.dp}x{mesh.tp}x{mesh.pp}"


def _time_mem(p: Predicted | None) -> tuple[str, str]:
    if p is None:
        return "-", "-"
    return f"{p.step_time_s * 1e3:,.3f}", f"{p.memory_peak_bytes_per_rank / MIB:,.1f}"


def _zero_how(plan: Plan) -> str:
    return {0: "DDP, nothing sharded", 1: "optimizer state sharded (ZeroRedundancyOptimizer)",
            2: "gradients + optimizer state sharded (FSDP2)", 3: "weights, gradients, optimizer state sharded (FSDP2)"}[plan.zero_stage]


def _ranks(ranks: tuple[int, ...]) -> str:
    if ranks and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ", ".join(map(str, ranks))
