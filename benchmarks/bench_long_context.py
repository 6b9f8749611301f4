"""Long sequences: the plans the planner picks for Llama-3-8B on one node of 8 H100s at 32k-256k tokens.

    python benchmarks/bench_long_context.py -o runs/long_context.json

For each sequence length s (``--seq-len``; benchmarks/llama3.py:llama3_8b computes its rotary angles for
any length) and torchtitan's global batch there (one sequence per FSDP rank: 8, 4, 2, 1 sequences; their
benchmarks/llama3_h100_202412_torchtitan.md, Table 2), three ``autoshard`` runs:

    chosen        ``autoshard plan``: the planner's pick (cp searched with the rest)
    without cp    ``autoshard plan --cp 1``: the best plan that keeps whole sequences, or "none fits"
    torchtitan    ``autoshard estimate`` of torchtitan's configuration (FSDP n x CP 8/n, ZeRO-3, one
                  sequence per micro-batch, full recompute) on the same cluster

Each row: mesh, ZeRO, micro-batch, recompute, predicted peak memory per GPU and tokens/s per GPU, and
the wall time of the ``plan`` process. Predictions only: nothing runs on a GPU here. torchtitan's own
figures (Float8 and torch.compile on 96 GB, 500 W H100s) are printed beside them.
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
MODEL = "benchmarks/llama3.py:llama3_8b"
# seq len: (torchtitan's FSDP, CP, TPS/GPU, memory GiB) of Table 2 (Llama 3.1 8B, 8 GPUs, local batch 1, full AC)
TORCHTITAN = {
    32768: (8, 1, 3890, 83.9),
    65536: (4, 2, 2540, 84.2),
    131072: (2, 4, 1071, 84.0),
    262144: (1, 8, 548, 84.5),
}
GPUS = 8


def run(command: str, seq: int, batch: int, out: Path, *pins: str) -> tuple[float, dict | None, str]:
    """(wall seconds, the plan JSON or None, the refusal) of one ``autoshard plan`` / ``estimate``."""
    argv = [
        sys.executable,
        "-m",
        "autoshard.cli",
        command,
        MODEL,
        "--cluster",
        "dgx-h100",
        "--nodes",
        "1",
        "--global-batch",
        str(batch),
        "--seq-len",
        str(seq),
        "--json",
        "-o",
        str(out),
        *pins,
    ]
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 1) or not out.exists():  # estimate's 1: priced, over the device's memory
        return wall, None, proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"
    return wall, json.loads(out.read_text()), ""


def row(doc: dict | None, seq: int, why: str = "") -> dict:
    if doc is None:
        return {"fits": False, "why": why}
    d, p = doc["decisions"], doc["predicted"]
    return {
        "fits": p["memory_peak_bytes_per_rank"] <= doc["cluster"]["device"]["memory_bytes"],
        "mesh": d["mesh"],
        "zero": d["zero_stage"],
        "microbatch": d["microbatch_size"],
        "microbatches": d["num_microbatches"],
        "recompute": d["recompute"],
        "sequence_parallel": any("seq" in s for s in doc["layout"]["tensor_parallel"].values()),
        "peak_gib": p["memory_peak_bytes_per_rank"] / 2**30,
        "step_s": p["step_time_s"],
        "tokens_per_s_per_gpu": p["tokens_per_s"] / GPUS,
        "mfu": p["mfu"],
    }


def case(seq: int, folder: Path) -> dict:
    fsdp, cp, tps, memory = TORCHTITAN[seq]
    batch = fsdp  # one sequence per FSDP rank
    wall, chosen, why = run("plan", seq, batch, folder / "chosen.json")
    _, whole, why_whole = run("plan", seq, batch, folder / "whole.json", "--cp", "1")
    _, titan, why_titan = run(
        "estimate",
        seq,
        batch,
        folder / "titan.json",
        "--dp",
        str(fsdp),
        "--cp",
        str(cp),
        "--tp",
        "1",
        "--pp",
        "1",
        "--zero",
        "3",
        "--microbatch-size",
        "1",
        "--recompute",
        "full",
    )
    return {
        "seq_len": seq,
        "global_batch": batch,
        "plan_wall_s": wall,
        "chosen": row(chosen, seq, why),
        "without_cp": row(whole, seq, why_whole),
        "torchtitan_config": row(titan, seq, why_titan),
        "torchtitan_measured": {"fsdp": fsdp, "cp": cp, "tokens_per_s_per_gpu": tps, "memory_gib": memory},
    }


def text(r: dict) -> str:
    if not r["fits"] and "mesh" not in r:
        return f"none ({r['why'][:80]})"
    m = r["mesh"]
    mesh = f"dp{m['dp']} tp{m['tp']} pp{m['pp']} cp{m.get('cp', 1)}" + (" +SP" if r["sequence_parallel"] else "")
    return (
        f"{mesh} z{r['zero']} b{r['microbatch']}x{r['microbatches']} {r['recompute']}: "
        f"{r['peak_gib']:.1f} GiB, {r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU{'' if r['fits'] else ' (does not fit)'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path)
    parser.add_argument("--seq-lens", default="32768,65536,131072,262144")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq in map(int, args.seq_lens.split(",")):
            r = case(seq, Path(tmp))
            results.append(r)
            t = r["torchtitan_measured"]
            print(
                f"s={seq:>6} B={r['global_batch']} plan {r['plan_wall_s']:.1f} s\n"
                f"  chosen      {text(r['chosen'])}\n  without cp  {text(r['without_cp'])}\n"
                f"  torchtitan  {text(r['torchtitan_config'])}\n"
                f"  measured    FSDP {t['fsdp']} CP {t['cp']}: {t['tokens_per_s_per_gpu']:,} tok/s/GPU, "
                f"{t['memory_gib']} GiB (torchtitan, Float8 + compile, 96 GB H100)",
                flush=True,
            )
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
