"""Rich tables for people reviewing a plan (``autoshard plan`` and ``autoshard inspect``)."""

from __future__ import annotations

import re

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from autoshard.cost.rank_memory import MEASURED_MEMORY_ERROR
from autoshard.cost.schedule import bubble_fraction, draw, format_grid
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import LOSS_PARALLEL
from autoshard.ir.plan import Plan, Predicted
from autoshard.pipeline import DTYPE_NOTE

MIB = 2**20
GIB = 2**30


WIDTH_WHEN_PIPED = 120  # rich's 80-column default for non-terminals wraps the alternatives table


def render_plan(plan: Plan, console: Console | None = None, every_module: bool = False) -> None:
    """The plan's tables; tensor parallelism one row per module with ``every_module``, else one row per module
    of the repeated layers with their count ("x32")."""
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, WIDTH_WHEN_PIPED)
    parts = [decision_table(plan), memory_table(plan), time_table(plan), stages_table(plan)]
    if plan.mesh.pp > 1:
        parts.append(schedule_panel(plan))
    if plan.tensor_parallel or plan.tensor_parallel_reasons:
        parts.append(tensor_parallel_table(plan, every_module))
    console.print(Group(*parts, alternatives_table(plan)))


MAX_GRID_MICROBATCHES = 4  # longer schedules repeat the same steady state; the grid shows the first 4


def schedule_panel(plan: Plan) -> Panel:
    """The pipeline schedule as a rank x time grid: stage, F/B (I/W: backward split into the input's and
    the weights' gradients), micro-batch; dots are idle."""
    least = 2 * plan.mesh.pp if plan.schedule == "dualpipev" else 1  # DualPipeV runs at least 2·pp
    m = min(plan.num_microbatches, max(MAX_GRID_MICROBATCHES, least))
    m -= m % plan.mesh.pp if plan.virtual_stages > 1 and m >= plan.mesh.pp else 0
    grid = draw(plan.schedule, plan.mesh.pp, m, plan.virtual_stages)
    shown = f"first {m} of {plan.num_microbatches} micro-batches" if m < plan.num_microbatches else f"{m} micro-batches"
    title = (
        f"Pipeline schedule {plan.schedule}, {plan.mesh.pp} ranks x {plan.virtual_stages} stages each, {shown}; "
        f"idle {bubble_fraction(grid):.0%}"
    )
    return Panel(Text(format_grid(grid), no_wrap=True, overflow="ellipsis"), title=title, title_align="left")


def tensor_parallel_table(plan: Plan, every_module: bool = False) -> Table:
    t = Table(title=f"Tensor parallelism over {plan.mesh.tp} ranks", title_justify="left")
    t.add_column("module")
    t.add_column("style")
    t.add_column("why")
    reasons = plan.tensor_parallel_reasons
    rows = [
        (path, style, reasons.get(path, "chosen on the op graph"))
        for path, style in sorted(plan.tensor_parallel.items())
    ]
    rows += [
        (path, "replicate", reason) for path, reason in sorted(reasons.items()) if path not in plan.tensor_parallel
    ]
    if not every_module:
        t.caption = f"{len(rows)} modules, layer numbers written *; every module: inspect --all"
        rows = [
            (f"{pattern}  x{count}" if count > 1 else pattern, style, why)
            for pattern, style, why, count in fold_layer_rows(rows)
        ]
    for path, style, why in rows:
        t.add_row(path, style, Text(why))  # prose from the plan file: not rich markup
    return t


def fold_layer_rows(rows: list[tuple[str, str, str]]) -> list[tuple[str, str, str, int]]:
    """Rows (module path, style, why) that differ only by layer numbers, as one (path with each number written
    "*", style, the first one's why, how many modules it stands for), in the order of their first row; a module
    whose style (or reason, numbers aside) differs from its layer's neighbours keeps a row of its own."""
    folded: dict[tuple[str, str, str], list] = {}
    for path, style, why in rows:
        pattern = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path)
        key = (pattern, style, re.sub(r"\d+", "N", why))
        folded.setdefault(key, [pattern, style, why, 0])[3] += 1
    return [tuple(row) for row in folded.values()]


