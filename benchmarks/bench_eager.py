"""Price eager FSDP2 Llama-3-8B on dgx-h100 (uncalibrated) part by part, through the CLI.

    python benchmarks/bench_eager.py            # 8 and 128 GPUs (1 and 16 nodes)
    python benchmarks/bench_eager.py --gpus 8

The model is ``benchmarks/llama3.py:llama3_8b`` (Llama-3-8B's shape: 32 layers, d 4096, 32 heads
with 8 KV heads, SwiGLU FFN 14336, vocab 128256, seq 8192), captured on meta. Each configuration is
priced by ``autoshard estimate ... --json`` (the command is printed): dp = GPUs, tp = pp = 1, ZeRO-3
(FSDP2, resharded after forward), micro-batch 2, selective recompute, global batch = 2 × GPUs, on the
``dgx-h100`` preset with ``--nodes`` = GPUs / 8 and no calibration. The runtime is autoshard's
(``Runtime.named("autoshard")``: eager PyTorch, bf16 autocast with fp32 master weights, torch SDPA,
foreach AdamW; ``cost.eager``).

The same step is then taken apart with the cost model's own functions (the parts add up to the
CLI's step time; the script checks it): forward / backward / recompute by kind of kernel (matmul,
attention, elementwise, the fp32 loss), the kernel-launch overhead inside them (host dispatch not
hidden by the device, and the kernels' fixed device time), optimizer, FSDP all-gather and
reduce-scatter (total and exposed); and the peak memory per GPU by part. Every constant is listed
with its source (``cost.eager``, ``cost.hardware``). Nothing here was measured on a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autoshard.cost import eager  # noqa: E402
from autoshard.cost.compute import CONVOLUTION_TARGETS, SDPA_TARGET  # noqa: E402
from autoshard.cost.dp_comm import per_unit_collectives_s, shard_mesh  # noqa: E402
from autoshard.cost.hardware import load_cluster  # noqa: E402
from autoshard.cost.memory import COMPUTE_HEAVY_TARGETS  # noqa: E402
from autoshard.cost.parts import predicted  # noqa: E402
from autoshard.cost.rank_memory import ALLOCATOR_SLACK  # noqa: E402
from autoshard.cost.step import price_parts  # noqa: E402
from autoshard.cost.tables import CAPTURED_ELEM_BYTES, CostTables  # noqa: E402
from autoshard.cost.units import kernel_fixed_s, loss_logits, node_backward_s, node_forward_s  # noqa: E402
from autoshard.ir.decisions import Decisions  # noqa: E402, Mesh
from autoshard.ir.plan import Mesh  # noqa: E402
from autoshard.pipeline import capture_graph  # noqa: E402

MODEL = "benchmarks/llama3.py:llama3_8b"
CLUSTER = "dgx-h100"
MICRO_BATCH = 2
GIB = 2**30
MATMULS = eager.MATMUL_2D_TARGETS + eager.MATMUL_BATCHED_TARGETS + CONVOLUTION_TARGETS

# Published reference (a sanity check, not a fit): torchtitan docs/performance.md, Llama 3.1 8B, FSDP,
# local batch 2, seq 8192, selective (op) activation checkpointing, no torch.compile, on H100 96 GB
# HBM2e (2.4 TB/s) at a 500 W power limit (Grand Teton): TPS/GPU and memory (GiB).
TORCHTITAN = {8: (5762, 82.4), 128: (5605, 67.0)}

CONSTANTS = (
    ("peak bf16", "989 TFLOP/s", "NVIDIA H100 SXM datasheet (NUMBERS.md)"),
    ("η_large (matmul efficiency)", "0.80", "8192³ bf16 matmul measured 790-800 TFLOP/s on one H100 (NUMBERS.md)"),
    ("W (memory bandwidth)", "3000 GB/s", "device-to-device copy measured ≈ 3.0 TB/s on one H100 (NUMBERS.md)"),
    (
        "matmul tile, SMs",
        f"{eager.MATMUL_TILE}×{eager.MATMUL_TILE}, 132",
        "NVIDIA Matrix Multiplication Background User's Guide §2.3, §3 (tile/wave quantization); H100 SXM 132 SMs",
    ),
    (
        "FlashAttention-2 utilization",
        "0.35 of peak (H100), taken as 0.35 / 0.80 of η·P",
        "Shah et al. 2024 (FlashAttention-3) abstract: FA2 reaches 35% on H100; beside η_large so a calibrated P prices alike",
    ),
    (
        "attention backward / forward",
        f"{eager.FLASH_BACKWARD_TO_FORWARD}",
        "Dao 2023 (FlashAttention-2) §3.1.2: 5 vs 2 matmuls",
    ),
    ("causal work", f"{eager.CAUSAL_WORK}", "FA2 skips masked blocks; the graph counts full 4·n·E FLOPs"),
    (
        "T_KERNEL (elementwise fixed time)",
        f"{eager.KERNEL_FIXED_US} µs",
        "the smallest kernels of a profiled H200 step (add_ on 2,048 elements: 1.25 µs each; benchmarks/gpu_kernels.py); "
        "launch latency, timed alone with CUDA events (7.9 µs, tile-ai/TileOPs#512), is hidden in a stream",
    ),
    (
        "elementwise asymptote",
        "W (0.89 of HBM peak)",
        "t = 7.9 µs + bytes/4.27 TB/s fits PyTorch `maximum` on H200 at "
        "25/63/126 MB (tile-ai/TileOPs#512): 4.27 of 4.8 TB/s",
    ),
    (
        "autocast casts",
        f"{eager.CAST_BANDWIDTH_FRACTION} of W",
        "fp32 to bf16 copies in a profiled H200 step: 2.55-2.78 of 4.30 TB/s (cost/autocast.py: which tensors are cast)",
    ),
    (
        "host per forward op",
        f"{eager.HOST_FORWARD_OP_US} µs",
        "7 µs Python op with autograd (pytorch/pytorch#41383) + 3 µs launch (NVIDIA 'Getting Started with CUDA Graphs')",
    ),
    ("host per backward op", f"{eager.HOST_BACKWARD_OP_US} µs", "1 µs C++ op (#41383) + 2 launches × 3 µs"),
    (
        "loss bytes per logit",
        f"fwd {eager.LOSS_FORWARD_BYTES_PER_LOGIT}, bwd {eager.LOSS_BACKWARD_BYTES_PER_LOGIT}",
        "autocast runs cross_entropy in fp32 (torch.amp docs): upcast, log-softmax, nll grad, log-softmax grad, downcast",
    ),
    (
        "loss memory per logit",
        f"saved {eager.LOSS_SAVED_BYTES_PER_LOGIT}, backward +{eager.LOSS_BACKWARD_TRANSIENT_BYTES_PER_LOGIT}",
        "fp32 log-softmax kept; nll and log-softmax gradients (fp32) at once",
    ),
    (
        "AdamW bytes per parameter",
        f"{eager.ADAMW_FOREACH_BYTES_PER_PARAM}",
        "torch 2.13 _multi_tensor_adam: 8 foreach kernels over fp32 p, g, m, v (fused would be 28)",
    ),
    ("NVLink 4 / NIC per GPU", "450 / 50 GB/s, α 3 / 6 µs", "DGX H100 datasheet; nccl-tests latencies (NUMBERS.md)"),
    ("allocator slack", f"{ALLOCATOR_SLACK:.0%}", "cost.rank_memory (caching-allocator fragmentation)"),
)


def cli_command(gpus: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "autoshard.cli",
        "estimate",
        MODEL,
        "--cluster",
        CLUSTER,
        "--nodes",
        str(gpus // 8),
        "--global-batch",
        str(MICRO_BATCH * gpus),
        "--dp",
        str(gpus),
        "--tp",
        "1",
        "--pp",
        "1",
        "--zero",
        "3",
        "--microbatch-size",
        str(MICRO_BATCH),
        "--recompute",
        "selective",
        "--json",
    ]


def run_cli(gpus: int) -> tuple[dict, str]:
    """The plan JSON of ``autoshard estimate`` and its warnings (stderr)."""
    done = subprocess.run(cli_command(gpus), cwd=ROOT, capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 1: priced, but over the device's memory (the row says so)
        raise RuntimeError(f"{' '.join(cli_command(gpus))}: {done.stderr.strip()}")
    return json.loads(done.stdout), done.stderr.strip()


def config_for(gpus: int) -> Decisions:
    return Decisions(
        mesh=Mesh(dp=gpus, tp=1, pp=1),
        zero_stage=3,
        microbatch_size=MICRO_BATCH,
        num_microbatches=1,
        recompute="selective",
    )


def compute_by_kind(tables: CostTables) -> dict[str, dict[str, float]]:
    """Seconds of one micro-batch by pass (forward, backward, recompute) and kind of kernel."""
    graph, cluster, runtime = tables.graph, tables.cluster, tables.runtime
    args = (
        graph,
        MICRO_BATCH,
        cluster.device,
        tables.precision.activation_bytes,
        CAPTURED_ELEM_BYTES,
        runtime.attention,
        runtime.kernels,
    )
    in_block = {n for b in graph.blocks for n in b.node_names}
    table = {
        kind: {"forward": 0.0, "backward": 0.0, "recompute": 0.0}
        for kind in ("matmul", "attention", "elementwise", "loss")
    }
    for node, f, b in zip(graph.nodes, node_forward_s(*args), node_backward_s(*args)):
        kind = (
            "attention"
            if node.target.startswith(SDPA_TARGET)
            else "matmul"
            if node.target.startswith(MATMULS)
            else "elementwise"
        )
        table[kind]["forward"] += f
        table[kind]["backward"] += b
        if node.name in in_block and not node.target.startswith(COMPUTE_HEAVY_TARGETS):
            table[kind]["recompute"] += f
    n = loss_logits(graph, MICRO_BATCH)
    table["loss"]["forward"] = eager.loss_forward_s(n, cluster.device)
    table["loss"]["backward"] = eager.loss_backward_s(n, cluster.device)
    return table


def fsdp_collectives_s(tables: CostTables, config: Decisions) -> tuple[float, float]:
    """(all-gathers forward + backward, reduce-scatters) of one micro-batch, as ``cost.dp_comm`` prices them."""
    graph, cluster, precision = tables.graph, tables.cluster, tables.precision
    units, mesh = len(graph.blocks) + 1, shard_mesh(config)
    gather = per_unit_collectives_s("all_gather", graph.param_count * precision.activation_bytes, units, mesh, cluster)
    scatter = per_unit_collectives_s("reduce_scatter", graph.param_count * precision.grad_bytes, units, mesh, cluster)
    return 2 * gather, scatter


def price(graph, gpus: int) -> dict:
    cluster = load_cluster(CLUSTER, nodes=gpus // 8)
    tables, config = CostTables(graph, cluster), config_for(gpus)
    parts = price_parts(tables, config)
    pred = predicted(tables, config, MICRO_BATCH * gpus, parts)
    units = tables.units(MICRO_BATCH, "selective")
    n = loss_logits(graph, MICRO_BATCH)
    gather_s, scatter_s = fsdp_collectives_s(tables, config)
    return {
        "tables": tables,
        "parts": parts,
        "predicted": pred,
        "units": units,
        "logits": n,
        "kinds": compute_by_kind(tables),
        "kernel_fixed_s": kernel_fixed_s(graph, "selective"),
        "gather_s": gather_s,
        "scatter_s": scatter_s,
    }


def time_rows(r: dict) -> list[tuple[str, float, str]]:
    p, kinds = r["parts"], r["kinds"]
    rows = [
        ("forward", p.forward_s, "Σ ops' forward (below by kind)"),
        ("backward", p.backward_s, "matmuls: dgrad + wgrad by their shapes; attention 2.5×; others 2×"),
        ("recompute (selective)", p.recompute_s, "the blocks' non-matmul ops run again"),
    ]
    for kind, source in (
        ("matmul", "η(M,N)·P, tile and wave quantization"),
        ("attention", "FlashAttention-2 at 0.35 of peak, causal ½"),
        ("elementwise", "T_KERNEL + bytes / W per op"),
        ("loss (fp32, over the vocabulary)", "14 / 22 bytes per logit, forward / backward"),
    ):
        key = kind.split(" ")[0]
        k = kinds[key]
        rows.append(
            (
                f"  {kind}: fwd / bwd / rec",
                k["forward"] + k["backward"] + k["recompute"],
                f"{k['forward'] * 1e3:.1f} / {k['backward'] * 1e3:.1f} / {k['recompute'] * 1e3:.1f} ms; {source}",
            )
        )
    rows += [
        (
            "  kernel-launch overhead",
            r["kernel_fixed_s"] + p.host_s,
            f"fixed device time {r['kernel_fixed_s'] * 1e3:.1f} ms (inside elementwise and loss) + host not hidden "
            f"{p.host_s * 1e3:.2f} ms",
        ),
        ("optimizer (foreach AdamW)", p.optimizer_s, "84 B per local parameter / W"),
        ("gradient accumulation", p.grad_accumulation_s, "one micro-batch per step: none"),
        ("FSDP all-gather (fwd + bwd), total", r["gather_s"], "bf16 weights, per unit, NVLink / NIC"),
        ("FSDP reduce-scatter, total", r["scatter_s"], "fp32 gradients, per unit"),
        ("FSDP exposed", p.dp_comm_exposed_s, "what the forward / backward do not hide"),
        ("step", p.step_time_s, "compute + exposed comm"),
    ]
    return rows


def memory_rows(r: dict) -> list[tuple[str, float, str]]:
    mem, units, n = r["parts"].memory, r["units"], r["logits"]
    loss_saved = eager.LOSS_SAVED_BYTES_PER_LOGIT * n
    workspace = max(units.workspace_bytes)
    rows = [
        ("weights (fp32 shard)", mem.params_bytes, "4 B · Ψ / dp"),
        ("gradients (fp32 shard)", mem.grads_bytes, "4 B · Ψ / dp"),
        ("optimizer state (m, v)", mem.optimizer_bytes, "8 B · Ψ / dp"),
        ("activations: blocks (selective)", sum(units.saved_bytes[1:-1]), "block input + matmul/SDPA outputs, bf16"),
        (
            "activations: embedding, final norm",
            units.saved_bytes[0] + units.saved_bytes[-1] - loss_saved,
            "outputs outside the blocks but the logits",
        ),
        ("logits: fp32 log-softmax kept", loss_saved, f"4 B · b·s·V = 4 × {n:.3g}"),
        ("workspace: loss backward", workspace, "two fp32 gradients, 8 B · b·s·V (> a block's recompute)"),
        ("FSDP transient (2 units gathered + 1 unit's grads)", mem.transient_bytes, "cost.rank_memory"),
        (
            "allocator slack",
            mem.peak_bytes
            - (mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes + mem.activations_bytes + mem.transient_bytes),
            "5%",
        ),
        ("peak", mem.peak_bytes, "vs 80 GiB per H100"),
    ]
    return rows


def report(gpus: int, plan: dict, warnings: str, r: dict) -> None:
    pred = plan["predicted"]
    api = r["predicted"]
    assert abs(pred["step_time_s"] - api.step_time_s) < 1e-4 * api.step_time_s, (pred["step_time_s"], api.step_time_s)
    tokens = pred["tokens_per_s"] / gpus
    ref_tps, ref_gib = TORCHTITAN[gpus]
    print(
        f"\n### {gpus} GPUs ({gpus // 8} node{'s' if gpus > 8 else ''}), dp {gpus}, ZeRO-3, micro-batch 2, "
        f"global batch {MICRO_BATCH * gpus}\n"
    )
    print("$ " + " ".join(["autoshard"] + cli_command(gpus)[3:]))
    if warnings:
        print(f"stderr: {warnings}")
    print(
        f"\nstep {pred['step_time_s']:.3f} s · {tokens:,.0f} tokens/s/GPU · MFU {pred['mfu']:.1%} · peak "
        f"{pred['memory_peak_bytes_per_rank'] / GIB:.1f} GiB/GPU  (torchtitan, eager FSDP on a 500 W H100 96 GB: "
        f"{ref_tps:,} tokens/s/GPU, {ref_gib} GiB)\n"
    )
    print("| part | ms | how |\n|---|---:|---|")
    for name, s, how in time_rows(r):
        print(f"| {name} | {s * 1e3:.1f} | {how} |")
    print("\n| memory | GiB | how |\n|---|---:|---|")
    for name, b, how in memory_rows(r):
        print(f"| {name} | {b / GIB:.2f} | {how} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="*", default=[8, 128], help="multiples of 8")
    args = parser.parse_args()
    graph = capture_graph(MODEL)[1]
    print(
        f"model {MODEL}: {graph.param_count / 1e9:.2f}B parameters, {len(graph.blocks)} blocks, "
        f"{graph.tokens_per_sample} tokens per sample; cluster {CLUSTER} (uncalibrated)"
    )
    for gpus in args.gpus:
        plan, warnings = run_cli(gpus)
        report(gpus, plan, warnings, price(graph, gpus))
    print("\n| constant | value | source |\n|---|---|---|")
    for name, value, source in CONSTANTS:
        print(f"| {name} | {value} | {source} |")


if __name__ == "__main__":
    main()
