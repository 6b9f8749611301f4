"""How a figure of ranks that share cores is best summarised: N gloo ranks time the example GPT's parts as
``autoshard calibrate`` does (each rank its calls back to back after one barrier), and the script prints three
statistics of the same calls beside a step that syncs every call:

    median over calls of the slowest rank (calibrate before 2026-11-28), the slowest rank's median, the median of all

    python benchmarks/results/cpu-ranks-2026-11-28b/rank_statistics.py RANKS MICROBATCH [--ddp] [--lockstep]

``--lockstep`` puts a barrier before every call; ``--ddp`` adds the same model under DDP and an all-reduce of its
gradients' size. Run on 2026-11-28, 4 ranks, b 2 (RESULTS: "Ranks sharing cores")."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, for examples.gpt
CALLS, ROUNDS = 30, 3


def timed(op, calls: int, lockstep: bool) -> list[float]:
    op()
    dist.barrier()
    times = []
    for _ in range(calls):
        if lockstep:
            dist.barrier()
        started = time.perf_counter()
        op()
        times.append(time.perf_counter() - started)
    return times


def worker(rank: int, ranks: int, microbatch: int, ddp: bool, lockstep: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    import examples.gpt as gpt

    torch.manual_seed(0)
    model = gpt.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = gpt.example_batch(microbatch)
    flag = torch.zeros(1)

    def fwd_bwd():
        gpt.loss_fn(model(*inputs), targets).backward()

    def step():
        fwd_bwd()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def synced_step():
        step()
        dist.all_reduce(flag)

    ops = {"fwd_bwd": fwd_bwd, "adamw": optimizer.step, "step": step, "synced_step": synced_step}
    if ddp:
        wrapped = torch.nn.parallel.DistributedDataParallel(gpt.build(), bucket_cap_mb=25)
        grads = torch.zeros(sum(p.numel() for p in model.parameters()))
        ops["fwd_bwd_ddp"] = lambda: gpt.loss_fn(wrapped(*inputs), targets).backward()
        ops["allreduce_grads"] = lambda: dist.all_reduce(grads)
    fwd_bwd()  # gradients exist before the optimizer is timed alone
    rows: dict[str, list[torch.Tensor]] = {}
    for _ in range(ROUNDS):
        for name, op in ops.items():
            mine = torch.tensor(timed(op, CALLS, lockstep), dtype=torch.float64)
            every = [torch.zeros_like(mine) for _ in range(ranks)]
            dist.all_gather(every, mine)
            rows.setdefault(name, []).append(torch.stack(every))  # ranks × calls
    if rank == 0:
        for name in ops:
            calls = torch.cat(rows[name], 1)
            slowest = calls.max(0).values.median().item()
            own = calls.median(1).values.max().item()
            every = calls.flatten().median().item()
            print(
                f"{name:16s} slowest rank per call {slowest * 1e3:7.2f}  slowest rank's median {own * 1e3:7.2f}  "
                f"median of all {every * 1e3:7.2f} ms"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    ranks, microbatch = int(sys.argv[1]), int(sys.argv[2])
    mp.spawn(worker, args=(ranks, microbatch, "--ddp" in sys.argv, "--lockstep" in sys.argv), nprocs=ranks)
