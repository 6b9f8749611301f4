"""Recompute inside a pipeline stage against the same blocks recomputed on the whole model, in one process.

    python benchmarks/experiments/stage_recompute_cost.py [MODEL] [--microbatch 4]

Splits the model in two (``runtime.pipeline_parallel.split_model``) and times stage 0's forward and backward
(a squared-mean loss on its output) with its blocks recomputed none / selective / full
(``runtime.stage_recompute``); then the whole model's step with the same blocks recomputed by
``checkpoint_wrapper`` (``runtime.parallel.apply_recompute``), which is how ``autoshard calibrate`` measures
recompute. The difference from "none" is each mode's recompute cost in either runtime. One thread, medians of 15.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from autoshard.pipeline import capture_graph
from autoshard.runtime.model import build_model, load_model_file
from autoshard.runtime.parallel import apply_recompute
from autoshard.runtime.pipeline_parallel import split_model
from autoshard.runtime.stage_recompute import apply_recompute_to_stage

MODES = ("none", "selective", "full")


def median_ms(fn, calls: int = 15) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="examples/gpt.py:build")
    parser.add_argument("--microbatch", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_file = load_model_file(args.model)
    model = build_model(model_file, seed=0, device=torch.device("cpu"))
    inputs, targets = model_file.example_batch(args.microbatch)
    blocks = [b.path for b in capture_graph(args.model, use_cache=True, proofs=False)[1].blocks]
    half = blocks[len(blocks) // 2]
    stage0 = split_model(copy.deepcopy(model), inputs, [half]).split_gm.submod_pp_0
    first = blocks[: len(blocks) // 2]
    for mode in MODES:
        stage = copy.deepcopy(stage0)
        if mode != "none":
            apply_recompute_to_stage(stage, {b: mode for b in first})

        def stage_step(stage=stage):
            out = stage(*inputs)
            (out[0] if isinstance(out, (tuple, list)) else out).float().pow(2).mean().backward()

        whole = apply_recompute(copy.deepcopy(model), first, mode)
        print(
            f"{mode:10s} stage 0 ({len(first)} blocks) {median_ms(stage_step):6.1f} ms   "
            f"whole model, the same blocks recomputed {median_ms(lambda m=whole: model_file.loss(m(*inputs), targets).backward()):6.1f} ms"
        )


if __name__ == "__main__":
    main()
