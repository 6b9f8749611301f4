"""How far one calibration of this machine moves every plan's price: N calibrations back to back, each plan priced
on each.

    python benchmarks/experiments/calibration_spread.py --ranks 2 --times 4 --runs RUNS.json -o OUT.json

``autoshard calibrate --model`` is run ``--times`` times in a row (nothing else running), and every configuration
``bench_plans.py`` runs is priced on each file. Reported per calibration: the mean signed difference of its
prices from the mean over the calibrations (its level) and the MAPE of its prices against that mean; per plan,
the spread (max − min) / median of its prices. With ``--runs`` (a ``bench_plans.py`` output of the same machine,
model and ranks), also each calibration's MAPE against those measured runs. A model priced from one calibration
cannot be expected to come closer to the runs than one calibration comes to the next.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_plans import calibrate, plan_all  # benchmarks/bench_plans.py, run as a script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="examples/gpt.py:build")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--times", type=int, default=4)
    parser.add_argument("--runs", type=Path, help="a bench_plans.py output to compare each calibration's prices with")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    files = []
    for i in range(args.times):  # back to back first: pricing in between would put other work between them
        files.append(calibrate(args.ranks, args.model, args.output.with_suffix(f".cal{i}.yaml")))
        print(f"calibration {i + 1}/{args.times} at {time.strftime('%H:%M:%S')}: {files[-1]}", flush=True)
    prices = []
    for path in files:
        plans, _ = plan_all(args.model, path, args.ranks, args.global_batch)
        prices.append({key: plan.predicted.step_time_s for key, plan in plans})
    keys = sorted(set.intersection(*(set(p) for p in prices)))
    mean = {k: statistics.fmean(p[k] for p in prices) for k in keys}
    measured = {}
    if args.runs:
        measured = {r["key"]: r["measured_s"] for r in json.loads(args.runs.read_text())["rows"]}
    result = {
        "model": args.model,
        "ranks": args.ranks,
        "calibrations": [str(f) for f in files],
        "cluster_files": [Path(f).read_text() for f in files],
        "prices_s": prices,
        "per_calibration": [_against(p, mean, measured, keys) for p in prices],
        "plan_spread_mean": statistics.fmean(
            (max(p[k] for p in prices) - min(p[k] for p in prices)) / statistics.median(p[k] for p in prices)
            for k in keys
        ),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    args.output.write_text(json.dumps(result, indent=1))
    for i, row in enumerate(result["per_calibration"]):
        print(f"calibration {i + 1}: {row}")
    print(f"{len(keys)} plans: mean spread of a plan's price over the calibrations {result['plan_spread_mean']:.1%}")


def _against(prices: dict, mean: dict, measured: dict, keys: list[str]) -> dict:
    """A calibration's level and MAPE against the calibrations' mean, and its MAPE against the measured runs."""
    signed = [prices[k] / mean[k] - 1 for k in keys]
    row = {"level_vs_mean": statistics.fmean(signed), "mape_vs_mean": statistics.fmean(map(abs, signed))}
    ran = [k for k in keys if k in measured]
    if ran:
        row["mape_vs_runs"] = statistics.fmean(abs(prices[k] / measured[k] - 1) for k in ran)
    return row


if __name__ == "__main__":
    main()
