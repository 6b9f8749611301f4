"""What one lent GPU measures: the cost model's step time and peak memory against the emitted programs.

``bash benchmarks/gpu_session.sh OUT`` (this file does the work; ``--cpu`` is its CPU path, which
tests/test_gpu_session.py runs). In order, each step's result written to ``OUT`` as soon as it exists,
so a run cut short still returns what it measured:

1. ``facts.json``: torch, CUDA and the device.
2. ``autoshard calibrate --quick --devices-per-node 1 -o OUT/cluster.yaml``: the device's measured
   matmul peak and memory bandwidth (one rank: no links to measure on one GPU).
3. One plan per case (``GPU_CASES``: micro-batch sizes and recompute modes at world size 1; the
   planner refuses ZeRO-3 at dp 1, which has nothing to shard) on that cluster, planned in
   parallel, each priced by the planner.
4. Each plan's program run with ``autoshard run`` (bf16 on a GPU): its median step (the first
   step skipped) and ``torch.cuda.max_memory_allocated`` from the program's summary line.
   The float8 cases (``--float8 tensorwise``, torchao) and their twins (the same plans with ``--float8 off``)
   plan on ``OUT/cluster-float8.yaml``: the calibrated cluster with the device's float8 matmul throughput
   measured here (``float8_tflops``: ``torch._scaled_mm`` at 8192³); a device without float8 matmuls leaves
   them as rows with that error. CPU ranks verify a float8 plan through the same twin (``autoshard verify``).
   Every step's loss is kept; ``--text FILE`` trains on a text's bytes, so each float8 run's loss curve is held
   against its twin's (``float8_curves``: the largest per-step relative difference, against
   ``FLOAT8_LOSS_TOLERANCE``), with the measured and predicted step-time ratios.
5. A plain hand-written loop on the same model, micro-batches and optimizer (``hand_loop``:
   autocast bf16, ``torch.optim.AdamW``, gradient accumulation, nothing else), so the program's
   overhead is measured against what a user would write by hand.
6. ``--profile B,...``: the hand-written loop profiled by op class at those micro-batch sizes
   (``benchmarks/gpu_kernels.py``; ``OUT/kernels-mbB.json``), which ``gpu_kernels.py --predict`` prices.
7. DCP save and resume: the example GPT saved at step 4, then resumed to step 8.
8. ``autoshard dryrun`` of each plan (fake tensors on the CPU, CPU kernels), after the GPU runs so it
   does not disturb their timings: its peak beside the prediction and ``max_memory_allocated``.

Memory is compared like with like: ``torch.cuda.max_memory_allocated`` counts the tensors alive at the
peak, so beside it stands the plan's sum of parts (the peak before ``ALLOCATOR_SLACK``, which models the
caching allocator's reserve, not its allocations).

``OUT/results.json`` holds every row; ``OUT/results.md`` the table a report takes. MFU here is
model FLOPs (the plan's, ``predicted.mfu × peak × predicted step``) over the measured step and the
calibrated peak.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    name: str
    pins: dict  # pin flags of `autoshard plan`, by flag stem (zero, microbatch_size, recompute)


@dataclass(frozen=True)
class Setting:
    """What a session runs on: the model, its global batch, steps per run and a time limit per command."""

    model: str
    global_batch: int
    steps: int
    limit_s: float
    cases: tuple[Case, ...]
    hand_microbatches: tuple[int, ...]


GPU_CASES = (
    Case("ddp-mb1", {"zero": 0, "microbatch_size": 1, "recompute": "none"}),
    Case("ddp-mb2", {"zero": 0, "microbatch_size": 2, "recompute": "none"}),
    Case("ddp-mb4", {"zero": 0, "microbatch_size": 4, "recompute": "none"}),
    Case("ddp-mb4-selective", {"zero": 0, "microbatch_size": 4, "recompute": "selective"}),
    Case("ddp-mb4-full", {"zero": 0, "microbatch_size": 4, "recompute": "full"}),
    Case("ddp-mb8-full", {"zero": 0, "microbatch_size": 8, "recompute": "full"}),
    Case("ddp-mb2-selective", {"zero": 0, "microbatch_size": 2, "recompute": "selective"}),
    Case("ddp-mb8-selective", {"zero": 0, "microbatch_size": 8, "recompute": "selective"}),
    Case("ddp-mb8", {"zero": 0, "microbatch_size": 8, "recompute": "none"}),
    Case("ddp-mb4-alternate", {"zero": 0, "microbatch_size": 4, "recompute": "alternate"}),
    Case("ddp-mb4-compile", {"zero": 0, "microbatch_size": 4, "recompute": "none", "compile": "on"}),
    Case("ddp-mb4-full-compile", {"zero": 0, "microbatch_size": 4, "recompute": "full", "compile": "on"}),
    Case("ddp-mb8-compile", {"zero": 0, "microbatch_size": 8, "recompute": "none", "compile": "on"}),
    Case("ddp-mb4-selective-compile", {"zero": 0, "microbatch_size": 4, "recompute": "selective", "compile": "on"}),
    Case("ddp-mb8-alternate-compile", {"zero": 0, "microbatch_size": 8, "recompute": "alternate", "compile": "on"}),
    # float8 (torchao, tensorwise) and its bf16 twin: the same plan with float8 off (ddp-mb4-compile above and this
    # eager pair), on the calibrated cluster with the device's measured float8 matmul peak (float8_cluster)
    Case("ddp-mb4-float8", {"zero": 0, "microbatch_size": 4, "recompute": "none", "float8": "tensorwise"}),
    Case("ddp-mb4-float8-off", {"zero": 0, "microbatch_size": 4, "recompute": "none", "float8": "off"}),
    Case(
        "ddp-mb4-float8-compile",
        {"zero": 0, "microbatch_size": 4, "recompute": "none", "compile": "on", "float8": "tensorwise"},
    ),
    Case("ddp-mb4-float8-rowwise", {"zero": 0, "microbatch_size": 4, "recompute": "none", "float8": "rowwise"}),
)
GPU = Setting(
    "benchmarks/llama3.py:llama3_1b", global_batch=8, steps=8, limit_s=240, cases=GPU_CASES, hand_microbatches=(1, 2, 4)
)
CPU = Setting(
    "examples/gpt.py:build",
    global_batch=4,
    steps=3,
    limit_s=240,
    cases=(Case("ddp-mb2-full", {"zero": 0, "microbatch_size": 2, "recompute": "full"}),),
    hand_microbatches=(2,),
)
DCP_MODEL = "examples/gpt.py:build"


@dataclass
class Row:
    case: str
    pins: dict
    predicted_step_s: float | None = None
    predicted_peak_bytes: int | None = None
    predicted_mfu: float | None = None
    predicted_parts: dict = field(default_factory=dict)
    measured_step_s: float | None = None
    measured_peak_bytes: int | None = None
    dryrun_peak_bytes: int | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    losses: list[float] = field(default_factory=list)  # every step's loss, from the program's step lines
    error: str | None = None


def autoshard(args: list[str], limit_s: float, log: Path) -> subprocess.CompletedProcess:
    """``python -m autoshard ARGS`` from the repository root; its output appended to ``log``."""
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "autoshard", *args], cwd=REPO, capture_output=True, text=True, timeout=limit_s
        )
    except subprocess.TimeoutExpired as exc:
        done = subprocess.CompletedProcess(exc.cmd, 124, exc.stdout or "", (exc.stderr or "") + "\ntimed out")
        done.stdout = done.stdout.decode() if isinstance(done.stdout, bytes) else done.stdout
        done.stderr = done.stderr.decode() if isinstance(done.stderr, bytes) else done.stderr
    with log.open("a") as f:
        f.write(
            f"$ autoshard {' '.join(args)}  # exit {done.returncode}, {time.perf_counter() - started:.1f} s\n"
            f"{done.stdout}{done.stderr}\n"
        )
    return done


def facts() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else platform.machine(),
        "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def pin_flags(pins: dict) -> list[str]:
    return [part for key, value in pins.items() for part in (f"--{key.replace('_', '-')}", str(value))]


FLOAT8_MATMUL_N = 8192  # the float8 matmul measured: N x N x N, as calibrate's bf16 one


def float8_tflops() -> float | None:
    """The device's float8 matmul throughput (``torch._scaled_mm``, e4m3, tensorwise scales, N³), median of 10
    after 3 warm-ups; None where there is no float8 matmul (no CUDA, compute capability below 8.9)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) < (8, 9):
        return None
    n = FLOAT8_MATMUL_N
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm takes it
    one = torch.ones((), device="cuda")
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


