"""One op timed by four statistics, interleaved, in one process group of ranks that share cores, against how a
training run reads the same op as its step (``runtime.report``: each rank's median step, the slowest rank's).

The op: the calibration's step ("whole", ``model_probes._step_ops``: the program's step of the GPT example at
micro-batch B, ending in the loss's all-reduce over every rank), and its parts (forward + backward and AdamW).
Statistics, each over about 0.3 s of calls:
  call-mean   median over calls of the ranks' mean (calibrate's probes until 2026-11-28)
  block-3     3 blocks after a barrier each, median of the slowest rank's block time per call (``_time_blocks``)
  lockstep    a barrier before each call, median over calls of the slowest rank
  slowest     median over calls of the slowest rank per call, no barrier (calibrate's collectives, ``_time_op``)
  run         calls back to back, each rank's median, the slowest rank's (the run's own statistic)

Run from the repository root: OMP_NUM_THREADS=1 torchrun --nproc-per-node 4
benchmarks/results/cpu-ranks-2026-11-28d/statistics_ab.py B REPEATS. Output: statistics_ab.out.txt."""

import contextlib
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist

from autoshard.model_probes import _step_ops
from autoshard.runtime.model import build_model, load_model_file

BUDGET_S = 0.3


def reduce(values: list[float], op) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def calls_for(op) -> int:
    op()
    t0 = time.perf_counter()
    op()
    warm = reduce([time.perf_counter() - t0], dist.ReduceOp.MAX)[0]
    return max(7, min(200, math.floor(BUDGET_S / warm)))


def per_call(op, n: int, barrier_each: bool) -> list[float]:
    times = []
    dist.barrier()
    for _ in range(n):
        if barrier_each:
            dist.barrier()
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    return times


def call_mean(op, n):
    ranks = dist.get_world_size()
    return statistics.median(x / ranks for x in reduce(per_call(op, n, False), dist.ReduceOp.SUM))


def block_3(op, n):
    per_block = math.ceil(n / 3)
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(per_block):
            op()
        times.append(time.perf_counter() - t0)
    return statistics.median(reduce(times, dist.ReduceOp.MAX)) / per_block


def lockstep(op, n):
    return statistics.median(reduce(per_call(op, n, True), dist.ReduceOp.MAX))


def slowest(op, n):
    return statistics.median(reduce(per_call(op, n, False), dist.ReduceOp.MAX))


def run(op, n):
    return reduce([statistics.median(per_call(op, n, False))], dist.ReduceOp.MAX)[0]


STATISTICS = {"call-mean": call_mean, "block-3": block_3, "lockstep": lockstep, "slowest": slowest, "run": run}


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    b, repeats = int(sys.argv[1]), int(sys.argv[2])
    model_file = load_model_file("examples/gpt.py:build")
    model = build_model(model_file, seed=0, device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = model_file.example_batch(b)
    parts, whole, _ = _step_ops(model_file, model, optimizer, batch, contextlib.nullcontext(), torch.device("cpu"))
    ops = {"whole": whole, "parts": parts}
    ns = {name: calls_for(op) for name, op in ops.items()}
    table = {(o, s): [] for o in ops for s in STATISTICS}
    for _ in range(repeats):
        for o, op in ops.items():
            for s, stat in STATISTICS.items():
                table[(o, s)].append(stat(op, ns[o]) * 1e3)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, b {b}, {repeats} repeats, ms (median [min-max] over repeats)")
        for (o, s), xs in table.items():
            print(f"  {o:6s} {s:10s} {statistics.median(xs):6.1f} [{min(xs):5.1f}-{max(xs):5.1f}]")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
