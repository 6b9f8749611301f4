"""Where one GPU step's device time goes, op by op: what the eager cost model's prices are checked against.

``python benchmarks/gpu_kernels.py OUT.json [--model M] [--microbatch B] [--global-batch G]`` trains the
hand-written loop of ``benchmarks/gpu_session.py`` (bf16 autocast, fp32 AdamW, gradient accumulation;
the emitted program runs the same kernels within 1 %) for two warm-up steps, then two steps under
``torch.profiler``, and writes:

- ``step_s``: wall time per profiled step; ``busy_s``: the union of the step's kernel intervals (so
  ``1 − busy/step`` is the device's idle share: host-bound gaps);
- ``ops``: per aten op and input shapes, its own device time per step and calls per step (from
  ``key_averages(group_by_input_shape=True)``), largest first;
- ``kernels``: per kernel name, device time per step, largest first.

``--predict CLUSTER OUT.json`` (no GPU needed) prices the same model, micro-batch and device with the
eager cost model op by op (``cost.units.node_forward_s`` / ``node_backward_s``) and groups the
measured and predicted device times by the same classes (matmul, attention, loss, optimizer, other),
so a bias in the step time is pinned to a kind of kernel before any constant is touched.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODEL = "benchmarks/llama3.py:llama3_1b"
# aten ops (the profiler's names) by the class the cost model prices them as
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")
ATTENTION_OPS = (
    "aten::_flash_attention",
    "aten::_efficient_attention",
    "aten::_scaled_dot_product_flash",
    "aten::_scaled_dot_product_efficient",
    "aten::_scaled_dot_product_cudnn",
    "aten::_cudnn_attention",
)
LOSS_OPS = ("aten::_log_softmax", "aten::nll_loss", "aten::log_softmax", "aten::cross_entropy")
OPTIMIZER_OPS = ("aten::_foreach", "aten::_fused_adam")
COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::clone")  # autocast's casts, layout copies


def op_class(name: str) -> str:
    """matmul, attention, loss, optimizer, copy or other: how the cost model prices an aten op of this name."""
    for cls, prefixes in (
        ("matmul", MATMUL_OPS),
        ("attention", ATTENTION_OPS),
        ("loss", LOSS_OPS),
        ("optimizer", OPTIMIZER_OPS),
        ("copy", COPY_OPS),
    ):
        if name.startswith(prefixes):
            return cls
    return "other"


def _device_us(event, own: bool) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total") if own else ("device_time_total", "cuda_time_total"):
        if hasattr(event, attr):
            return float(getattr(event, attr))
    return 0.0


def _busy_us(events) -> float:
    """The union of the kernels' [start, end) intervals, µs."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def measure(model_spec: str, microbatch: int, global_batch: int, steps: int = 2) -> dict:
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from autoshard.modelfile import load_model_file

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    model_file = load_model_file(model_spec)
    model = model_file.factory().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)
    accumulate = global_batch // microbatch
    batches = [model_file.module.example_batch(microbatch) for _ in range(accumulate)]
    batches = [(tuple(x.to(device) for x in inputs), target.to(device)) for inputs, target in batches]

    def step() -> None:
        for inputs, target in batches:
            with autocast:
                loss = model_file.module.loss_fn(model(*inputs), target) / accumulate
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()

    for _ in range(2):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        step_s = (time.perf_counter() - started) / steps
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    ops = [
        {
            "op": e.key,
            "shapes": str(e.input_shapes),
            "device_ms": _device_us(e, own=True) / 1e3 / steps,
            "calls": e.count / steps,
        }
        for e in prof.key_averages(group_by_input_shape=True)
        if e.key.startswith("aten::")
    ]
    ops = sorted((o for o in ops if o["device_ms"] > 0), key=lambda o: -o["device_ms"])
    by_kernel: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_kernel[e.name] += (e.time_range.end - e.time_range.start) / 1e3 / steps
    return {
        "model": model_spec,
        "microbatch_size": microbatch,
        "global_batch": global_batch,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "step_s": step_s,
        "busy_s": _busy_us(kernels) / 1e6 / steps,
        "kernel_count": len(kernels) / steps,
        "ops": ops,
        "kernels": sorted(({"kernel": k, "device_ms": v} for k, v in by_kernel.items()), key=lambda k: -k["device_ms"])[
            :60
        ],
    }