def float8_cluster(cluster: str, out: Path) -> str | None:
    """``cluster`` with its device's measured float8 peak (``float8_tflops``), written beside it, or None where the
    device has no float8 matmuls (its float8 cases are then rows with that error)."""
    import yaml

    tflops = float8_tflops()
    if tflops is None:
        return None
    data = yaml.safe_load(Path(cluster).read_text())
    data["device"]["float8_tflops"] = round(tflops, 1)
    data["device"]["source"] += f"; float8_tflops: torch._scaled_mm {FLOAT8_MATMUL_N}^3 e4m3 measured here"
    path = out / "cluster-float8.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def plan_case(setting: Setting, case: Case, cluster: str | None, out: Path) -> Row:
    row = Row(case.name, case.pins)
    if cluster is None:
        row.error = "plan: this device has no float8 matmuls (torch._scaled_mm needs compute capability 8.9+)"
        return row
    plan = out / f"{case.name}.plan.json"
    done = autoshard(
        [
            "plan",
            setting.model,
            "--cluster",
            cluster,
            "--devices-per-node",
            "1",
            "--global-batch",
            str(setting.global_batch),
            "--dp",
            "1",
            *pin_flags(case.pins),
            "-o",
            str(plan),
        ],
        setting.limit_s,
        out / f"{case.name}.log",
    )
    if done.returncode != 0:
        row.error = f"plan: {last_line(done)}"
        return row
    predicted = json.loads(plan.read_text())["predicted"]
    row.predicted_step_s, row.predicted_mfu = predicted["step_time_s"], predicted["mfu"]
    row.predicted_peak_bytes = predicted["memory_peak_bytes_per_rank"]
    row.predicted_parts = predicted["memory"]
    return row


