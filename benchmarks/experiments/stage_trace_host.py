"""A model's forward and backward eager against the same model split by torch's ``pipeline()`` into two traced
stages, run back to back in one process (no ranks, no transfers): what tracing a stage adds to the host's time, and
the aten ops each dispatches.

    python benchmarks/experiments/stage_trace_host.py examples/gpt.py:build h.2
    python benchmarks/experiments/stage_trace_host.py tests/models/hf_llama.py:build_4_layers model.layers.2
    python benchmarks/experiments/stage_trace_host.py tests/models/hf_bert.py:build bert.encoder.layer.1
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter

import torch
from torch.distributed.pipelining import SplitPoint, pipeline
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.runtime.model import build_model, load_model_file

BATCH, WARMUP, CALLS = 4, 5, 40


class CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def median_ms(fn) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def output_tensor(out) -> torch.Tensor:
    out = out.logits if hasattr(out, "logits") else out
    return out[0] if isinstance(out, tuple) else out


def main() -> None:
    spec, split_at = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    model_file = load_model_file(spec)
    model = build_model(model_file, seed=0, device=torch.device("cpu")).eval()  # eval: no dropout draws
    inputs, _ = model_file.example_batch(BATCH)
    pipe = pipeline(model, mb_args=tuple(inputs), split_spec={split_at: SplitPoint.BEGINNING})
    first, second = pipe.get_stage_module(0), pipe.get_stage_module(1)

    def eager() -> None:
        output_tensor(model(*inputs)).float().sum().backward()

    def staged() -> None:
        sent = first(*inputs)
        sent = sent if isinstance(sent, tuple) else (sent,)
        received = [x.detach().requires_grad_(x.requires_grad) for x in sent]
        output_tensor(second(*received)).float().sum().backward()
        pairs = [(x, r.grad) for x, r in zip(sent, received) if x.requires_grad and r.grad is not None]
        torch.autograd.backward([x for x, _ in pairs], [g for _, g in pairs])

    counts = {}
    for name, fn in (("eager", eager), ("staged", staged)):
        with CountOps() as mode:
            fn()
        counts[name] = mode.ops
    nodes = Counter(
        str(n.target)
        for m in (first, second)
        for g in m.modules()
        if hasattr(g, "graph")
        for n in g.graph.nodes
        if n.op == "call_function"
    )
    boundary = first(*inputs)
    print(
        f"{spec}: eager {median_ms(eager):.2f} ms, two traced stages {median_ms(staged):.2f} ms; aten ops dispatched "
        f"(forward and backward) {counts['eager']} eager, {counts['staged']} staged; tensors at the boundary "
        f"{len(boundary) if isinstance(boundary, tuple) else 1}; the stages' most frequent nodes {nodes.most_common(6)}"
    )


if __name__ == "__main__":
    main()
