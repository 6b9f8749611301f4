"""How long `autoshard plan` takes, whole command, against model depth and against cluster size.

    python benchmarks/bench_planner_speed.py -o runs/planner_speed.json --plot benchmarks/planner_speed.png

Each figure is the wall time of one `autoshard plan` process (Python start, imports, capture on
meta, search, plan written), the median of ``--repeats``: cold (``--no-cache``, the model captured
every time) and, for the three headline models, warm (planned again with the capture cache filled,
``passes.capturing.capture_cache``). Depth: the GPT block at width 4096
(``benchmarks/models.py:gpt_l{L}_d4096``) on 64 A100s. Size: GPT-3 175B and the Llama-3-8B shape
on 8 … 4096 A100s (``dgx-a100-80gb``, 8 per node).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "benchmarks" / "models.py"
DEPTHS = (8, 16, 32, 64, 128)
GPUS = (8, 64, 512, 4096)
HEADLINE = (("llama3_8b_shape", 64, 512), ("gpt3_175b", 1024, 2048), ("gpt_1t", 3072, 3072))  # model, GPUs, batch
# ``--targets``: the whole ``plan`` command, cold, against its target (spec, cluster preset, GPUs, batch, seconds)
TARGETS = (
    ("benchmarks/models.py:llama3_8b_shape", "dgx-a100-80gb", 64, 512, 3.0),
    ("benchmarks/models.py:gpt3_175b", "dgx-a100-80gb", 1024, 2048, 5.0),
    ("benchmarks/llama3.py:llama3_405b", "dgx-h100", 16384, 2048, 10.0),
    ("benchmarks/deepseek_v3.py:build", "dgx-h100", 2048, 4096, 15.0),
)


def plan_s(
    model: str, gpus: int, batch: int, repeats: int, warm: bool = False, cluster: str = "dgx-a100-80gb"
) -> float:
    """Median wall time of ``autoshard plan``: cold (``--no-cache``: capture every time) or warm (the
    capture cache filled by one run before the timed ones, as when a user plans the model again). ``model``
    is a builder of benchmarks/models.py or a whole spec."""
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, AUTOSHARD_CACHE_DIR=f"{tmp}/cache")
        command = [
            sys.executable,
            "-m",
            "autoshard.cli",
            "plan",
            model if ":" in model else f"{MODELS}:{model}",
            "--cluster",
            cluster,
            "--nodes",
            str(max(1, gpus // 8)),
            "--global-batch",
            str(batch),
            "-o",
            f"{tmp}/p.json",
        ]
        if warm:
            _plan(command, env)
        else:
            command.append("--no-cache")
        for _ in range(repeats):
            start = time.perf_counter()
            _plan(command, env)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _plan(command: list[str], env: dict[str, str]) -> None:
    """One ``autoshard plan``; exit 2 "no plan fits" (175B on 8 GPUs) is a finished plan command too."""
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode not in (0, 2) or (proc.returncode == 2 and "no plan fits" not in proc.stderr):
        raise RuntimeError(proc.stderr[-2000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("-o", "--output")
    parser.add_argument("--plot", help="write a PNG (needs matplotlib: pip install -e .[bench])")
    parser.add_argument("--replot", metavar="JSON", help="only plot the figures of an earlier -o file")
    parser.add_argument("--targets", action="store_true", help="only the four targets (TARGETS), cold and cached")
    a = parser.parse_args()
    if a.targets:
        rows = {}
        for spec, cluster, gpus, batch, target_s in TARGETS:
            cold = plan_s(spec, gpus, batch, a.repeats, cluster=cluster)
            warm = plan_s(spec, gpus, batch, a.repeats, warm=True, cluster=cluster)
            rows[f"{spec} on {gpus}"] = {"cold_s": cold, "warm_s": warm, "target_s": target_s}
            met = "met" if cold <= target_s else "NOT met"
            print(f"{spec} on {gpus} {cluster}: cold {cold:6.2f} s, cached {warm:6.2f} s (target {target_s} s, {met})")
        if a.output:
            Path(a.output).write_text(json.dumps({"targets": rows}, indent=1))
        return
    if a.replot:
        data = json.loads(Path(a.replot).read_text())
        as_int = lambda d: {int(k): v for k, v in d.items()}  # noqa: E731 (JSON keys are strings)
        plot(as_int(data["depth_64_gpus"]), {n: as_int(r) for n, r in data["gpus"].items()}, a.plot)
        return
    depth = {L: plan_s(f"gpt_l{L}_d4096", 64, 512, a.repeats) for L in DEPTHS}
    for L, s in depth.items():
        print(f"depth {L:>4} layers, 64 GPUs: {s:6.2f} s", flush=True)
    size = {
        name: {g: plan_s(name, g, max(512, 2 * g), a.repeats) for g in GPUS}
        for name in ("llama3_8b_shape", "gpt3_175b")
    }
    for name, row in size.items():
        for g, s in row.items():
            print(f"{name:>16} on {g:>5} GPUs: {s:6.2f} s", flush=True)
    headline = {
        f"{name} on {g}": {
            "cold_s": plan_s(name, g, batch, a.repeats),
            "warm_s": plan_s(name, g, batch, a.repeats, warm=True),
        }
        for name, g, batch in HEADLINE
    }
    for key, row in headline.items():
        print(f"{key:>26} GPUs: cold {row['cold_s']:6.2f} s, capture cached {row['warm_s']:6.2f} s", flush=True)
    if a.output:
        Path(a.output).write_text(json.dumps({"depth_64_gpus": depth, "gpus": size, "headline": headline}, indent=1))
    if a.plot:
        plot(depth, size, a.plot)


def plot(depth: dict, size: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(list(depth), list(depth.values()), "o-")
    left.set(
        xlabel="layers (width 4096, 64 A100s)", ylabel="autoshard plan, whole command (s)", xscale="log", ylim=(0, None)
    )
    for name, row in size.items():
        right.plot(list(row), list(row.values()), "o-", label=name)
    right.set(xlabel="A100 GPUs", ylabel="autoshard plan, whole command (s)", xscale="log", ylim=(0, None))
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