SUMMARY = re.compile(
    r"done: loss (?P<first>[-\d.naninf]+) -> (?P<last>[-\d.naninf]+) over \d+ steps; median step "
    r"(?P<ms>[\d.]+) ms.*?(?:; peak (?P<gib>[\d.]+) GiB allocated)?$",
    re.M,
)


STEP_LOSS = re.compile(r"^step\s+\d+ \| loss (?P<loss>[-\d.naninf]+) \|", re.M)


def run_case(setting: Setting, row: Row, out: Path, data: Path | None = None) -> None:
    """The plan's program for ``setting.steps`` steps (on ``data``'s tokens where given, else the model file's
    draws): its median step, peak, and every step's loss."""
    plan = out / f"{row.case}.plan.json"
    feed = ["--data", str(data)] if data is not None else []
    done = autoshard(
        ["run", str(plan), "--steps", str(setting.steps), "--program", str(out / f"{row.case}.py"), *feed],
        setting.limit_s,
        out / f"{row.case}.log",
    )
    match = SUMMARY.search(done.stdout)
    if done.returncode != 0 or match is None:
        row.error = f"run: {last_line(done)}"
        return
    row.measured_step_s = float(match["ms"]) / 1e3
    row.first_loss, row.last_loss = float(match["first"]), float(match["last"])
    row.losses = [float(m["loss"]) for m in STEP_LOSS.finditer(done.stdout)]
    row.measured_peak_bytes = int(float(match["gib"]) * 2**30) if match["gib"] else None


def dryrun_case(setting: Setting, row: Row, out: Path) -> None:
    """The plan's dry run (one rank on fake tensors): its peak, for the table's dry-run column."""
    done = autoshard(
        ["dryrun", str(out / f"{row.case}.plan.json"), "--json"], setting.limit_s, out / f"{row.case}.dryrun.log"
    )
    try:
        row.dryrun_peak_bytes = json.loads(done.stdout)["ranks"][0]["peak_bytes"]
    except (ValueError, KeyError, IndexError):
        row.dryrun_peak_bytes = None  # the table says "-"; the log says why


def allocated_bytes(row: Row) -> int | None:
    """The plan's predicted live bytes at the peak: the parts' sum, before the allocator slack."""
    parts = [v for k, v in row.predicted_parts.items() if k != "peak_bytes"]
    return sum(parts) if parts else None


def last_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    return lines[-1][:300] if lines else f"exit {done.returncode}"


def hand_loop(setting: Setting, microbatch: int, steps: int) -> dict:
    """The same model, micro-batches and AdamW written by hand: one process, no autoshard runtime.
    bf16 autocast on a GPU, fp32 on CPU; the first step skipped, as the program's summary does."""
    import torch

    from autoshard.modelfile import load_model_file

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model_file = load_model_file(setting.model)
    model = model_file.factory().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    accumulate = setting.global_batch // microbatch
    batches = [model_file.module.example_batch(microbatch) for _ in range(accumulate)]
    batches = [(tuple(x.to(device) for x in inputs), target.to(device)) for inputs, target in batches]
    times_s = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        started = time.perf_counter()
        for inputs, target in batches:
            with autocast:
                loss = model_file.module.loss_fn(model(*inputs), target) / accumulate
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times_s.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    del model, optimizer, batches
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "microbatch_size": microbatch,
        "median_step_s": statistics.median(times_s[1:] or times_s),
        "peak_bytes": peak,
    }


