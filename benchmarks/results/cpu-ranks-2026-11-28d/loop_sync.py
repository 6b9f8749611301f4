"""The step loop of calibrate's model profile (``model_probes._step_ops``) with and without the loss's all-reduce over
every rank: "whole" (the program's step, the loss's mean over the world), "alone" (the same step, the loss read on its
own rank) against "parts" (forward + backward and optimizer.step()), each timed as calibrate times them
(``_Bench._time_probe``), three rounds.

Run from the repository root: OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 \
    benchmarks/results/cpu-ranks-2026-11-28d/loop_sync.py B   (B the micro-batch size). Output: loop_sync.out.txt."""

import contextlib
import sys

import torch
import torch.distributed as dist

from autoshard.calibrate import Settings, _Bench
from autoshard.model_probes import _step_ops
from autoshard.runtime.model import build_model, load_model_file

torch.set_num_threads(1)
dist.init_process_group("gloo")
dev = torch.device("cpu")
bench = _Bench(dev, Settings.for_backend("gloo", False), lambda n: None)
mf = load_model_file("examples/gpt.py:build")
b = int(sys.argv[1])
model = build_model(mf, seed=0, device=dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
batch = mf.example_batch(b)
parts, whole, whole_nosync = _step_ops(mf, model, opt, batch, contextlib.nullcontext(), dev)
for _ in range(3):
    p = bench._time_probe(parts)
    w = bench._time_probe(whole)
    u = bench._time_probe(whole_nosync)
    if dist.get_rank() == 0:
        print(
            f"b{b} parts {p * 1e3:.1f} whole {w * 1e3:.1f} (loop {1e3 * (w - p):.1f}) unsynced whole {u * 1e3:.1f} (loop {1e3 * (u - p):.1f})",
            flush=True,
        )
dist.destroy_process_group()
