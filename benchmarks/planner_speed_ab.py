"""Two checkouts' whole `autoshard plan` command on the four planner-speed targets, run alternately.

    git worktree add /tmp/base <commit>
    python benchmarks/planner_speed_ab.py /tmp/base . 3 benchmarks/results/planner-speed/ab-<date>.json

Per target: each checkout plans once to fill its own capture cache, then REPEATS times, alternating the two
checkouts, a cold plan (``--no-cache``) and a cached one; the medians are printed and written with every
time. Alternating keeps a drifting machine from favouring either side (a single checkout's figures:
``bench_planner_speed.py --targets``). Each checkout runs its own code: ``-m autoshard.cli`` in its directory.
"""

import json, os, statistics, subprocess, sys, tempfile, time

TARGETS = (
    ("benchmarks/models.py:llama3_8b_shape", "dgx-a100-80gb", 64, 512, 3.0),
    ("benchmarks/models.py:gpt3_175b", "dgx-a100-80gb", 1024, 2048, 5.0),
    ("benchmarks/llama3.py:llama3_405b", "dgx-h100", 16384, 2048, 10.0),
    ("benchmarks/deepseek_v3.py:build", "dgx-h100", 2048, 4096, 15.0),
)
TREES = {"base": sys.argv[1], "new": sys.argv[2]}
REPEATS = int(sys.argv[3])


def run(tree, spec, cluster, gpus, batch, cache, cold):
    cmd = [
        sys.executable,
        "-m",
        "autoshard.cli",
        "plan",
        spec,
        "--cluster",
        cluster,
        "--nodes",
        str(max(1, gpus // 8)),
        "--global-batch",
        str(batch),
        "-o",
        f"{cache}/p.json",
    ] + (["--no-cache"] if cold else [])
    env = dict(os.environ, AUTOSHARD_CACHE_DIR=f"{cache}/cache")
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t
    assert p.returncode == 0, p.stderr[-1000:]
    return dt


rows = {}
for spec, cluster, gpus, batch, target in TARGETS:
    times = {(k, m): [] for k in TREES for m in ("cold", "cached")}
    with tempfile.TemporaryDirectory() as tmp:
        for k in TREES:
            os.makedirs(f"{tmp}/{k}")
            run(TREES[k], spec, cluster, gpus, batch, f"{tmp}/{k}", False)  # fill the cache
        for r in range(REPEATS):
            for k in TREES:
                times[(k, "cold")].append(run(TREES[k], spec, cluster, gpus, batch, f"{tmp}/{k}", True))
            for k in TREES:
                times[(k, "cached")].append(run(TREES[k], spec, cluster, gpus, batch, f"{tmp}/{k}", False))
    row = {f"{k}_{m}_s": [round(x, 2) for x in v] for (k, m), v in times.items()}
    row |= {f"{k}_{m}_median_s": round(statistics.median(v), 2) for (k, m), v in times.items()}
    row["target_s"] = target
    rows[f"{spec} on {gpus}"] = row
    print(spec, gpus, {k: v for k, v in row.items() if "median" in k}, flush=True)
out = {"command": " ".join(sys.argv), "when_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "rows": rows}
open(sys.argv[4], "w").write(json.dumps(out, indent=1))