def profile(setting: Setting, microbatch: int, out: Path) -> None:
    """``benchmarks/gpu_kernels.py``'s profile of the hand-written loop at ``microbatch``: each op class's own
    kernel time per step, for ``gpu_kernels.py OUT/kernels-mbB.json --predict OUT/cluster.yaml`` to price."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_kernels

    try:
        result = gpu_kernels.measure(setting.model, microbatch, setting.global_batch)
    except Exception as exc:  # a profile that does not fit is a line, not the end of the session
        print(f"profile micro-batch {microbatch}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return
    (out / f"kernels-mb{microbatch}.json").write_text(json.dumps(result, indent=1))
    print(
        f"profile micro-batch {microbatch}: step {result['step_s'] * 1e3:.1f} ms, busy {result['busy_s'] * 1e3:.1f} ms",
        flush=True,
    )


def dcp_resume(out: Path, cluster: str, limit_s: float) -> dict:
    """Save at step 4, then a second run of 8 steps resumes from it: it must train steps 4..7 only (steps count from 0)."""
    plan, ckpt, log = out / "dcp.plan.json", out / "dcp-checkpoints", out / "dcp.log"
    done = autoshard(
        [
            "plan",
            DCP_MODEL,
            "--cluster",
            cluster,
            "--devices-per-node",
            "1",
            "--global-batch",
            "8",
            "--dp",
            "1",
            "--zero",
            "0",
            "-o",
            str(plan),
        ],
        limit_s,
        log,
    )
    if done.returncode != 0:
        return {"error": f"plan: {last_line(done)}"}
    runs = []
    for steps in (4, 8):
        done = autoshard(
            [
                "run",
                str(plan),
                "--steps",
                str(steps),
                "--checkpoint-dir",
                str(ckpt),
                "--checkpoint-every",
                "4",
                "--program",
                str(out / "dcp.py"),
            ],
            limit_s,
            log,
        )
        runs.append(
            {
                "steps": steps,
                "exit": done.returncode,
                "steps_logged": [int(s) for s in re.findall(r"^step\s+(\d+)", done.stdout, re.M)],
            }
        )
    return {"runs": runs, "resumed": runs[1]["exit"] == 0 and runs[1]["steps_logged"][:1] == [runs[0]["steps"]]}


def byte_tokens(text: Path, out: Path) -> Path:
    """``text``'s bytes as a flat uint16 token file (``autoshard run --data``'s format, one token per byte, ids
    0-255: inside any model's vocabulary), so loss curves follow a real text rather than uniform draws."""
    import numpy as np

    path = out / "text-bytes.bin"
    np.frombuffer(text.read_bytes(), dtype=np.uint8).astype(np.uint16).tofile(path)
    return path


# A float8 run's loss curve is taken to match its bf16 twin's when no step's loss is further from the twin's than
# this fraction of it (declared in benchmarks/reports/gpu-h200-2026-12-04/README.md before the run).
FLOAT8_LOSS_TOLERANCE = 0.03


def float8_twin(row: Row, rows: list[Row]) -> Row | None:
    """The bf16 run of ``row``'s plan: the first case with losses whose pins are ``row``'s with float8 off (or not
    pinned: the calibrated cluster has no float8 peak, so its plans keep bf16)."""
    bare = {k: v for k, v in row.pins.items() if k != "float8"}
    for other in rows:
        other_bare = {k: v for k, v in other.pins.items() if k != "float8"}
        if other.pins.get("float8", "off") == "off" and other_bare == bare and other.losses:
            return other
    return None


