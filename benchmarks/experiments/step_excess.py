"""The program's step against its parts timed back to back, at m = 1 and m = 4 micro-batches of 1 sample.

    torchrun --standalone --nproc-per-node 2 benchmarks/experiments/step_excess.py

Does what a step costs beyond forward + backward and the optimizer (``model_probes._step_ops``) grow with the
micro-batches (a cost per micro-batch) or not (per step, as ``cost.parts.step_loop_s`` prices it)? Each rank runs
the GPT example alone (no DDP), four rounds, each timing both ops at both m; prints each round and the medians of
the excess (the slowest rank's times).
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch
import torch.distributed as dist

from autoshard.runtime.data import global_batch, split_microbatches, take_shard
from autoshard.runtime.distributed import mean_over
from autoshard.runtime.model import build_model, load_model_file
from autoshard.runtime.recipe import Recipe, build_scheduler

MICROBATCH_SIZE = 1
ROUNDS = 4
CALLS = 30


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model_file = load_model_file("examples/gpt.py:build")
    model = build_model(model_file, seed=0, device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = build_scheduler(optimizer, Recipe())
    rank, ranks = dist.get_rank(), dist.get_world_size()
    inputs, targets = model_file.example_batch(MICROBATCH_SIZE)
    steps = itertools.count(1)

    def parts(m: int):
        def op() -> None:
            for _ in range(m):
                model_file.loss(model(*inputs), targets).backward()
            optimizer.step()

        return op

    def whole(m: int):
        def op() -> None:
            batch = global_batch(model_file, MICROBATCH_SIZE * m * ranks, 0, next(steps))
            total = torch.zeros(())
            for micro_inputs, micro_targets in split_microbatches(*take_shard(batch, rank, ranks, "cpu"), m):
                loss = model_file.loss(model(*micro_inputs), micro_targets) / m
                loss.backward()
                total += loss.detach()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            mean_over(total, None)

        return op

    def time_ms(op) -> float:
        times = []
        for _ in range(CALLS):
            dist.barrier()
            start = time.perf_counter()
            op()
            times.append(time.perf_counter() - start)
        slowest = torch.tensor(times)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return statistics.median(slowest.tolist()) * 1e3

    excess: dict[int, list[float]] = {1: [], 4: []}
    for r in range(ROUNDS):
        for m in excess:
            t_parts, t_whole = time_ms(parts(m)), time_ms(whole(m))
            excess[m].append(t_whole - t_parts)
            if rank == 0:
                print(f"round {r} m={m} parts {t_parts:.2f} whole {t_whole:.2f} ms, excess {t_whole - t_parts:.2f}")
    if rank == 0:
        print("median excess, ms:", {m: round(statistics.median(v), 2) for m, v in excess.items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
