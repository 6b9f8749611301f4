"""What one dry-run rank holds at its peak, op by op, beside what the cost model keeps per block.

``python benchmarks/experiments/memory_timeline.py PLAN.json [-o OUT.json]`` runs ``autoshard dryrun``'s rank 0
with torch's ``MemTracker`` extended to remember, for every storage it counts, the op that made it and the
modules running then. At the rank's peak it lists the live storages by part, grouped by (block, op, shape,
dtype); beside them, the cost model's saved tensors of each block (``cost.saved`` on the plan's TP share, at the
plan's micro-batch and precision): what each block keeps for its backward under no recompute, and what the plan's
recompute mode keeps of it. It also writes the per-op timeline of the rank's total and activations over the
first step's forward and backward.

An investigation, not a harness: its output is read by a person (benchmarks/RESULTS.md, "Dry run").
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

GIB = 2**30


def tracing_tracker():
    """``dryrun._peak_tracker``'s class, remembering the op and modules that made each storage."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    from autoshard import dryrun

    base = type(dryrun._peak_tracker())

    class TracingTracker(base):
        def __init__(self):
            super().__init__()
            self.origin = {}  # id(winfo) -> (op, module, shape, dtype)
            self.peak_live: list[tuple] = []
            self.timeline: list[tuple] = []
            self._op = "?"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self._op = str(func.overloadpacket.__name__)
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _track(self, reftype, t):
            super()._track(reftype, t)
            from torch.distributed._tools.common_utils import get_untyped_storages

            for st in get_untyped_storages(t):
                winfo, _ = self._WINFO.get(st, (None, None))
                if winfo is not None and id(winfo) not in self.origin:
                    parents = sorted(p for p in self._mod_tracker.parents if p != "Global")
                    module = max(parents, key=len) if parents else "-"
                    self.origin[id(winfo)] = (self._op, module, tuple(t.shape), str(t.dtype).replace("torch.", ""))

        def _update_peak_stats(self, peak_state) -> None:
            snap = self._curr_mem_snap
            for device, snapshot in snap.items():
                if getattr(device, "type", "") == "meta":
                    continue
                acts = sum(v for k, v in snapshot.items() if getattr(k, "value", k) == "Activation")
                self.timeline.append((self._op, "bw" if self._mod_tracker.is_bw else "fw", snapshot[_TOTAL_KEY], acts))
                if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                    self._peak_mem[device] = snapshot[_TOTAL_KEY]
                    from copy import deepcopy

                    self._peak_mem_snap[device] = deepcopy(snapshot)
                    self.peak_live = self._live(device)

        def _live(self, device) -> list[tuple]:
            out = []
            for winfo, _ in list(self._WINFO.values()):
                if winfo.device != device or winfo.mem_consumed == 0:
                    continue
                op, module, shape, dtype = self.origin.get(id(winfo), ("(made outside)", "-", (), "?"))
                out.append(
                    (getattr(winfo.reftype, "value", str(winfo.reftype)), op, module, shape, dtype, winfo.mem_consumed)
                )
            return out

    return TracingTracker


def block_of(module: str) -> str:
    """'model.layers.3.self_attn.q_proj' -> 'model.layers.*' with the block's own part kept: 'layers.N'."""
    m = re.search(r"(.*?layers\.\d+)", module)
    return m.group(1) if m else module


def dry_run_peak(plan_path: str) -> dict:
    from autoshard import dryrun
    from autoshard.ir.plan import load_plan

    plan = load_plan(plan_path)
    cls = tracing_tracker()
    made = []

    def tracker():
        made.append(cls())
        return made[-1]

    dryrun._peak_tracker = tracker
    result = dryrun.dryrun(plan, [0], steps=1)[0]
    t = made[-1]
    by_group: dict[tuple, int] = defaultdict(int)
    for part, op, module, shape, dtype, nbytes in t.peak_live:
        by_group[(part, block_of(module), op, shape, dtype)] += nbytes
    rows = sorted(by_group.items(), key=lambda kv: -kv[1])
    return {
        "peak_bytes": result.peak_bytes,
        "parts": result.parts,
        "live_at_peak": [
            {"part": k[0], "block": k[1], "op": k[2], "shape": list(k[3]), "dtype": k[4], "bytes": v} for k, v in rows
        ],
        "timeline": t.timeline,
    }


