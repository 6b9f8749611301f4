"""What every hand-written baseline shares: the example GPT, its data, the training loop's timing.

These scripts are what a person writes with plain torch.distributed for one parallel layout,
without autoshard, to measure autoshard's overhead against (``benchmarks/bench_overhead.py``).
Data is drawn as autoshard's programs draw it (the global batch from ``example_batch`` under a
seed per step; each dp rank takes its slice), so both do the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
SEED_STRIDE = 1_000_003


def load_gpt():
    """examples/gpt.py as a module."""
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    import gpt

    return gpt


def args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--splits", help="pipeline: modules that begin stages 1 .. pp-1, e.g. h.2 (default: even)")
    p.add_argument("--tp-styles", help='tensor parallel: JSON {module: style}, e.g. {"h.0.mlp.c_fc": "colwise"}')
    p.add_argument("--out", required=True)
    return p.parse_args()


def init() -> tuple[int, int]:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def build(gpt):
    torch.manual_seed(0)
    return gpt.build()


def batch(gpt, size: int, step: int, index: int, count: int):
    """This rank's slice of the step's global batch."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(step)
        (x,), y = gpt.example_batch(size)
    n = size // count
    return x[index * n : (index + 1) * n], y[index * n : (index + 1) * n]


def train_step(model, opt, gpt, x, y, microbatches: int, no_sync=None) -> torch.Tensor:
    """Forward and backward over the micro-batches (gradients summed: loss / count), one AdamW step;
    ``no_sync``: DDP's context that skips the all-reduce on all but the last micro-batch."""
    import contextlib

    total = torch.zeros(())
    for k, (xs, ys) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches))):
        skip = no_sync is not None and k < microbatches - 1
        with no_sync() if skip else contextlib.nullcontext():
            loss = gpt.loss_fn(model(xs), ys) / microbatches
            loss.backward()
        total += loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def run(step_fn, steps: int, out: str) -> None:
    """Time ``step_fn(step) -> loss`` per step on every rank; rank 0 writes the median (first step skipped)."""
    times = []
    for step in range(steps):
        start = time.perf_counter()
        loss = step_fn(step)
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"median_step_s": statistics.median(times[1:]), "loss": loss}))
    dist.destroy_process_group()


def global_loss(loss: torch.Tensor, group=None) -> float:
    value = loss.detach().clone()
    dist.all_reduce(value, group=group)
    return value.item() / dist.get_world_size(group)
