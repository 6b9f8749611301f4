"""Node groups: Llama-3 8B on 2 DGX H100 + 2 DGX A100 nodes planned as one job, against the groups alone.

    python benchmarks/bench_node_groups.py [--global-batch 256]

Prints, per cluster, the searched plan (and pp pinned to 2 on the groups): mesh, step, tokens/s, and each
stage's group and Llama blocks. Cost-model figures only (preset devices and links, no run): the point is how
the search places the stages, which ``tests/test_node_groups.py`` checks on CPU ranks.
"""

from __future__ import annotations

import argparse
import time

import autoshard

MODEL = "benchmarks/llama3.py:llama3_8b"
GROUPS = "benchmarks/clusters/h100_a100_hetero.yaml"
RUNS = (  # label, cluster, load_cluster's overrides, pins
    ("2 H100 + 2 A100 nodes", GROUPS, {}, {}),
    ("2 H100 + 2 A100, pp 2", GROUPS, {}, {"pp": 2, "schedule": "1f1b"}),
    ("2 H100 + 2 A100, SPMD", GROUPS, {}, {"pp": 1}),
    ("4 A100 nodes", "dgx-a100-80gb", {"nodes": 4}, {}),
    ("4 H100 nodes", "dgx-h100", {"nodes": 4}, {}),
)


def stage_text(plan) -> str:
    """ "h100 12, h100 12, a100 5, a100 3": each stage's group and blocks ("all" where it spans every rank)."""
    out = []
    for s in plan.stages:
        group = plan.stage_group(s.ranks)
        blocks = sum(1 for m in s.modules if ".layers." in m or m.startswith("layers."))
        out.append(f"{group['name'] if group else 'all'} {blocks}")
    return ", ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--global-batch", type=int, default=256)
    args = parser.parse_args()
    print("| cluster | plan | step ms | tokens/s | stages (group blocks) | planning CPU s |")
    print("|---|---|---:|---:|---|---:|")
    for label, cluster, overrides, pins in RUNS:
        cpu = time.process_time()
        plan = autoshard.plan(MODEL, cluster=cluster, global_batch=args.global_batch, **overrides, **pins)
        cpu = time.process_time() - cpu
        p = plan.predicted
        what = f"{plan.mesh} ZeRO-{plan.zero_stage} {plan.schedule}"
        print(
            f"| {label} | {what} | {p.step_time_s * 1e3:,.0f} | {p.tokens_per_s:,.0f} | {stage_text(plan)} | {cpu:.1f} |"
        )


if __name__ == "__main__":
    main()