def cost_model_block(plan_path: str, block_index: int = 0) -> dict:
    """The cost model's view of one block of the plan (its decisions re-priced with ``autoshard.api.estimate``):
    what the block keeps without recompute (key -> bytes on this rank at the plan's micro-batch), and what the
    plan's recompute mode keeps (its input and, selective, the policy's outputs)."""
    from autoshard import api
    from autoshard.cost import memory as M
    from autoshard.cost import tables as TB
    from autoshard.cost.tables import CAPTURED_ELEM_BYTES
    from autoshard.ir.plan import load_plan

    plan = load_plan(plan_path)
    seen = {}
    original = TB.CostTables.activation_units

    def spy(self, config, recompute=None):
        seen["tables"], seen["config"] = self, config
        return original(self, config, recompute)

    TB.CostTables.activation_units = spy
    try:
        api.estimate(
            plan.model["spec"],
            cluster=plan.cluster["name"],
            nodes=plan.cluster["nodes"],
            devices_per_node=plan.cluster["devices_per_node"],
            global_batch=plan.global_batch,
            seq_len=plan.model.get("seq_len"),
            dp=plan.mesh.dp,
            tp=plan.mesh.tp,
            pp=plan.mesh.pp,
            zero=plan.zero_stage,
            microbatch_size=plan.microbatch_size,
            recompute=plan.recompute,
            schedule=plan.schedule,
            sequence_parallel="on" if plan.sequence_parallel else "off",
        )
    finally:
        TB.CostTables.activation_units = original
    tables, config = seen["tables"], seen["config"]
    graph, share = tables.graph, tables.rank_share(config)
    ratio = tables.precision.activation_bytes / CAPTURED_ELEM_BYTES
    scale = config.microbatch_size / graph.batch_size
    block = graph.blocks[block_index]
    saved = M._block_saved(graph, block, ratio, share=share)
    kept = M._kept_by_policy(graph, block, "selective", ratio, share) if config.recompute == "selective" else {}

    def described(key: str) -> str:
        name = key.split(":")[0]
        node = graph._by_name().get(name)
        return f"{key} {node.target if node else ''} {tuple(node.shape) if node else ''}"

    return {
        "block": block.path,
        "input_bytes": int(M.block_input_bytes(graph, block, ratio, share) * scale),
        "saved_no_recompute": {described(k): int(v * scale) for k, v in saved.items()},
        "kept_selective": {described(k): int(v * scale) for k, v in kept.items()},
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan")
    parser.add_argument("-o", "--output", default=None)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--cost-model", action="store_true", help="also list the cost model's first block")
    args = parser.parse_args(argv)
    got = dry_run_peak(args.plan)
    print(f"peak {got['peak_bytes'] / GIB:.2f} GiB; parts (measured, predicted) GiB:")
    for part, (m, p) in got["parts"].items():
        print(f"  {part:<12} {m / GIB:7.3f} {p / GIB:7.3f}")
    print(f"live at the peak, largest {args.top} groups:")
    for row in got["live_at_peak"][: args.top]:
        print(
            f"  {row['part']:<10} {row['bytes'] / 2**20:9.1f} MiB  {row['block']:<24} {row['op']:<28} "
            f"{tuple(row['shape'])} {row['dtype']}"
        )
    if args.cost_model:
        got["cost_model"] = cost_model_block(args.plan)
        cm = got["cost_model"]
        print(f"cost model, {cm['block']}: input {cm['input_bytes'] / 2**20:.1f} MiB")
        for title, rows in (
            ("kept without recompute", cm["saved_no_recompute"]),
            ("kept by selective", cm["kept_selective"]),
        ):
            print(f"  {title}: {sum(rows.values()) / 2**20:.1f} MiB")
            for key, nbytes in sorted(rows.items(), key=lambda kv: -kv[1]):
                print(f"    {nbytes / 2**20:9.1f} MiB  {key}")
    if args.output:
        Path(args.output).write_text(json.dumps(got, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
