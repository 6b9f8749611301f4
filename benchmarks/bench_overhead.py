"""autoshard's emitted programs against hand-written torch.distributed scripts doing the same.

    python benchmarks/bench_overhead.py --rounds 5 -o runs/overhead.json

For DP (DDP), ZeRO-3 (FSDP2), TP and PP on 2 and 4 CPU ranks, the example GPT (global batch 16):
the plan is pinned to the layout (``autoshard.plan``: dp / zero / tp / pp and the micro-batches),
its program is emitted, and the hand-written script of the same layout (``benchmarks/baselines/``)
gets the same global batch, micro-batches, DDP bucket size and pipeline split. Each round runs
every program once, the pair of each case back to back in alternating order, so that a slow
phase of the machine hits both alike. A run's figure is its median step after the first; a
case's ratio is the median of the emitted program's figures over the median of the baseline's
(the median of the per-round ratios is reported beside it).
TP plans are made on ``tests/clusters/fast_link_cpu.yaml``, where the planner shards the
attention and MLP like the hand-written Megatron layout (the table lists the styles).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import autoshard  # noqa: E402
from autoshard.launch import write_program  # noqa: E402

GPT = "examples/gpt.py:build"
FAST = str(ROOT / "tests/clusters/fast_link_cpu.yaml")
GLOBAL_BATCH = 16


def cases(ranks: int) -> dict[str, tuple[str, dict]]:
    """name -> (cluster, pins) of each layout at ``ranks`` ranks."""
    return {
        "ddp": ("local-cpu", dict(dp=ranks, zero=0, microbatch_size=GLOBAL_BATCH // ranks, recompute="none")),
        "fsdp": ("local-cpu", dict(dp=ranks, zero=3, microbatch_size=GLOBAL_BATCH // ranks, recompute="none")),
        "tp": (FAST, dict(tp=ranks, dp=1, microbatch_size=GLOBAL_BATCH, recompute="none")),
        "pp": ("local-cpu", dict(pp=ranks, dp=1, microbatch_size=GLOBAL_BATCH // 4, schedule="1f1b")),
    }


def torchrun(script: Path, ranks: int, args: list[str], figure: Path) -> float:
    """Run ``script`` and read the median step it writes to ``figure``.

    A hand-written script that ends with ``destroy_process_group`` can die in gloo's teardown
    (SIGABRT after training; ``runtime.distributed.shutdown`` says why): its figure, written
    before, is kept. A run with no figure is tried once more."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        str(script),
        *args,
    ]
    for _ in range(2):
        figure.unlink(missing_ok=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if figure.is_file():
            if proc.returncode != 0:
                print(
                    f"  ({script.name} died after writing its figure, exit {proc.returncode}: figure kept)", flush=True
                )
            return json.loads(figure.read_text())["median_step_s"]
    raise RuntimeError(f"{script.name} failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")


def emitted_s(program: Path, ranks: int, steps: int, tmp: Path) -> float:
    args = ["--steps", str(steps), "--metrics-out", str(tmp / "m"), "--log-every", "1000"]
    return torchrun(program, ranks, args, tmp / "m" / "metrics.json")


def baseline_s(name: str, plan, ranks: int, steps: int, tmp: Path) -> float:
    out = tmp / "baseline.json"
    args = [
        "--steps",
        str(steps),
        "--global-batch",
        str(GLOBAL_BATCH),
        "--microbatches",
        str(plan.num_microbatches),
        "--bucket-cap-mb",
        str(plan.ddp_bucket_cap_mb),
        "--out",
        str(out),
    ]
    if plan.split_points:
        args += ["--splits", ",".join(plan.split_points)]
    if plan.tensor_parallel:
        args += ["--tp-styles", json.dumps(dict(plan.tensor_parallel))]
    return torchrun(ROOT / "benchmarks" / "baselines" / f"{name}.py", ranks, args, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--cases", nargs="*", choices=["ddp", "fsdp", "tp", "pp"], default=["ddp", "fsdp", "tp", "pp"])
    parser.add_argument("-o", "--output")
    a = parser.parse_args()
    os.chdir(ROOT)
    plans = {}
    for ranks in a.ranks:
        for name, (cluster, pins) in cases(ranks).items():
            if name not in a.cases:
                continue
            plans[name, ranks] = autoshard.plan(
                GPT, cluster=cluster, devices_per_node=ranks, global_batch=GLOBAL_BATCH, **pins
            )
    times = {key: {"emitted": [], "baseline": []} for key in plans}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        programs = {key: write_program(plan, tmp / f"{key[0]}{key[1]}.py") for key, plan in plans.items()}
        for r in range(a.rounds):
            for key, plan in plans.items():
                order = ("emitted", "baseline") if r % 2 == 0 else ("baseline", "emitted")
                for who in order:
                    t = (
                        emitted_s(programs[key], key[1], a.steps, tmp)
                        if who == "emitted"
                        else baseline_s(key[0], plan, key[1], a.steps, tmp)
                    )
                    times[key][who].append(t)
                e, b = times[key]["emitted"][-1], times[key]["baseline"][-1]
                print(
                    f"round {r + 1} {key[0]:>4} x{key[1]}: emitted {e * 1e3:7.1f} ms  baseline {b * 1e3:7.1f} ms  "
                    f"{e / b:.3f}",
                    flush=True,
                )
    rows = []
    for key, t in times.items():
        ratios = [e / b for e, b in zip(t["emitted"], t["baseline"])]
        plan = plans[key]
        emitted, baseline = statistics.median(t["emitted"]), statistics.median(t["baseline"])
        rows.append(
            {
                "case": key[0],
                "ranks": key[1],
                "emitted_ms": emitted * 1e3,
                "baseline_ms": baseline * 1e3,
                "ratio": emitted / baseline,
                "median_of_round_ratios": statistics.median(ratios),
                "rounds": t,
                "tensor_parallel": plan.tensor_parallel,
                "split_points": list(plan.split_points),
            }
        )
        print(
            f"{key[0]:>4} x{key[1]}: emitted {rows[-1]['emitted_ms']:.1f} ms, baseline {rows[-1]['baseline_ms']:.1f} ms,"
            f" ratio of medians {rows[-1]['ratio']:.3f}"
            + (f"  TP styles {plan.tensor_parallel}" if key[0] == "tp" else "")
        )
    if a.output:
        Path(a.output).write_text(
            json.dumps(
                {"date": time.strftime("%Y-%m-%d"), "wall_s": time.perf_counter() - start, "rows": rows}, indent=1
            )
        )


if __name__ == "__main__":
    main()