def float8_text(plan: Plan) -> str:
    """The float8 recipe and the linears it converts, each layer's numbers written "*" (``fold_layer_rows``)."""
    patterns = list(dict.fromkeys(re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path) for path in plan.float8_linears))
    return (
        f"{plan.decisions.float8} scaling (torchao Float8Linear) on {len(plan.float8_linears)} linears: "
        + ", ".join(patterns)
        + _float8_beside(plan)
    )


def _float8_beside(plan: Plan) -> str:
    """How float8 sits beside TP (torchao's float8 styles, tensorwise) and pipeline stages (after the split)."""
    parts = []
    if plan.mesh.tp > 1 and plan.mesh.pp > 1:
        parts.append("TP's traced collectives in bf16")
    elif plan.mesh.tp > 1:
        parts.append(
            "torchao's float8 TP styles"
            + (", all-gathers in float8" if any("-seq-" in s for s in plan.tensor_parallel.values()) else "")
            if plan.decisions.float8 == "tensorwise"
            else "plain TP styles"
        )
    if plan.mesh.pp > 1:
        parts.append("each stage's linears converted after the split")
    return f" ({'; '.join(parts)})" if parts else ""


def decision_table(plan: Plan) -> Table:
    c = plan.cluster
    t = Table(title=f"Plan for {plan.model['spec']}", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    t.add_row("model", f"{plan.model['params']:,} parameters, {plan.model['layers']} blocks")
    estimated = plan.model.get("ops_estimated")
    if estimated and estimated.get("count"):
        t.add_row("estimated ops", Text(_estimated_text(estimated)))  # op names from the plan file: not markup
    drawn = plan.model.get("random_ops")
    if drawn:
        t.add_row("random ops", Text(random_ops_text(drawn)))  # module paths from the plan file: not markup
    t.add_row("cluster", f"{c['name']}: {c['nodes']} node(s) x {c['devices_per_node']} devices ({c['backend']})")
    t.add_row("mesh", f"{plan.mesh}  ({plan.world_size} ranks)")
    t.add_row("ZeRO stage", f"{plan.zero_stage}  ({_zero_how(plan)})")
    t.add_row(
        "batch",
        f"global {plan.global_batch} = {plan.mesh.dp} dp x {plan.num_microbatches} micro-batches "
        f"x {plan.microbatch_size}",
    )
    t.add_row("recompute", _recompute_text(plan))
    if plan.decisions.compile:
        t.add_row("compiled", "each block by torch.compile (inductor; the first steps compile)")
    if plan.decisions.compile_loss:
        t.add_row("compiled loss", "by torch.compile (inductor: no fp32 copy of the logits kept for backward)")
    if plan.decisions.async_tp:
        t.add_row(
            "async TP",
            "inductor's micro-pipeline TP: each sequence-parallel all-gather and reduce-scatter overlapped with its "
            "matmul in chunks over symmetric memory (CUDA ranks; verify runs its twin without it)",
        )
    if plan.float8_linears:
        t.add_row("float8", Text(float8_text(plan)))  # module paths from the plan file: not markup
    if plan.decisions.offloaded:
        t.add_row("offload", Text(offload_text(plan)))  # prose from the plan file: not markup
    sequence = sequence_text(plan)
    if sequence:
        t.add_row("sequence", sequence)
    if plan.decisions.loss_parallel:
        t.add_row("loss", loss_text(plan))
    t.add_row("schedule", plan.schedule)
    dtype_note = next((note for note in plan.notes if note.startswith(DTYPE_NOTE)), None)
    t.add_row("precision", plan.precision + (f"\n{dtype_note}" if dtype_note else ""))  # hf:DIR in 16 bits
    if plan.mesh.dp > 1 and not plan.decisions.dp_runtime.fsdp2:
        t.add_row("DDP buckets", f"{plan.ddp_bucket_cap_mb:g} MiB")
    t.add_row("pinned by you", ", ".join(plan.pinned) or "nothing")
    t.add_row("priced for", runtime_text(plan.runtime))
    return t


def sequence_text(plan: Plan) -> str:
    """Which axes bear the sequence: context parallelism (each sample's tokens split over cp ranks) and
    sequence parallelism (TP's norm and dropout regions on 1/tp of the tokens, and so a pipeline boundary there);
    "" when neither."""
    tokens = plan.model.get("tokens_per_sample", 1)
    parts = []
    if plan.mesh.cp > 1:
        parts.append(
            f"{tokens:,} tokens split over cp={plan.mesh.cp} ranks ({tokens // plan.mesh.cp:,} each; "
            f"attention a ring over them)"
        )
    if plan.sequence_parallel:
        parts.append(
            f"sequence parallel with tp={plan.mesh.tp}: the regions between TP's linears on 1/{plan.mesh.tp} "
            f"of the tokens (reduce-scatter + all-gather for each all-reduce)"
            + (f"; a pipeline boundary between them sends 1/{plan.mesh.tp} of the tokens" if plan.mesh.pp > 1 else "")
        )
    return "; ".join(parts)


def loss_text(plan: Plan) -> str:
    """Loss parallelism's row: the output projection, its logits on vocabulary shards, its collectives."""
    head = next(m for m, style in plan.tensor_parallel.items() if style.startswith(LOSS_PARALLEL))
    return (
        f"loss parallel with tp={plan.mesh.tp}: {head}'s logits on 1/{plan.mesh.tp} of the vocabulary, the "
        f"cross-entropy on the shards (all-reduces of the max, Σ exp and target logit per token)"
    )


def runtime_text(runtime: str) -> str:
    """What priced the plan (``Plan.runtime``); a runtime other than autoshard's says the program is still ours."""
    if runtime == "autoshard":
        return "autoshard (the program `autoshard compile` emits)"
    return (
        f"{runtime}: the time and memory are {runtime}'s for this configuration; `autoshard compile` still "
        f"emits autoshard's program (price it with --runtime autoshard)"
    )


def _estimated_text(estimated: dict) -> str:
    """ "3 ops costed by an estimate, their FLOP formula failing (aten.addmm.default)": the count of
    nodes, then the plan's few op targets."""
    count, ops = estimated["count"], estimated.get("ops", [])
    named = f" ({', '.join(ops)})" if ops else ""
    return f"{count} op{'s' if count != 1 else ''} costed by an estimate, their FLOP formula failing{named}"


RANDOM_MODULES_SHOWN = 3  # module paths named per random op; the rest counted


def random_ops_text(drawn: dict[str, list[str]]) -> str:
    """ "aten.bernoulli.p in encoder.layer.*.drop_path; aten.dropout.default in 3 modules (a, b, c, ...)": where the
    model draws random numbers, each rank its own in a parallel program (``autoshard verify`` fixes them)."""
    parts = []
    for op, modules in sorted(drawn.items()):
        shown = ", ".join(modules[:RANDOM_MODULES_SHOWN]) + (
            f", +{len(modules) - RANDOM_MODULES_SHOWN} more" if len(modules) > RANDOM_MODULES_SHOWN else ""
        )
        parts.append(f"{op} in {shown}")
    return "; ".join(parts) + " (each rank draws its own; verify runs them at their expectation)"


def memory_table(plan: Plan) -> Table:
    m = plan.predicted.memory
    device = plan.tightest_memory()[1] if plan.cluster.get("groups") else plan.cluster["device"]["memory_bytes"]
    t = Table(title="Memory per rank (predicted peak)", title_justify="left")
    t.add_column("part")
    t.add_column("MiB", justify="right")
    for name, value in (
        ("weights", m.params_bytes),
        ("gradients", m.grads_bytes),
        ("optimizer state", m.optimizer_bytes),
        ("activations", m.activations_bytes),
        ("transient", m.transient_bytes),
    ):
        t.add_row(name, f"{value / MIB:,.1f}")
    t.add_row("[bold]peak[/bold] (+ allocator slack)", f"[bold]{m.peak_bytes / MIB:,.1f}[/bold]")
    t.add_row("device memory", device_memory_text(m.peak_bytes, device))
    t.caption = thin_margin_text(m.peak_bytes, device)
    return t


def thin_margin_text(peak_bytes: int, device_bytes: int) -> str | None:
    """For a plan that fits with less room than the memory model's measured error (``MEASURED_MEMORY_ERROR`` of the
    device), what to run before trusting it; None otherwise."""
    room = device_bytes - peak_bytes
    if room < 0 or room >= MEASURED_MEMORY_ERROR * device_bytes:
        return None
    return (
        f"[yellow]thin margin: {room / GIB:.1f} GiB ({room / device_bytes:.1%}) left of {device_bytes / GIB:.1f} GiB, "
        f"within the memory model's measured error (±{MEASURED_MEMORY_ERROR:.0%}); check it with "
        f"`autoshard dryrun PLAN.json` before a cluster job[/yellow]"
    )


def device_memory_text(peak_bytes: int, device_bytes: int) -> str:
    """ "81,920  (52.3% used)", or, over it, "81,920  (does not fit: 2.07x it)"."""
    if peak_bytes > device_bytes:
        return f"{device_bytes / MIB:,.0f}  [red](does not fit: {peak_bytes / device_bytes:.2f}x it)[/red]"
    return f"{device_bytes / MIB:,.0f}  ({peak_bytes / device_bytes:.1%} used)"


def chosen_row_text(plan: Plan) -> str:
    """What the alternatives table says of the plan itself: "chosen" among others, "pinned" for a configuration
    fixed by hand (``estimate``: nothing else was priced), "does not fit" when over the device's memory."""
    peak, device = plan.tightest_memory()
    if peak > device:
        return "[red]does not fit[/red]"
    return "[green]chosen[/green]" if plan.alternatives else "[green]pinned: nothing else priced[/green]"


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
    t.caption = preset_caveat(plan.cluster)
    return t


def preset_caveat(cluster: dict) -> str | None:
    """For a plan priced on a preset's figures (not a cluster file from ``autoshard calibrate``), what they are
    and how to get measured ones; None for any other cluster."""
    from autoshard.cost.hardware import PRESETS

    preset = PRESETS.get(cluster["name"])
    if preset is None or cluster["device"].get("source") != preset.device.source:
        return None
    what = (
        "rough defaults, not measurements of this machine (a CPU run may reach a tenth of this throughput)"
        if cluster["backend"] == "gloo"
        else "from datasheets and published runs, not measurements of your cluster"
    )
    return (
        f"{cluster['name']} is an uncalibrated preset: its figures are {what}; for predictions to hold a run to, "
        f"`autoshard calibrate -o cluster.yaml` there and plan with --cluster cluster.yaml"
    )


def stages_table(plan: Plan) -> Table:
    t = Table(title="Stages and tensor parallelism", title_justify="left")
    t.add_column("stage")
    t.add_column("ranks")
    grouped = bool(plan.cluster.get("groups"))
    if grouped:
        t.add_column("node group")
    t.add_column("modules")
    for s in plan.stages:
        group = (_group_text(plan.stage_group(s.ranks)),) if grouped else ()
        t.add_row(str(s.index), _ranks(s.ranks), *group, ", ".join(s.modules))
    if not plan.tensor_parallel:
        t.caption = "tensor parallel: none"
    return t


def _group_text(group: dict | None) -> str:
    """ "h100 (H100-SXM-80GB, 989 TFLOP/s, 80.0 GiB)": a node group and its device."""
    if group is None:
        return "every group, at the slowest's pace"
    d = group["device"]
    return f"{group['name']} ({d['name']}, {d['peak_tflops']:g} TFLOP/s, {d['memory_bytes'] / GIB:.1f} GiB)"


def offload_text(plan: Plan) -> str:
    """What host offload moves and why it was chosen: the fastest plan without it does not fit (its why_not), or
    is slower; the host memory it takes per node."""
    host = plan.predicted.host_memory_bytes_per_node
    size = f"{host / GIB:,.1f} GiB" if host >= GIB else f"{host / MIB:,.1f} MiB"
    what = (
        f"parameters, gradients and optimizer state on the host (FSDP2 CPUOffloadPolicy; {size} per node), "
        f"the optimizer step on the CPU"
    )
    without = [a for a in plan.alternatives if a.offload == "none"]
    if not without:
        return f"{what}: no plan without offload was priced (pinned, or pruned by its bound)"
    best = without[0]  # alternatives are ranked: the best without offload first
    return f"{what}; without it the best plan ({_mesh(best.mesh)}, ZeRO-{best.zero_stage}) {best.why_not}"


def alternatives_table(plan: Plan) -> Table:
    """The chosen configuration and the alternatives; a float8 column where any of them trains in float8, an
    offload column where any of them offloads."""
    float8 = plan.decisions.float8 != "off" or any(a.float8 != "off" for a in plan.alternatives)
    offload = plan.decisions.offloaded or any(a.offload != "none" for a in plan.alternatives)
    t = Table(title="Alternatives considered", title_justify="left")
    for col in (
        "dp x tp x pp",
        "schedule",
        "ZeRO",
        "micro-batch",
        "recompute",
        *(("float8",) if float8 else ()),
        *(("offload",) if offload else ()),
        "step ms",
        "peak MiB",
        "why not chosen",
    ):
        t.add_column(col, justify="right" if col in ("step ms", "peak MiB", "micro-batch") else "left")
    t.add_row(
        _mesh(plan.mesh),
        _schedule(plan.schedule, plan.virtual_stages),
        str(plan.zero_stage),
        str(plan.microbatch_size),
        plan.recompute,
        *((plan.decisions.float8,) if float8 else ()),
        *((plan.decisions.offload,) if offload else ()),
        *_time_mem(plan.predicted),
        chosen_row_text(plan),
    )
    for a in plan.alternatives:
        t.add_row(
            _mesh(a.mesh),
            _schedule(a.schedule, 1),
            str(a.zero_stage),
            str(a.microbatch_size),
            a.recompute,
            *((a.float8,) if float8 else ()),
            *((a.offload,) if offload else ()),
            *_time_mem(a.predicted),
            Text(a.why_not),
        )  # prose from the plan file: not rich markup
    return t


def _schedule(schedule: str, virtual_stages: int) -> str:
    return "-" if schedule == "none" else schedule + (f" v{virtual_stages}" if virtual_stages > 1 else "")


def _mesh(mesh) -> str:
    return f"{mesh.dp}x{mesh.tp}x{mesh.pp}"


def _time_mem(p: Predicted | None) -> tuple[str, str]:
    if p is None:
        return "-", "-"
    return f"{p.step_time_s * 1e3:,.3f}", f"{p.memory_peak_bytes_per_rank / MIB:,.1f}"


_ZERO_HOW = {  # ir.decisions.DP_RUNTIMES row -> what the user reads
    "ddp": "DDP, nothing sharded",
    "ddp-zero-optimizer": "optimizer state sharded (DDP + ZeroRedundancyOptimizer)",
    "replicate": "nothing sharded (FSDP2's replicate: DDP on DTensor parameters or stages)",
    "fsdp-accumulate": "optimizer state sharded, gradients summed whole and reduce-scattered once a step (FSDP2; "
    "Megatron's distributed optimizer)",
    "fsdp": "gradients + optimizer state sharded (FSDP2)",
    "fsdp-reshard": "weights, gradients, optimizer state sharded (FSDP2)",
}


def _zero_how(plan: Plan) -> str:
    if plan.mesh.dp_cp == 1:
        return "one dp rank: nothing to shard"
    how = _ZERO_HOW[plan.decisions.dp_runtime.name]
    if plan.mesh.cp > 1:
        how += f"; over the {plan.mesh.dp_cp} dp x cp ranks, which hold the same parameters"
    if plan.dp_replicate > 1:
        how += (
            f"; HSDP: sharded over the {plan.mesh.dp // plan.dp_replicate} ranks of a node, "
            f"{plan.dp_replicate} replicas across nodes"
        )
    if plan.ep > 1:
        how += (
            f"; experts split over ep={plan.ep} adjacent dp ranks (all-to-all dispatch), each shard synced "
            f"over the {plan.mesh.dp // plan.ep} rank(s) holding it"
        )
    return how


def _ranks(ranks: tuple[int, ...]) -> str:
    if ranks and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ", ".join(map(str, ranks))


# ---------------------------------------------------------------------------- what-if (inspect --what-if)

TIME_ROWS = (
    ("forward_s", "forward"),
    ("backward_s", "backward"),
    ("recompute_s", "recompute"),
    ("grad_accumulation_s", "gradient accumulation"),
    ("optimizer_s", "optimizer step"),
    ("tp_comm_s", "TP collectives"),
    ("p2p_s", "pipeline p2p"),
    ("dp_comm_exposed_s", "DP collectives, exposed"),
    ("bubble_s", "pipeline bubble"),
    ("ep_comm_s", "expert all-to-all"),
    ("cp_comm_s", "context-parallel ring, exposed"),
)
MEMORY_ROWS = (
    ("params_bytes", "weights"),
    ("grads_bytes", "gradients"),
    ("optimizer_bytes", "optimizer state"),
    ("activations_bytes", "activations"),
    ("transient_bytes", "transient"),
)
SYMBOL_LABELS = {
    "B": "global_batch",
    "s": "seq_len",
    "b": "microbatch_size",
    "dp": "dp",
    "tp": "tp",
    "pp": "pp",
    "cp": "cp",
}


def plan_figures(plan: Plan, values: dict[str, int] | None = None) -> dict[str, float]:
    """The plan's symbolic cost (``cost.symbolic``) at its own point with ``values`` changed, plus
    throughput and MFU; one-line errors for plans without it or with a damaged one."""
    from autoshard.cost.expressions import evaluate  # sympy: loaded when a plan's figures are asked for

    if not plan.symbolic:
        raise AutoshardError(
            "this plan has no symbolic cost (made before autoshard stored one); "
            "re-create it with `autoshard plan` to use --what-if"
        )
    if "cp" in (values or {}) and plan.mesh.cp == 1:
        raise AutoshardError(
            "--what-if cp=...: this plan has no context parallelism (cp=1), so its cost holds no cp; "
            "re-plan with --cp N (or a long --seq-len) to ask what another cp would cost"
        )
    try:
        out = evaluate(plan.symbolic, values or {})
        point = {**plan.symbolic["symbols"], **(values or {})}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise AutoshardError(
            f"the plan's symbolic cost is damaged ({type(exc).__name__}: {exc}); re-create it with `autoshard plan`"
        ) from exc
    tokens = point["s"] if plan.model.get("tokens_per_sample", 1) > 1 else 1
    world = point["dp"] * point["tp"] * point["pp"] * point.get("cp", 1)
    out["samples_per_s"] = point["B"] / out["step_time_s"]
    out["tokens_per_s"] = out["samples_per_s"] * tokens
    out["mfu"] = (
        point["B"] * out["model_flops_per_sample"] / (out["step_time_s"] * world * plan.peak_tflops_per_rank * 1e12)
    )
    return out


def point_label(plan: Plan, values: dict[str, int]) -> str:
    point = {**plan.symbolic["symbols"], **values}
    return " ".join(f"{SYMBOL_LABELS[k]}={point[k]}" for k in SYMBOL_LABELS if k in values) or "the plan"


def what_if_view(plan: Plan, values: dict[str, int]) -> Group:
    """Each part at the plan's point and at the what-if point, with the ratio."""
    base, new = plan_figures(plan), plan_figures(plan, values)
    sym = plan.symbolic["symbols"]
    where = Text(
        f"plan: {' '.join(f'{label}={sym[k]}' for k, label in SYMBOL_LABELS.items() if k in sym)}; "
        f"what-if: {point_label(plan, values)} (re-evaluated, not re-planned)"
    )
    t = Table(title=f"What if {point_label(plan, values)}", title_justify="left")
    for col in ("part", "plan", "what-if", "x"):
        t.add_column(col, justify="left" if col == "part" else "right")

    def row(label: str, key: str, scale: float, fmt: str, bold: bool = False) -> None:
        a, b = base[key] * scale, new[key] * scale
        cells = [label, format(a, fmt), format(b, fmt), f"{b / a:.3g}" if a else "-"]
        t.add_row(*(f"[bold]{c}[/bold]" for c in cells) if bold else cells)

    for key, label in TIME_ROWS:
        if base[key] or new[key]:
            row(f"{label} (ms)", key, 1e3, ",.3f")
    row("compute (ms)", "compute_s", 1e3, ",.3f")
    row("exposed communication (ms)", "comm_exposed_s", 1e3, ",.3f")
    row("step (ms)", "step_time_s", 1e3, ",.3f", bold=True)
    row("tokens/s", "tokens_per_s", 1, ",.0f")
    row("samples/s", "samples_per_s", 1, ",.1f")
    row("MFU (%)", "mfu", 100, ".1f")
    for key, label in MEMORY_ROWS:
        if base[key] or new[key]:
            row(f"{label} (MiB)", key, 1 / MIB, ",.1f")
    row("peak per rank (MiB)", "memory_peak_bytes", 1 / MIB, ",.1f", bold=True)
    return Group(where, t)


def what_if_warnings(plan: Plan, values: dict[str, int]) -> list[str]:
    """One line each: memory over the device, a batch that does not split, degrees off the plan."""
    point = {**plan.symbolic["symbols"], **values}
    new = plan_figures(plan, values)
    lines = []
    device = plan.cluster["device"]["memory_bytes"]
    if new["memory_peak_bytes"] > device:
        lines.append(
            f"does not fit: {new['memory_peak_bytes'] / GIB:.2f} GiB per rank, "
            f"{(new['memory_peak_bytes'] - device) / GIB:.2f} GiB over the {device / GIB:.1f} GiB per device"
        )
    per_step = point["dp"] * point["b"]
    if point["B"] % per_step:
        lines.append(
            f"global_batch={point['B']} is not divisible by dp x microbatch_size = {per_step}: "
            f"{point['B'] / per_step:.3g} micro-batches is not a whole number"
        )
    if any(point[k] != plan.symbolic["symbols"][k] for k in ("dp", "tp", "pp")):
        world = point["dp"] * point["tp"] * point["pp"] * point.get("cp", 1)
        devices = plan.cluster["nodes"] * plan.cluster["devices_per_node"]
        ranks = f"; dp x tp x pp = {world} ranks, the plan's cluster has {devices}" if world != devices else ""
        lines.append(
            f"degrees differ from the plan's: its TP layout, stage cuts, schedule and links are kept, so this "
            f"is an estimate{ranks}; re-plan with --dp {point['dp']} --tp {point['tp']} --pp {point['pp']} "
            f"to decide"
        )
    return lines


# ---------------------------------------------------------------------------- diff


def render_diff(a: Plan, b: Plan, names: tuple[str, str], console: Console | None = None) -> None:
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, WIDTH_WHEN_PIPED)
    console.print(Group(decisions_diff_table(a, b, names), predicted_diff_table(a, b, names)))


