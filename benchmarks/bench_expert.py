"""The planner against Megatron-LM's hand-tuned configurations, under one cost model.

    python benchmarks/bench_expert.py            # every row of SC21 Table 1 (1.7B ... 1T, 32 ... 3072 A100s)

For each published row (``bench_megatron.ROWS``, sources ``numbers`` and ``sc21``: Narayanan et
al. SC21 Table 1), on ``dgx-a100-80gb`` with GPUs / 8 nodes and the row's global batch:

- **published**: the row's configuration (tp, pp, dp, micro-batch, full recompute, 1F1B or
  interleaved with Megatron's v, DDP) priced by autoshard's cost model for autoshard's own
  programs (``Runtime.for_cluster``: bf16 autocast, flash attention), the layers split evenly
  as Megatron splits them, and with the stage cuts autoshard would choose for it;
- **planner**: ``autoshard plan`` with nothing pinned (``pipeline.plan_graph``).

Reported per row: both step times, planner / published (≤ 1 is the target: the planner finds
a plan at least as fast as the experts' under the same cost model), whether each fits in
80 GB, the planner's tp (≤ 8: inside a DGX node) and its search time.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_megatron import CLUSTER, MODEL_FILE, ROWS, capture  # noqa: E402

from autoshard.cost.hardware import load_cluster  # noqa: E402
from autoshard.cost.step import price  # noqa: E402
from autoshard.cost.tables import CostTables  # noqa: E402
from autoshard.modelfile import load_model_file  # noqa: E402
from autoshard.passes.search import price_config  # noqa: E402
from autoshard.passes.tp_layout import hand_tp_layout  # noqa: E402
from autoshard.pipeline import PlanRequest, plan_graph  # noqa: E402

TABLE_1 = tuple(r for r in ROWS if r.source in ("numbers", "sc21"))


def published(row, graph, cluster):
    """(step seconds, fits) of the row's own configuration: Megatron's even cuts, and autoshard's cuts."""
    tables = CostTables(graph, cluster)
    hand_tp_layout(tables, row.config())
    even = price(graph, cluster, row.config(), row.global_batch, tables, row.cuts())
    chosen = price_config(graph, cluster, replace(row.config(), ddp_bucket_cap_mb=25.0), row.global_batch, tables)
    fits = even.memory_peak_bytes_per_rank <= cluster.device.memory_bytes
    return even, chosen.predicted, fits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", help="row names (default: all of Table 1)")
    args = parser.parse_args()
    rows = [r for r in TABLE_1 if not args.rows or r.name in args.rows]
    print(f"{'row':>7} {'GPUs':>5} | {'published tp·pp·dp b v':<24} {'s (even)':>9} {'s (cuts)':>9} fits | "
          f"{'planner tp·pp·dp z b r sched':<38} {'s':>8} fits | ratio | search s")
    worst = 0.0
    for row in rows:
        cluster = load_cluster(CLUSTER, nodes=max(1, row.gpus // 8))
        graph = capture(row)
        spec = f"{MODEL_FILE}:{row.factory}"
        even, cut, fits = published(row, graph, cluster)
        start = time.perf_counter()
        plan = plan_graph(PlanRequest(spec, cluster, row.global_batch), load_model_file(spec), graph)
        search_s = time.perf_counter() - start
        reference = min(even.step_time_s, cut.step_time_s)
        ratio = plan.predicted.step_time_s / reference
        worst = max(worst, ratio)
        m = plan.mesh
        ours = f"{m.tp}·{m.pp}·{m.dp} z{plan.zero_stage} b{plan.microbatch_size} {plan.recompute} {plan.schedule}"
        ours_fits = plan.predicted.memory_peak_bytes_per_rank <= cluster.device.memory_bytes
        print(f"{row.name:>7} {row.gpus:>5} | {row.tp}·{row.pp}·{row.dp} b{row.micro_batch} v{row.virtual_stages}"
              f"{'':<10} {even.step_time_s:9.2f} {cut.step_time_s:9.2f} {'yes' if fits else 'NO ':>4} | "
              f"{ours:<38} {plan.predicted.step_time_s:8.2f} {'yes' if ours_fits else 'NO':>4} | {ratio:5.3f} | "
              f"{search_s:6.1f}  tp inside a node: {m.tp <= cluster.devices_per_node}", flush=True)
    print(f"worst planner / published: {worst:.3f} over {len(rows)} rows")


if __name__ == "__main__":
    main()
