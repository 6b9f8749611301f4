"""The GPT example's b 8 forward + backward timed two ways on the ranks at once, before and after calibrate's host
probes: as calibrate timed the parts of a step until 2026-11-28 (median over calls of the ranks' mean, a call timed
on each rank) and as a block (a barrier, 10 calls on every rank, the slowest rank's time / 10).

Run from the repository root: torchrun --nproc-per-node 4 benchmarks/results/cpu-ranks-2026-11-28d/block_vs_call.py
(OMP_NUM_THREADS=1, as autoshard run starts CPU ranks). Output: block_vs_call.out.txt."""

import statistics
import sys
import time

import torch
import torch.distributed as dist

from autoshard import host_probes
from autoshard.calibrate import Settings, _Bench
from autoshard.runtime.model import build_model, load_model_file

MICROBATCH = 8
BLOCK_CALLS = 10


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ranks = dist.get_world_size()
    bench = _Bench(torch.device("cpu"), Settings.for_backend("gloo", False), lambda name: None)
    model_file = load_model_file("examples/gpt.py:build")
    model = build_model(model_file, seed=0, device=torch.device("cpu"))
    inputs, targets = model_file.example_batch(MICROBATCH)

    def step() -> None:
        model_file.loss(model(*inputs), targets).backward()

    def per_call_mean() -> float:
        step()
        times = []
        dist.barrier()
        for _ in range(BLOCK_CALLS):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t)
        return statistics.median((t / ranks).tolist())

    def block() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(BLOCK_CALLS):
            step()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item() / BLOCK_CALLS

    def report(label: str) -> None:
        calls = [per_call_mean() for _ in range(3)]
        blocks = [block() for _ in range(3)]
        if dist.get_rank() == 0:
            print(
                f"{ranks} ranks, {label}: median over calls of the ranks' mean",
                [round(x * 1e3, 1) for x in calls],
                "ms; block",
                [round(x * 1e3, 1) for x in blocks],
                "ms",
                flush=True,
            )

    report("fresh")
    host_probes.measure(bench._time_op, ranks)
    report("after the host probes")
    report("again")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