def measured_by_class(measured: dict) -> dict[str, float]:
    """Own device seconds per step by op class (every aten op's own time, so nothing is counted twice)."""
    out: dict[str, float] = defaultdict(float)
    for op in measured["ops"]:
        out[op_class(op["op"])] += op["device_ms"] / 1e3
    return dict(out)


def predicted_by_class(model_spec: str, microbatch: int, global_batch: int, cluster: str) -> dict[str, float]:
    """The eager cost model's device seconds per step by the same classes (DDP under bf16 autocast, as the
    hand-written loop runs): every captured op's forward and backward, autocast's casts apart ("copy"), the
    fp32 loss (its upcast counted as "copy", as the profiler files it) and AdamW's foreach step."""
    from autoshard.cost import eager
    from autoshard.cost.autocast import autocast_traffic
    from autoshard.cost.compute import SDPA_TARGET, casts_s, op_backward_s, op_forward_s, weight_bytes_per_node
    from autoshard.cost.hardware import load_cluster
    from autoshard.cost.step import price_parts
    from autoshard.cost.tables import CostTables
    from autoshard.cost.units import loss_logits
    from autoshard.ir.decisions import Decisions, Mesh
    from autoshard.pipeline import capture_graph

    _, graph = capture_graph(model_spec)
    device = load_cluster(cluster).device
    scale, accumulate = microbatch / graph.batch_size, global_batch // microbatch
    weights = weight_bytes_per_node(graph)
    out: dict[str, float] = defaultdict(float)
    for node, traffic in zip(graph.nodes, autocast_traffic(graph, "bfloat16", None)):
        w = weights.get(node.name, 0)
        forward = op_forward_s(node, w, scale, device, 0.5, "flash", 4, "eager", traffic)
        backward = op_backward_s(node, w, scale, device, 0.5, forward, "eager", traffic)
        casts = casts_s(traffic, scale, device, backward=False) + casts_s(traffic, scale, device, backward=True)
        cls = (
            "matmul"
            if node.target.startswith(eager.MATMUL_2D_TARGETS + eager.MATMUL_BATCHED_TARGETS)
            else "attention"
            if node.target.startswith(SDPA_TARGET)
            else "other"
        )
        out[cls] += (forward + backward - casts) * accumulate
        out["copy"] += casts * accumulate
    logits = loss_logits(graph, microbatch)
    upcast = eager.elementwise_s(eager.LOSS_UPCAST_BYTES_PER_LOGIT * logits, device)
    out["loss"] += (eager.loss_forward_s(logits, device) + eager.loss_backward_s(logits, device) - upcast) * accumulate
    out["copy"] += upcast * accumulate
    # AdamW's step and the gradient accumulation as the planner prices them for this one-rank DDP point
    config = Decisions(
        mesh=Mesh(dp=1), zero_stage=0, microbatch_size=microbatch, num_microbatches=accumulate, recompute="none"
    )
    parts = price_parts(CostTables(graph, load_cluster(cluster)), config)
    out["optimizer"] += parts.optimizer_s
    out["other"] += parts.grad_accumulation_s
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument(
        "--predict",
        metavar="CLUSTER",
        help="price OUT's measured run on this cluster file and print measured beside predicted, by op class",
    )
    args = parser.parse_args(argv)
    if args.predict:
        measured = json.loads(args.out.read_text())
        predicted = predicted_by_class(
            measured["model"], measured["microbatch_size"], measured["global_batch"], args.predict
        )
        got = measured_by_class(measured)
        print(f"step {measured['step_s'] * 1e3:.1f} ms, kernels busy {measured['busy_s'] * 1e3:.1f} ms")
        for cls in sorted(set(got) | set(predicted)) + ["total"]:
            m, p = (
                (got.get(cls, 0.0), predicted.get(cls, 0.0))
                if cls != "total"
                else (sum(got.values()), sum(predicted.values()))
            )
            print(
                f"| {cls} | {m * 1e3:.1f} ms | {p * 1e3:.1f} ms | {(p - m) / m:+.1%} |"
                if m
                else f"| {cls} | - | {p * 1e3:.1f} ms | - |"
            )
        return 0
    result = measure(args.model, args.microbatch, args.global_batch)
    args.out.write_text(json.dumps(result, indent=1))
    print(
        f"step {result['step_s'] * 1e3:.1f} ms, busy {result['busy_s'] * 1e3:.1f} ms, "
        f"{result['kernel_count']:.0f} kernels/step",
        flush=True,
    )
    for op in result["ops"][:25]:
        print(f"{op['device_ms']:9.2f} ms {op['calls']:6.0f}x {op['op']} {op['shapes'][:120]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
