"""Two checkouts' whole `autoshard plan` command on the four planner-speed targets, run alternately.

    git worktree add /tmp/base <commit>
    python benchmarks/planner_speed_ab.py /tmp/base . 3 benchmarks/results/planner-speed/ab-<date>.json

Per target: each checkout plans once to fill its own capture cache, then REPEATS times, alternating the two
checkouts, a cold plan (``--no-cache``) and a cached one; the medians are printed and written with every
time. Alternating keeps a drifting machine from favouring either side (a single checkout's figures:
``bench_planner_speed.py --targets``). Each checkout runs its own code: ``-m autoshard.cli`` in its directory.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_planner_speed import TARGETS  # (spec, cluster preset, GPUs, batch, target s)


def plan_s(tree: str, spec: str, cluster: str, gpus: int, batch: int, work: str, cold: bool) -> float:
    """Wall time of one ``autoshard plan`` of ``tree``'s code, its capture cache in ``work``."""
    command = [
        sys.executable, "-m", "autoshard.cli", "plan", spec, "--cluster", cluster, "--nodes", str(max(1, gpus // 8)),
        "--global-batch", str(batch), "-o", f"{work}/p.json", *(["--no-cache"] if cold else []),
    ]  # fmt: skip
    env = dict(os.environ, AUTOSHARD_CACHE_DIR=f"{work}/cache")
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-1000:]
    return time.perf_counter() - start


def main() -> None:
    trees, repeats, output = {"base": sys.argv[1], "new": sys.argv[2]}, int(sys.argv[3]), sys.argv[4]
    rows = {}
    for spec, cluster, gpus, batch, target_s in TARGETS:
        times: dict[tuple[str, str], list[float]] = {(k, m): [] for k in trees for m in ("cold", "cached")}
        with tempfile.TemporaryDirectory() as tmp:
            for k, tree in trees.items():
                os.makedirs(f"{tmp}/{k}")
                plan_s(tree, spec, cluster, gpus, batch, f"{tmp}/{k}", False)  # fills its capture cache
            for _ in range(repeats):
                for mode in ("cold", "cached"):
                    for k, tree in trees.items():
                        times[(k, mode)].append(plan_s(tree, spec, cluster, gpus, batch, f"{tmp}/{k}", mode == "cold"))
        row: dict = {f"{k}_{m}_s": [round(t, 2) for t in v] for (k, m), v in times.items()}
        row |= {f"{k}_{m}_median_s": round(statistics.median(v), 2) for (k, m), v in times.items()}
        rows[f"{spec} on {gpus}"] = row | {"target_s": target_s}
        print(spec, gpus, {k: v for k, v in row.items() if "median" in k}, flush=True)
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    with open(output, "w") as f:
        json.dump({"command": " ".join(sys.argv), "when_utc": when, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
