"""Rich tables for people reviewing a plan (``autoshard plan`` and ``autoshard inspect``)."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from autoshard.cost.schedule import bubble_fraction, format_grid, rank_orders, simulate

from autoshard.ir.plan import Plan, Predicted

MIB = 2**20
GIB = 2**30


WIDTH_WHEN_PIPED = 120  # rich's 80-column default for non-terminals wraps the alternatives table


def render_plan(plan: Plan, console: Console | None = None) -> None:
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, WIDTH_WHEN_PIPED)
    parts = [decision_table(plan), memory_table(plan), time_table(plan), stages_table(plan)]
    if plan.mesh.pp > 1:
        parts.append(schedule_panel(plan))
    if plan.tensor_parallel or plan.tensor_parallel_reasons:
        parts.append(tensor_parallel_table(plan))
    console.print(Group(*parts, alternatives_table(plan)))


MAX_GRID_MICROBATCHES = 4  # longer schedules repeat the same steady state; the grid shows the first 4


def schedule_panel(plan: Plan) -> Panel:
    """The pipeline schedule as a rank x time grid: stage, F/B, micro-batch; dots are idle."""
    m = min(plan.num_microbatches, MAX_GRID_MICROBATCHES)
    m -= m % plan.mesh.pp if plan.virtual_stages > 1 and m >= plan.mesh.pp else 0
    grid = simulate(rank_orders(plan.schedule, plan.mesh.pp, m, plan.virtual_stages),
                    plan.mesh.pp * plan.virtual_stages)
    shown = f"first {m} of {plan.num_microbatches} micro-batches" if m < plan.num_microbatches else f"{m} micro-batches"
    title = (f"Pipeline schedule {plan.schedule}, {plan.mesh.pp} ranks x {plan.virtual_stages} stages each, {shown}; "
             f"idle {bubble_fraction(grid):.0%}")
    return Panel(Text(format_grid(grid), no_wrap=True, overflow="ellipsis"), title=title, title_align="left")


def tensor_parallel_table(plan: Plan) -> Table:
    t = Table(title=f"Tensor parallelism over {plan.mesh.tp} ranks", title_justify="left")
    t.add_column("module")
    t.add_column("style")
    t.add_column("why")
    for path, style in sorted(plan.tensor_parallel.items()):
        t.add_row(path, style, "chosen on the op graph")
    for path, reason in sorted(plan.tensor_parallel_reasons.items()):
        t.add_row(path, "replicate", reason)
    return t


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
    if not plan.tensor_parallel:
        t.caption = "tensor parallel: none"
    return t


def alternatives_table(plan: Plan) -> Table:
    t = Table(title="Alternatives considered", title_justify="left")
    for col in ("dp x tp x pp", "schedule", "ZeRO", "micro-batch", "recompute", "step ms", "peak MiB", "why not chosen"):
        t.add_column(col, justify="right" if col in ("step ms", "peak MiB", "micro-batch") else "left")
    t.add_row(_mesh(plan.mesh), _schedule(plan.schedule, plan.virtual_stages), str(plan.zero_stage), str(plan.microbatch_size), plan.recompute,
              *_time_mem(plan.predicted), "[green]chosen[/green]")
    for a in plan.alternatives:
        t.add_row(_mesh(a.mesh), _schedule(a.schedule, 1), str(a.zero_stage), str(a.microbatch_size), a.recompute, *_time_mem(a.predicted),
                  a.why_not)
    return t


def _schedule(schedule: str, virtual_stages: int) -> str:
    return "-" if schedule == "none" else schedule + (f" v{virtual_stages}" if virtual_stages > 1 else "")


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
