"""GPU plans' predicted memory vs ``autoshard dryrun``'s measured peak, by part (benchmarks/RESULTS.md, "Dry run").

    python benchmarks/bench_dryrun.py [-o runs/dryrun.json] [NAME ...]

Each row is planned with its decisions pinned (``autoshard estimate``: the configuration is priced even where
the planner would choose another), then one rank runs the program's setup and two steps on fake tensors
(``autoshard dryrun --json``). Prints a markdown table: measured and predicted peak per rank, each part's
measured / predicted, and the part that differs most.
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
LLAMA_8B = "benchmarks/llama3.py:llama3_8b"
PINNED = ["--microbatch-size", "1", "--pp", "1"]
CASES = {  # name: (model, cluster arguments, pins)
    "8b-fsdp": (LLAMA_8B, ["--cluster", "dgx-h100"], ["--dp", "8", "--tp", "1", "--zero", "3", "--recompute", "none"]),
    "8b-fsdp-full": (LLAMA_8B, ["--cluster", "dgx-h100"], ["--dp", "8", "--tp", "1", "--zero", "3", "--recompute", "full"]),
    "8b-fsdp-selective": (LLAMA_8B, ["--cluster", "dgx-h100"],
                          ["--dp", "8", "--tp", "1", "--zero", "3", "--recompute", "selective"]),
    "8b-dp4-tp2-zero1": (LLAMA_8B, ["--cluster", "dgx-h100"], ["--dp", "4", "--tp", "2", "--zero", "1",
                                                                "--recompute", "full"]),
}


def run_case(name: str, folder: Path) -> dict:
    model, cluster, pins = CASES[name]
    plan = folder / f"{name}.plan.json"
    subprocess.run([sys.executable, "-m", "autoshard", "estimate", model, *cluster, "--global-batch", "8",
                    *PINNED, *pins, "-o", str(plan)], cwd=ROOT, check=True, capture_output=True, text=True)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "autoshard", "dryrun", str(plan), "--json"], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode != 0:
        return {"name": name, "error": out.stderr.strip().splitlines()[-1]}
    rank = json.loads(out.stdout)["ranks"][0]
    return {"name": name, "seconds": round(time.perf_counter() - start, 1), **rank}


def table(rows: list[dict]) -> str:
    gib = 2**30
    lines = ["| plan | measured peak | predicted peak | weights | grads | optimizer | activations | transient | "
             "most off | dry run |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['name']} | {row['error']} | | | | | | | | |")
            continue
        parts = row["parts"]
        cells = [f"{m / gib:.1f} / {p / gib:.1f}" for m, p in parts.values()]
        most = max(parts, key=lambda k: abs(parts[k][0] - parts[k][1]))
        off = (row["peak_bytes"] - row["predicted_peak_bytes"]) / row["predicted_peak_bytes"]
        lines.append(f"| {row['name']} | {row['peak_bytes'] / gib:.1f} GiB | {row['predicted_peak_bytes'] / gib:.1f} "
                     f"GiB ({off:+.0%}) | {' | '.join(cells)} | {most} | {row['seconds']} s |")
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
