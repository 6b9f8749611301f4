"""Planning mixture-of-experts models: how long it takes, and where the expert all-to-all lands.

    python benchmarks/bench_moe.py -o runs/moe_planner.json

For each model and cluster: the wall time of one ``autoshard plan`` process (Python start, imports,
capture on meta, search, plan written), cold (``--no-cache``) and with the capture cache filled
(the median of ``--repeats``); the chosen plan's ep, its ep group's span (ranks 0, tp, .., (ep−1)·tp:
inside one node or across how many), and, for contrast, the best plan with the experts kept inside
a node (``--ep`` pinned to each in-node degree; "does not fit" where none fits).

    DeepSeek-V3 shape (benchmarks/deepseek_v3.py, 671B, 256 experts top-8) on 2048 H100s (256 nodes)
    Mixtral 8x7B shape (benchmarks/mixtral.py, 46.7B, 8 experts top-2) on 64 H100s (8 nodes)
    DeepSeek-V3's architecture at V2-Lite's size (deepseek_v3.py:build_16b, 15.7B, 64 experts top-6) on 64 H100s
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
CASES = (  # model, nodes of dgx-h100, global batch (sequences)
    ("benchmarks/deepseek_v3.py:build", 256, 4096),
    ("benchmarks/mixtral.py:build", 8, 512),
    ("benchmarks/deepseek_v3.py:build_16b", 8, 512),
)
PER_NODE = 8


def plan(model: str, nodes: int, batch: int, env: dict, out: Path, *extra: str) -> tuple[float, dict | None]:
    """(wall seconds, the plan JSON or None when nothing fits) of one ``autoshard plan``."""
    command = [
        sys.executable,
        "-m",
        "autoshard.cli",
        "plan",
        model,
        "--cluster",
        "dgx-h100",
        "--nodes",
        str(nodes),
        "--global-batch",
        str(batch),
        "-o",
        str(out),
        *extra,
    ]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - start
    if proc.returncode == 2 and "no plan fits" in proc.stderr:
        return wall, None
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return wall, json.loads(out.read_text())


def describe(doc: dict | None) -> dict:
    if doc is None:
        return {"fits": False}
    d, p = doc["decisions"], doc["predicted"]
    mesh, ep = d["mesh"], d.get("ep", 1)
    span = (ep - 1) * mesh["tp"] // PER_NODE + 1  # nodes rank 0's ep group touches (adjacent dp ranks)
    return {
        "fits": True,
        "mesh": mesh,
        "ep": ep,
        "zero": d["zero_stage"],
        "schedule": d["schedule"],
        "microbatch": d["microbatch_size"],
        "recompute": d["recompute"],
        "ep_nodes": span,
        "step_s": p["step_time_s"],
        "peak_gib": p["memory_peak_bytes_per_rank"] / 2**30,
        "tokens_per_s": p["tokens_per_s"],
        "mfu": p["mfu"],
    }


def run_case(model: str, nodes: int, batch: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, AUTOSHARD_CACHE_DIR=f"{tmp}/cache")
        out = Path(tmp) / "plan.json"
        cold = [plan(model, nodes, batch, env, out, "--no-cache")[0] for _ in range(repeats)]
        plan(model, nodes, batch, env, out)  # fills the capture cache
        warm = [plan(model, nodes, batch, env, out) for _ in range(repeats)]
        chosen = describe(warm[-1][1])
        in_node = {
            ep: describe(plan(model, nodes, batch, env, out, "--ep", str(ep))[1])
            for ep in (1, 2, 4, 8)
            if chosen.get("ep") != ep
        }
    return {
        "model": model,
        "gpus": nodes * PER_NODE,
        "global_batch": batch,
        "cold_s": statistics.median(cold),
        "warm_s": statistics.median(w for w, _ in warm),
        "chosen": chosen,
        "ep_pinned_in_node": in_node,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("-o", "--output")
    parser.add_argument("--models", help="only the cases whose model spec contains this")
    args = parser.parse_args()
    rows = []
    for model, nodes, batch in CASES:
        if args.models and args.models not in model:
            continue
        row = run_case(model, nodes, batch, args.repeats)
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