def decision_rows(plan: Plan) -> dict[str, str]:
    """The decisions of a plan, as text, by name (``diff``)."""
    c = plan.cluster
    rows = {
        "model": plan.model["spec"],
        "cluster": f"{c['name']}: {c['nodes']} x {c['devices_per_node']}",
        "global batch": str(plan.global_batch),
        "mesh": str(plan.mesh),
        "ZeRO stage": str(plan.zero_stage),
        "micro-batch": f"{plan.microbatch_size} x {plan.num_microbatches}",
        "recompute": plan.recompute,
        "schedule": plan.schedule + (f" v{plan.virtual_stages}" if plan.virtual_stages > 1 else ""),
        "split points": ", ".join(plan.split_points) or "none",
        "precision": plan.precision,
        "priced for": plan.runtime,
        "DDP buckets (MiB)": f"{plan.ddp_bucket_cap_mb:g}"
        if plan.mesh.dp > 1 and not plan.decisions.dp_runtime.fsdp2
        else "-",
        "HSDP replicas": str(plan.dp_replicate),
        "expert parallel": f"ep={plan.ep} over {len(plan.experts)} expert groups" if plan.ep > 1 else "ep=1",
        "sequence": sequence_text(plan) or "whole on every rank",
        "compiled blocks": "yes" if plan.decisions.compile else "no",
        "async TP": "on" if plan.decisions.async_tp else "off",
        "compiled loss": "yes" if plan.decisions.compile_loss else "no",
        "float8": f"{plan.decisions.float8} ({len(plan.float8_linears)} linears)" if plan.float8_linears else "off",
        "offload": plan.decisions.offload,
    }
    return rows