def float8_curves(rows: list[Row]) -> list[dict]:
    """Each float8 run beside its bf16 twin: the largest per-step relative loss difference
    max_s |L8(s) − L16(s)| / L16(s) over the steps both ran, the last losses, and the measured and predicted step
    time ratios (float8 / bf16)."""
    curves = []
    for row in rows:
        if row.pins.get("float8", "off") == "off" or not row.losses:
            continue
        twin = float8_twin(row, rows)
        if twin is None:
            continue
        pairs = list(zip(row.losses, twin.losses))
        worst = max(abs(a - b) / abs(b) for a, b in pairs)
        curves.append(
            {
                "case": row.case,
                "twin": twin.case,
                "steps": len(pairs),
                "max_relative_loss_difference": worst,
                "within_tolerance": worst <= FLOAT8_LOSS_TOLERANCE,
                "last_loss": [row.losses[len(pairs) - 1], twin.losses[len(pairs) - 1]],
                "measured_step_ratio": ratio(row.measured_step_s, twin.measured_step_s),
                "predicted_step_ratio": ratio(row.predicted_step_s, twin.predicted_step_s),
            }
        )
    return curves


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def curves_table(curves: list[dict]) -> str:
    """The float8 runs beside their bf16 twins, for results.md."""
    if not curves:
        return ""
    lines = [
        "",
        f"float8 against its bf16 twin (tolerance: every step's loss within {FLOAT8_LOSS_TOLERANCE:.0%} of the twin's)",
        "",
        "| float8 case | bf16 twin | steps | max per-step loss difference | last loss (float8 / bf16) | "
        "measured step float8 / bf16 | predicted step float8 / bf16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in curves:
        measured, predicted = c["measured_step_ratio"], c["predicted_step_ratio"]
        lines.append(
            f"| {c['case']} | {c['twin']} | {c['steps']} | {c['max_relative_loss_difference']:.2%}"
            f"{'' if c['within_tolerance'] else ' (outside)'} | {c['last_loss'][0]:.4f} / {c['last_loss'][1]:.4f} | "
            f"{f'{measured:.3f}' if measured else '-'} | {f'{predicted:.3f}' if predicted else '-'} |"
        )
    return "\n".join(lines) + "\n"


def table(facts_: dict, rows: list[Row], hand: list[dict], peak_tflops: float | None) -> str:
    """The markdown table: predicted vs measured step and peak, measured MFU, hand-written loop."""
    hand_by_mb = {h["microbatch_size"]: h["median_step_s"] for h in hand if "median_step_s" in h}
    lines = [
        f"{facts_['device']}, torch {facts_['torch']} (CUDA {facts_['cuda']}), {facts_['date']}; "
        f"the cluster file's peak {peak_tflops} TFLOP/s"
        if peak_tflops
        else f"{facts_['device']}, {facts_['date']}",
        "",
        "| case | predicted step | measured step | error | predicted allocated (Σ parts) | dry run | "
        "measured max allocated | error | measured MFU | hand-written loop step | program / hand |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.error:
            lines.append(f"| {r.case} | {ms(r.predicted_step_s)} | failed: {r.error} ||||||||")
            continue
        if r.measured_step_s is None:
            lines.append(f"| {r.case} | {ms(r.predicted_step_s)} | not run yet ||||||||")
            continue
        mfu = r.predicted_mfu * r.predicted_step_s / r.measured_step_s
        same_work = r.pins.get("recompute") == "none" and r.pins.get("zero") == 0  # what the hand loop does
        hand_s = hand_by_mb.get(r.pins.get("microbatch_size")) if same_work else None
        lines.append(
            f"| {r.case} | {ms(r.predicted_step_s)} | {ms(r.measured_step_s)} | "
            f"{pct(r.predicted_step_s, r.measured_step_s)} | {gib(allocated_bytes(r))} | "
            f"{gib(r.dryrun_peak_bytes)} | {gib(r.measured_peak_bytes)} | "
            f"{pct(allocated_bytes(r), r.measured_peak_bytes)} | "
            f"{f'{mfu:.1%}' if mfu is not None else '-'} | {ms(hand_s)} | "
            f"{f'{r.measured_step_s / hand_s:.3f}' if hand_s else '-'} |"
        )
    return "\n".join(lines) + "\n" + curves_table(float8_curves(rows))


def ms(s: float | None) -> str:
    return f"{s * 1e3:.1f} ms" if s is not None else "-"


def gib(b: int | None) -> str:
    return f"{b / 2**30:.2f} GiB" if b is not None else "-"


def pct(predicted: float | None, measured: float | None) -> str:
    return f"{(predicted - measured) / measured:+.1%}" if predicted is not None and measured else "-"


def calibrated_peak(cluster: str) -> float | None:
    from autoshard.cost.hardware import load_cluster

    return load_cluster(cluster).device.peak_tflops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cpu", action="store_true", help="the CPU path: the example GPT, one case, few steps")
    parser.add_argument(
        "--cluster",
        help="plan on this preset or cluster file instead of calibrating (the test of "
        "the CPU path: calibrate has its own)",
    )
    parser.add_argument("--cases", help="only these cases, comma-separated (default: every case)")
    parser.add_argument("--hand-microbatches", help="micro-batch sizes of the hand-written loop, comma-separated")
    parser.add_argument("--steps", type=int, help="optimizer steps per program run (default: the setting's)")
    parser.add_argument(
        "--text",
        type=Path,
        help="train the plans' programs on this text's bytes (one token per byte) instead of the model file's "
        "draws: loss curves of a real text (the float8 runs beside their bf16 twins)",
    )
    parser.add_argument("--no-dcp", action="store_true", help="skip DCP save and resume")
    parser.add_argument("--no-dryrun", action="store_true", help="skip the plans' dry runs")
    parser.add_argument(
        "--profile",
        help="micro-batch sizes whose hand-written loop is profiled by op class, "
        "comma-separated (benchmarks/gpu_kernels.py; OUT/kernels-mbB.json)",
    )
    args = parser.parse_args(argv)
    setting = CPU if args.cpu else GPU
    if args.cases:
        wanted = args.cases.split(",")
        setting = replace(setting, cases=tuple(c for c in setting.cases if c.name in wanted))
    if args.hand_microbatches is not None:
        sizes = tuple(int(m) for m in args.hand_microbatches.split(",") if m)
        setting = replace(setting, hand_microbatches=sizes)
    if args.steps is not None:
        setting = replace(setting, steps=args.steps)
    if args.text is not None and not args.text.is_file():
        parser.error(f"--text {args.text}: no such file; give a text file (e.g. examples/data/northanger_abbey.txt)")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    info = facts()
    (out / "facts.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info), flush=True)
    cluster = args.cluster or str(out / "cluster.yaml")
    if args.cluster is None:
        done = autoshard(
            ["calibrate", "--quick", "--devices-per-node", "1", "-o", cluster], setting.limit_s, out / "calibrate.log"
        )
        print(f"calibrate: exit {done.returncode} {last_line(done)}", flush=True)
        if done.returncode != 0:
            return 1
    data = byte_tokens(args.text, out) if args.text else None
    floating = float8_cluster(cluster, out) if any("float8" in c.pins for c in setting.cases) else None
    print(f"float8 cluster: {floating or 'none (no float8 matmuls here)'}", flush=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        rows = list(
            pool.map(lambda c: plan_case(setting, c, floating if "float8" in c.pins else cluster, out), setting.cases)
        )
    hand: list[dict] = []

    def save() -> None:
        results = {
            "facts": info,
            "rows": [asdict(r) for r in rows],
            "hand_loop": hand,
            "float8_curves": float8_curves(rows),
        }
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "results.md").write_text(table(info, rows, hand, calibrated_peak(cluster)))

    for row in rows:
        if row.error is None:
            run_case(setting, row, out, data)
        print(
            f"{row.case}: predicted {ms(row.predicted_step_s)} {gib(row.predicted_peak_bytes)}, measured "
            f"{ms(row.measured_step_s)} {gib(row.measured_peak_bytes)} {row.error or ''}",
            flush=True,
        )
        save()
    for microbatch in setting.hand_microbatches:
        try:
            hand.append(hand_loop(setting, microbatch, setting.steps))
        except Exception as exc:  # a loop that does not fit is a row, not the end of the session
            hand.append({"microbatch_size": microbatch, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        print(f"hand-written loop: {hand[-1]}", flush=True)
        save()
    for microbatch in [int(m) for m in (args.profile or "").split(",") if m]:
        profile(setting, microbatch, out)
    dcp = {"resumed": "not run (--no-dcp)"} if args.no_dcp else dcp_resume(out, cluster, setting.limit_s)
    (out / "dcp.json").write_text(json.dumps(dcp, indent=1))
    print(f"dcp save and resume: {dcp}", flush=True)
    save()
    if not args.no_dryrun:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(4, (os.cpu_count() or 1) // 4))) as pool:
            list(pool.map(lambda r: dryrun_case(setting, r, out), [r for r in rows if r.error is None]))
        print("dry runs: " + ", ".join(f"{r.case} {gib(r.dryrun_peak_bytes)}" for r in rows), flush=True)
        save()
    print((out / "results.md").read_text(), flush=True)
    return 0 if all(r.error is None for r in rows) and dcp.get("resumed") else 1


if __name__ == "__main__":
    sys.exit(main())
