"""What the tables a pipeline boundary carries beside the residual stream cost on gloo: one boundary's forward as
torch's stage posts it (``dist.batch_isend_irecv``, one P2P op per tensor), with 0, 1 and 3 small tables beside an
8 KiB residual, ranks paired (0→1, 2→3, ...) and all pairs at once. Median of 250 boundaries (after 50), 3 rounds.

    torchrun --nproc-per-node 4 benchmarks/experiments/p2p_tables.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

ROUNDS, BOUNDARIES, WARMUP = 3, 300, 50


def boundary(rank: int, tensors: list[torch.Tensor]) -> None:
    """Even ranks send, odd ranks receive, each tensor a P2P op of its own, posted as one batch."""
    op = dist.isend if rank % 2 == 0 else dist.irecv
    for work in dist.batch_isend_irecv([dist.P2POp(op, t, rank ^ 1) for t in tensors]):
        work.wait()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    medians_us: dict[int, list[float]] = {}
    for _ in range(ROUNDS):
        for count in (1, 2, 4):  # the residual and count - 1 tables
            tensors = [torch.zeros(2, 16, 64)] + [torch.zeros(1, 16, 32) for _ in range(count - 1)]
            times = []
            for _ in range(BOUNDARIES):
                dist.barrier()
                start = time.perf_counter()
                boundary(rank, tensors)
                times.append(time.perf_counter() - start)
            medians_us.setdefault(count, []).append(statistics.median(times[WARMUP:]) * 1e6)
    if rank == 1:
        for count, values in medians_us.items():
            print(f"{count} tensors: median µs per boundary, per round: {[round(v) for v in values]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