def decisions_diff_table(a: Plan, b: Plan, names: tuple[str, str]) -> Table:
    t = Table(title="Decisions that differ", title_justify="left")
    t.add_column("decision")
    t.add_column(names[0])
    t.add_column(names[1])
    ra, rb = decision_rows(a), decision_rows(b)
    for key in ra:
        if ra[key] != rb[key]:
            t.add_row(key, ra[key], rb[key])
    for module in sorted(set(a.tensor_parallel) | set(b.tensor_parallel)):
        sa, sb = a.tensor_parallel.get(module, "replicate"), b.tensor_parallel.get(module, "replicate")
        if sa != sb:
            t.add_row(f"TP {module}", sa, sb)
    if not t.row_count:
        t.caption = "none: the same decisions"
    return t


def predicted_diff_table(a: Plan, b: Plan, names: tuple[str, str]) -> Table:
    """Predicted figures side by side, with the difference b − a and its share of a."""
    t = Table(title="Predicted", title_justify="left")
    for col in ("part", names[0], names[1], "delta", "delta %"):
        t.add_column(col, justify="left" if col == "part" else "right")

    def row(label: str, x: float, y: float, fmt: str, bold: bool = False) -> None:
        pct = f"{(y - x) / x:+.1%}" if x else ("-" if not y else "new")
        cells = [label, format(x, fmt), format(y, fmt), format(y - x, "+" + fmt.lstrip("+")), pct]
        t.add_row(*(f"[bold]{c}[/bold]" for c in cells) if bold else cells)

    pa, pb = a.predicted, b.predicted
    fine = _fine_parts(a, b)
    row("step (ms)", pa.step_time_s * 1e3, pb.step_time_s * 1e3, ",.3f", bold=True)
    row("  compute (ms)", pa.compute_s * 1e3, pb.compute_s * 1e3, ",.3f")
    for (x, y), label in fine[:5]:
        if x or y:
            row(f"    {label} (ms)", x * 1e3, y * 1e3, ",.3f")
    row("  exposed communication (ms)", pa.comm_exposed_s * 1e3, pb.comm_exposed_s * 1e3, ",.3f")
    for (x, y), label in fine[5:]:
        if x or y:
            row(f"    {label} (ms)", x * 1e3, y * 1e3, ",.3f")
    row("  pipeline bubble (ms)", pa.bubble_s * 1e3, pb.bubble_s * 1e3, ",.3f")
    row("all communication (ms)", pa.comm_total_s * 1e3, pb.comm_total_s * 1e3, ",.3f")
    row("tokens/s", pa.tokens_per_s, pb.tokens_per_s, ",.0f")
    row("samples/s", pa.samples_per_s, pb.samples_per_s, ",.1f")
    row("MFU (%)", pa.mfu * 100, pb.mfu * 100, ".1f")
    row("peak memory per rank (MiB)", pa.memory.peak_bytes / MIB, pb.memory.peak_bytes / MIB, ",.1f", bold=True)
    for key, label in MEMORY_ROWS:
        row(f"  {label} (MiB)", getattr(pa.memory, key) / MIB, getattr(pb.memory, key) / MIB, ",.1f")
    return t


def _fine_parts(a: Plan, b: Plan) -> list[tuple[tuple[float, float], str]]:
    """The parts of compute (5) then of exposed communication (3), where both plans carry their
    symbolic cost (``cost.symbolic``); none for older plans or a damaged field (the sums still show)."""
    if not (a.symbolic and b.symbolic):
        return []
    try:
        fa, fb = plan_figures(a), plan_figures(b)
    except AutoshardError:
        return []
    return [((fa[k], fb[k]), label) for k, label in TIME_ROWS[:8]]


def _recompute_text(plan) -> str:
    """ "full", or for a mixed plan the blocks per mode: "mixed: full h.0-h.1, none h.2-h.3"."""
    if plan.recompute != "mixed":
        return plan.recompute
    by_mode: dict[str, list[str]] = {}
    for path, mode in plan.recompute_blocks.items():
        by_mode.setdefault(mode, []).append(path)
    parts = [
        f"{mode} {paths[0]}" + (f"-{paths[-1]} ({len(paths)})" if len(paths) > 1 else "")
        for mode, paths in by_mode.items()
    ]
    return "mixed: " + ", ".join(parts)
