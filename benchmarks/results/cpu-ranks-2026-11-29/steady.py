"""4 ranks on 2 cores, GPT example: a replicated-TP job (tp 4, ranks share no collective) and a dp 4 job, each run
at 16 and at 60 steps, in alternation; each run read two ways: the slowest rank's median over all its timed steps,
and ``runtime.report.steady_step_s`` (only the steps every rank ran alongside the others)."""

import json
import statistics as st
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_plans import measure

from autoshard.cost.hardware import load_cluster
from autoshard.passes.planning.strategies import Pins
from autoshard.pipeline import PlanRequest, capture_graph, plan_graph
from autoshard.runtime.report import WARMUP_STEPS

cl = load_cluster(sys.argv[1], devices_per_node=4)
mf, g = capture_graph("examples/gpt.py:build")
cases = [
    ("tp4 b1", dict(dp=1, tp=4, pp=1, microbatch_size=1, sequence_parallel=False)),
    ("dp4 b1", dict(dp=4, tp=1, pp=1, microbatch_size=1)),
    ("tp4 b8", dict(dp=1, tp=4, pp=1, microbatch_size=8, sequence_parallel=False)),
    ("dp4 b2", dict(dp=4, tp=1, pp=1, microbatch_size=2)),
]
out = []
for rnd in range(int(sys.argv[2])):
    for steps in (16, 60):
        for name, pins in cases:
            plan = plan_graph(
                PlanRequest("examples/gpt.py:build", cl, 8, Pins(zero_stage=0, recompute="none", **pins)), mf, g
            )
            with tempfile.TemporaryDirectory() as d:
                steady, ranks = measure(plan, 4, steps, Path(d))
            slowest = max(st.median(t[WARMUP_STEPS:]) for t, _ in ranks)
            out.append(dict(case=name, steps=steps, round=rnd, slowest_median_s=slowest, steady_s=steady, ranks=ranks))
            print(
                f"round {rnd} {name} {steps:2d} steps: slowest-median {slowest * 1e3:6.1f} ms  steady {steady * 1e3:6.1f} ms",
                flush=True,
            )
Path(sys.argv[3]).write_text(json.dumps(out))
