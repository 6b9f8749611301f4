"""How long an elastic job's re-plan takes (``autoshard run --elastic``): the plan for the ranks left, from the capture
cache, at the same global batch.

    python benchmarks/bench_replan.py [--repeats 3] [-o runs/replan.json]

For each case a plan is made for the full world (which also fills the capture cache, as the job's own plan did),
the planner's imports are loaded (``elastic.warm_planner``, which the job runs while its first launch trains), then
``elastic.plan_for_ranks`` re-plans for the ranks left ``--repeats`` times: wall and process CPU seconds of each.
Cases: the example GPT from 4 CPU ranks to 2 (``local-cpu``), and Llama-3-8B at 8,192 tokens on one dgx-h100 node from
8 GPUs to 6 (global batch 48).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

CASES = (  # name, model, plan keywords, ranks left
    ("gpt 4 -> 2 CPU ranks", "examples/gpt.py:build", dict(cluster="local-cpu", devices_per_node=4, global_batch=8), 2),
    (
        "Llama-3-8B 8k, 8 -> 6 H100s",
        "benchmarks/llama3.py:llama3_8b",
        dict(cluster="dgx-h100", devices_per_node=8, global_batch=48, seq_len=8192),
        6,
    ),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args()
    from autoshard.cli import import_cp_model_without_pandas

    import_cp_model_without_pandas()
    import autoshard
    from autoshard.elastic import ElasticRange, plan_for_ranks, warm_planner

    warm_planner()
    rows = []
    for name, model, keywords, left in CASES:
        plan = autoshard.plan(model, **keywords)
        for _ in range(args.repeats):
            cpu, wall = time.process_time(), time.perf_counter()
            replanned, _ = plan_for_ranks(plan, left, ElasticRange(1, plan.world_size))
            rows.append(
                {
                    "case": name,
                    "world": plan.world_size,
                    "left": replanned.world_size,
                    "wall_s": round(time.perf_counter() - wall, 3),
                    "cpu_s": round(time.process_time() - cpu, 3),
                    "load_1min": round(os.getloadavg()[0], 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
