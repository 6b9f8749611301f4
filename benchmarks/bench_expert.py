"""The planner against Megatron-LM's hand-tuned configurations, both planned and emitted through the CLI.

    python benchmarks/bench_expert.py                  # every row of SC21 Table 1 (1.7B ... 1T, 32 ... 3072 A100s)
    python benchmarks/bench_expert.py --rows 1.7B 18.4B
    python benchmarks/bench_expert.py --torchtitan     # torchtitan's Llama 3.1 runs on dgx-h100 instead

For each published row (``bench_megatron.ROWS``, sources ``numbers`` and ``sc21``: Narayanan et
al. SC21 Table 1), on ``dgx-a100-80gb`` with GPUs / 8 nodes and the row's global batch, two
commands a user can type, both priced for autoshard's own emitted programs (``--runtime
autoshard``: eager PyTorch, bf16 autocast, SDPA):

- **published**: ``autoshard estimate`` with the row exactly as run: its tp, pp, dp, micro-batch,
  full recompute, ZeRO-0 (Megatron's DDP), 1F1B or interleaved 1F1B with Megatron's v, and
  Megatron's even split of layers over the stages (``--stage-cuts even``);
- **planner**: ``autoshard plan`` with nothing pinned.

Each plan is then emitted (``autoshard compile``): both sides are programs that run. Reported
per row: both step times, planner / published (≤ 1 is the target: at least as fast as the experts
under the same cost model), whether each fits in 80 GB, the planner's choice, and its wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_megatron import CLUSTER, MODEL_FILE, ROWS  # noqa: E402

TABLE_1 = tuple(r for r in ROWS if r.source in ("numbers", "sc21"))
LLAMA3 = ROOT / "benchmarks" / "llama3.py"
# torchtitan's published Llama 3.1 runs (benchmarks/RESULTS.md, "torchtitan's published configurations"):
# name, factory, dgx-h100 nodes, global batch, the configuration's pins
TORCHTITAN = (
    ("8B FSDP 8 GPUs", "llama3_8b", 1, 16, "--dp 8 --tp 1 --pp 1 --zero 3 --microbatch-size 2 --recompute selective"),
    (
        "8B FSDP 128 GPUs",
        "llama3_8b",
        16,
        256,
        "--dp 128 --tp 1 --pp 1 --zero 3 --microbatch-size 2 --recompute selective",
    ),
    ("70B FSDP32 TP8", "llama3_70b", 32, 512, "--dp 32 --tp 8 --pp 1 --zero 3 --microbatch-size 16 --recompute full"),
    (
        "405B FSDP8 TP8 PP8 1F1B",
        "llama3_405b",
        64,
        256,
        "--dp 8 --tp 8 --pp 8 --zero 3 --microbatch-size 1 --recompute full --schedule 1f1b --stage-cuts even",
    ),
    (
        "405B FSDP8 TP8 PP8 interleaved",
        "llama3_405b",
        64,
        256,
        "--dp 8 --tp 8 --pp 8 --zero 3 --microbatch-size 1 "
        "--recompute full --schedule interleaved-1f1b "
        "--virtual-stages 2 --stage-cuts even",
    ),
)
AUTOSHARD = [sys.executable, "-m", "autoshard.cli"]


def autoshard(*args: str) -> subprocess.CompletedProcess:
    """One CLI command, as a user runs it; a failure stops the benchmark with its message."""
    proc = subprocess.run([*AUTOSHARD, *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"autoshard {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    return proc


def common_args(row) -> list[str]:
    return [
        f"{MODEL_FILE}:{row.factory}",
        "--cluster",
        CLUSTER,
        "--nodes",
        str(max(1, row.gpus // 8)),
        "--global-batch",
        str(row.global_batch),
    ]


def published_args(row) -> list[str]:
    """The row exactly as Megatron-LM ran it (module doc)."""
    schedule = "none" if row.pp == 1 else "interleaved-1f1b" if row.virtual_stages > 1 else "1f1b"
    args = [
        "--dp",
        str(row.dp),
        "--tp",
        str(row.tp),
        "--pp",
        str(row.pp),
        "--zero",
        "0",
        "--microbatch-size",
        str(row.micro_batch),
        "--recompute",
        "full",
        "--schedule",
        schedule,
    ]
    if row.pp > 1:
        args += ["--virtual-stages", str(row.virtual_stages), "--stage-cuts", "even"]
    return args


def plan_and_emit(command: str, args: list[str], folder: Path) -> tuple[dict, float]:
    """Run ``autoshard <command>`` writing a plan, then ``autoshard compile`` it; (the plan, wall s)."""
    plan_file, program = folder / f"{command}.json", folder / f"{command}.py"
    start = time.perf_counter()
    autoshard(command, *args, "-o", str(plan_file))
    wall_s = time.perf_counter() - start
    autoshard("compile", str(plan_file), "-o", str(program))
    assert "Training program emitted by autoshard" in program.read_text()[:200], program
    return json.loads(plan_file.read_text()), wall_s


def describe(plan: dict) -> str:
    d = plan["decisions"]
    m = d["mesh"]
    hsdp = f" hsdp{d['dp_replicate']}" if d.get("dp_replicate", 1) > 1 else ""
    sched = (
        ""
        if d["schedule"] == "none"
        else f" {d['schedule']}" + (f" v{d['virtual_stages']}" if d["virtual_stages"] > 1 else "")
    )
    return f"{m['tp']}·{m['pp']}·{m['dp']} z{d['zero_stage']}{hsdp} b{d['microbatch_size']} {d['recompute']}{sched}"


def fits(plan: dict) -> bool:
    return plan["predicted"]["memory_peak_bytes_per_rank"] <= plan["cluster"]["device"]["memory_bytes"]


def torchtitan_rows(names: list[str] | None) -> None:
    """The same comparison against torchtitan's runs on ``dgx-h100`` (module doc of RESULTS' section)."""
    print(
        "| torchtitan run | GPUs | published (estimate) | s | fits | planner (plan) | s | fits | planner / published |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, factory, nodes, batch, pins in TORCHTITAN:
            if names and name not in names:
                continue
            folder = Path(tmp) / name.replace(" ", "_")
            folder.mkdir()
            common = [
                f"{LLAMA3}:{factory}",
                "--cluster",
                "dgx-h100",
                "--nodes",
                str(nodes),
                "--global-batch",
                str(batch),
            ]
            theirs, _ = plan_and_emit("estimate", common + pins.split(), folder)
            ours, _ = plan_and_emit("plan", common, folder)
            t_theirs, t_ours = theirs["predicted"]["step_time_s"], ours["predicted"]["step_time_s"]
            print(
                f"| {name} | {nodes * 8} | {describe(theirs)} | {t_theirs:.2f} | {'yes' if fits(theirs) else 'NO'} | "
                f"{describe(ours)} | {t_ours:.2f} | {'yes' if fits(ours) else 'NO'} | {t_ours / t_theirs:.3f} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", help="row names (default: all of Table 1)")
    parser.add_argument("--torchtitan", nargs="*", help="torchtitan's runs instead (names; none: all)")
    args = parser.parse_args()
    if args.torchtitan is not None:
        torchtitan_rows(args.torchtitan)
        return
    rows = [r for r in TABLE_1 if not args.rows or r.name in args.rows]
    print(
        "| row | GPUs | published (estimate) | s | fits | planner (plan) | s | fits | planner / published "
        "| plan wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            folder = Path(tmp) / row.name
            folder.mkdir()
            theirs, _ = plan_and_emit("estimate", common_args(row) + published_args(row), folder)
            ours, wall_s = plan_and_emit("plan", common_args(row), folder)
            t_theirs, t_ours = theirs["predicted"]["step_time_s"], ours["predicted"]["step_time_s"]
            ratio = t_ours / t_theirs
            worst = max(worst, ratio)
            print(
                f"| {row.name} | {row.gpus} | {describe(theirs)} | {t_theirs:.2f} | {'yes' if fits(theirs) else 'NO'} "
                f"| {describe(ours)} | {t_ours:.2f} | {'yes' if fits(ours) else 'NO'} | {ratio:.3f} | {wall_s:.1f} |",
                flush=True,
            )
    print(f"worst planner / published: {worst:.3f} over {len(rows)} rows (both emitted)")


if __name__ == "__main__":
    main()
