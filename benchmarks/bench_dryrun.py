"""GPU plans' predicted memory vs ``autoshard dryrun``'s measured peak, by part (benchmarks/RESULTS.md, "Dry run").

    python benchmarks/bench_dryrun.py [-o runs/dryrun.json] [NAME ...]

Each row is planned with its decisions pinned (``autoshard estimate``: the configuration is priced even where
the planner would choose another), then one rank runs the program's setup and two steps on fake tensors
(``autoshard dryrun --json``: rank 0, and a pipeline's last stage). Prints a markdown table: measured and
predicted peak per rank, each part's measured / predicted. Rows whose full depth would take a CPU dry run
more than about ten minutes run the model's shape at fewer layers (``llama3_8b_2l`` ...: every layer is the
same, so the per-layer figures are the full model's): the column "layers run" says how many.

Long sequences with tensor parallelism (declared 2026-12-01 before their first run, every row run once and
reported as run; nothing in the cost model is fitted to them): ``hf8b-dp2-tp4-sp-8k`` and ``hf8b-dp2-tp4-8k``
(transformers' Llama-3.1-8B config at its full 32 layers, 8,192 tokens, dp 2 x tp 4, ZeRO-3, selective recompute,
micro-batch 1, with and without sequence parallelism), ``8b-dp2-tp2-cp2-32k`` (dp 2 x tp 2 x cp 2 at 32,768
tokens, selective) and ``hf70b-plan-32nodes-8k`` (the plan ``autoshard plan`` picks for Llama-3.1-70B on 32
dgx-h100 nodes at global batch 512 and 8,192 tokens, its full 80 layers). Target: each within 5 % of its dry run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
L8, L8_4, L70 = (
    "benchmarks/llama3.py:llama3_8b",
    "benchmarks/llama3.py:llama3_8b_4l",
    "benchmarks/llama3.py:llama3_70b_2l",
)
L8_2 = "benchmarks/llama3.py:llama3_8b_2l"
MOE = "benchmarks/mixtral.py:build_2l"
# transformers' Llama-3.1 configs (meta-llama/Llama-3.1-8B and -70B's shapes, examples/configs/) as ``hf:DIR``
# models: the library's own attention (its causal mask) and RMSNorm (its fp32 upcast)
HF8, HF70 = "hf:examples/configs/llama-3.1-8b", "hf:examples/configs/llama-3.1-70b"
LONG = ["--seq-len", "8192"]
SELECTIVE_TP4 = [*LONG, "--pp", "1", "--dp", "2", "--tp", "4", "--zero", "3", "--recompute", "selective"]
H100, TWO_NODES = ["--cluster", "dgx-h100"], ["--cluster", "dgx-h100", "--nodes", "2"]
BASE = ["--global-batch", "8", "--microbatch-size", "1"]
SPMD = ["--pp", "1"]
FSDP = [*SPMD, "--dp", "8", "--tp", "1", "--zero", "3"]
TP = [*SPMD, "--dp", "4", "--tp", "2", "--recompute", "none"]
PP = ["--dp", "2", "--tp", "2", "--pp", "2", "--zero", "1", "--recompute", "none"]
CASES = {  # name: (model, layers run of the model's, cluster arguments, pins)
    "8b-fsdp": (L8, "32 of 32", H100, [*FSDP, "--recompute", "none"]),
    "8b-fsdp-selective": (L8_2, "2 of 32", H100, [*FSDP, "--recompute", "selective"]),
    "8b-fsdp-full": (L8_2, "2 of 32", H100, [*FSDP, "--recompute", "full"]),
    "8b-hsdp": (
        L8_2,
        "2 of 32",
        TWO_NODES,
        [
            *SPMD,
            "--dp",
            "16",
            "--tp",
            "1",
            "--zero",
            "3",
            "--dp-replicate",
            "2",
            "--recompute",
            "none",
            "--global-batch",
            "16",
        ],
    ),
    "8b-dp4-tp2": (L8_2, "2 of 32", H100, [*TP, "--zero", "3", "--sequence-parallel", "off"]),
    "8b-dp4-tp2-sp": (L8_2, "2 of 32", H100, [*TP, "--zero", "3", "--sequence-parallel", "on"]),
    "8b-dp4-tp2-zero1": (L8_2, "2 of 32", H100, [*TP, "--zero", "1", "--sequence-parallel", "off"]),
    "8b-tp2-pp2-1f1b": (L8_4, "4 of 32", H100, [*PP, "--schedule", "1f1b"]),
    "8b-tp2-pp2-interleaved": (L8_4, "4 of 32", H100, [*PP, "--schedule", "interleaved-1f1b", "--virtual-stages", "2"]),
    "8b-cp2-32k": (
        L8_2,
        "2 of 32",
        H100,
        [*SPMD, "--dp", "4", "--tp", "1", "--cp", "2", "--zero", "3", "--recompute", "none", "--seq-len", "32768"],
    ),
    "8b-cp4-64k": (
        L8_2,
        "2 of 32",
        H100,
        [*SPMD, "--dp", "2", "--tp", "1", "--cp", "4", "--zero", "3", "--recompute", "none", "--seq-len", "65536"],
    ),
    "mixtral-ep8": (
        MOE,
        "2 of 32",
        H100,
        [*SPMD, "--dp", "8", "--tp", "1", "--ep", "8", "--zero", "3", "--recompute", "full"],
    ),
    # long sequences with tensor parallelism and selective recompute (the policy keeps the TP collectives' outputs)
    "hf8b-dp2-tp4-sp-8k": (HF8, "32 of 32", H100, [*SELECTIVE_TP4, "--sequence-parallel", "on"]),
    "hf8b-dp2-tp4-8k": (HF8, "32 of 32", H100, [*SELECTIVE_TP4, "--sequence-parallel", "off"]),
    "8b-dp2-tp2-cp2-32k": (
        L8_2,
        "2 of 32",
        H100,
        [*SPMD, "--dp", "2", "--tp", "2", "--cp", "2", "--zero", "3", "--recompute", "selective", "--seq-len", "32768"],
    ),
    # the plan `autoshard plan` picks (None: searched, not pinned) for Llama-3.1-70B on 32 nodes at 8k tokens
    "hf70b-plan-32nodes-8k": (
        HF70,
        "80 of 80",
        ["--cluster", "dgx-h100", "--nodes", "32", "--global-batch", "512", *LONG],
        None,
    ),
    "70b-fsdp-2nodes": (
        L70,
        "2 of 80",
        TWO_NODES,
        [*SPMD, "--dp", "16", "--tp", "1", "--zero", "3", "--recompute", "full", "--global-batch", "16"],
    ),
}


def run_case(name: str, folder: Path) -> dict:
    model, layers, cluster, pins = CASES[name]
    plan = folder / f"{name}.plan.json"
    # pins None: the planner's pick for the row's cluster and batch
    command = ["estimate", model, *cluster, *BASE, *pins] if pins is not None else ["plan", model, *cluster]
    estimate = subprocess.run(
        [sys.executable, "-m", "autoshard", *command, "-o", str(plan)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )  # a later --global-batch wins
    if not plan.exists():  # written, and exit 1, where it does not fit in the device's memory
        return {"name": name, "layers": layers, "error": estimate.stderr.strip().splitlines()[-1]}
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "autoshard", "dryrun", str(plan), "--json"], cwd=ROOT, capture_output=True, text=True
    )
    if out.returncode != 0:
        return {"name": name, "error": out.stderr.strip().splitlines()[-1]}
    ranks = json.loads(out.stdout)["ranks"]
    return {"name": name, "layers": layers, "seconds": round(time.perf_counter() - start, 1), "ranks": ranks}


def table(rows: list[dict]) -> str:
    """One line per rank dry-run (a pipeline's first and last stage): peaks, each part measured / predicted."""
    gib = 2**30
    lines = [
        "| plan | layers run | rank | measured peak | predicted peak | weights | grads | optimizer | activations | "
        "transient | dry run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['name']} | {row.get('layers', '')} | | {row['error']} | | | | | | | |")
            continue
        for rank in row["ranks"]:
            cells = [f"{m / gib:.2f} / {p / gib:.2f}" for m, p in rank["parts"].values()]
            off = (rank["peak_bytes"] - rank["predicted_peak_bytes"]) / rank["predicted_peak_bytes"]
            lines.append(
                f"| {row['name']} | {row['layers']} | {rank['rank']} | {rank['peak_bytes'] / gib:.2f} GiB | "
                f"{rank['predicted_peak_bytes'] / gib:.2f} GiB ({off:+.1%}) | {' | '.join(cells)} | "
                f"{row['seconds']} s |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(CASES))
    parser.add_argument("-o", "--output")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        rows = []
        for name in args.names:
            rows.append(run_case(name, Path(folder)))
            print(json.dumps(rows[-1]), flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
