"""Eager PyTorch on a GPU: what its kernels achieve, what its host spends, what its loss and AdamW move.

autoshard's programs run eager PyTorch (``Runtime.kernels == "eager"``): one kernel per
elementwise op, cuBLAS per matmul, SDPA's FlashAttention, the loss in fp32 over the whole
vocabulary, AdamW's foreach step. This module prices those kernels; ``cost.compute`` calls it per
op, ``cost.units`` for the loss and the host, ``cost.parts`` for the optimizer. No figure here was
fitted to a published end-to-end iteration time; none was measured by us (no GPU was at hand):
each is a published kernel measurement, a vendor figure or read off torch's source, as cited.

**Matmul efficiency by shape** (cuBLAS; NVIDIA, "Matrix Multiplication Background User's Guide",
DU-09799-001, 2023, §3 "Dimension Quantization Effects"): an M×N output (per batch entry) is
cut into T×T tiles, one thread block each, run in waves of one block per SM::

    tiles(M, N)  = batch · ⌈M/T⌉ · ⌈N/T⌉
    tile_q       = M·N / (⌈M/T⌉·T · ⌈N/T⌉·T)                 (tile quantization: padded work)
    wave_q       = tiles / (⌈tiles / SMs⌉ · SMs)              (wave quantization: idle SMs in the last wave)
    η(M, N)      = η_large · tile_q · wave_q                 (η_large = DeviceSpec.matmul_efficiency,
                                                              measured on an 8192³ bf16 matmul)

so a big GEMM keeps η_large (Llama-3-8B's projections at 16384 tokens: 0.97-1.0 of it) and a small
one fills a few SMs (a 128×128 output: one block, 1/132 of an H100). Forward computes the output
M×N; backward the input gradient (M×K) and the weight gradient (N×K): ``matmul_backward_s``.

**Elementwise kernels** (torch's vectorized elementwise / reduction kernels, one per op)::

    t(bytes) = T_KERNEL + bytes / W                           (W = DeviceSpec.memory_bandwidth_gbps)

From PyTorch's own ``maximum`` (fp16, binary) on one H200 (tile-ai/TileOPs#512, PyTorch 2.9.1, CUDA
12.8): 25.2 MB in 13.8 µs (1.83 TB/s), 62.9 MB in 22.5 µs (2.79 TB/s), 125.8 MB in 37.3 µs (3.37 TB/s):
the line t = 7.9 µs + bytes / 4.27 TB/s passes through all three (within 0.1 µs). 4.27 TB/s is 0.89
of H200's 4.8 TB/s, as a device-to-device copy reaches on H100 (3.0 of 3.35 TB/s, docs/reference-numbers.md, the
preset's W), so W is the asymptote. Those were timed one launch at a time with CUDA events, which includes
the GPU's launch latency (meta-pytorch/tritonbench#50); in a training step the kernels run back to back
and hide it. Measured so, in a step (``benchmarks/gpu_kernels.py``: torch.profiler's kernel times, one
H200, torch 2.11, Llama-3.2-1B's shape; benchmarks/reports/gpu-h200-2026-11-26): the smallest kernels (``add_``
on 2,048 fp32 elements, 231 calls; ``fill_`` of one element; a 2,048 × 32 ``mul``) took 1.25-1.26 µs each,
and large ones bytes / W within 1 µs (a bf16 ``mul`` of 3 × 33.6 MB: 24.6 µs measured, 23.4 µs at W):
T_KERNEL = 1.3 µs, the fixed device time of one kernel in a stream. With
the host's dispatch it makes the "kernel-launch overhead" of a step (``units.kernel_fixed_s``).

**FlashAttention** (torch SDPA's flash backend is FlashAttention-2): forward time F·c / (u/η_ref · η·P)
with c = ½ for a causal mask (FA2 skips the masked blocks; the graph counts the full 4·n·E FLOPs) and u
the fraction of the datasheet peak FA2 reaches: 0.35 on H100 (Shah et al., FlashAttention-3, 2024,
abstract: "FlashAttention-2 achieving only 35% utilization on the H100 GPU"), 0.50 on A100 (Dao,
FlashAttention-2, 2023, abstract: "50-73% of the theoretical maximum FLOPs/s on A100"; the low end).
u is taken relative to what a large matmul reaches on the same card (η_ref = 0.80, the presets' η_large:
8192³ bf16 at 790-800 TFLOP/s on an H100, docs/reference-numbers.md), so a cluster file whose P is a
measured matmul throughput (``autoshard calibrate``: η = 1) prices attention like a preset whose P is
the datasheet's (η = 0.8): the same 346 TFLOP/s on an H100 either way. Backward: 2.5× the forward (FA2
§3.1.2: five matmuls against the forward's two), at the same u. Checked on one H200 (torch 2.11, whose
SDPA ran cuDNN's attention; benchmarks/reports/gpu-h200-2026-11-26): priced 0.224 ms forward and 0.56 ms
backward for a causal (4, 32, 2048, 64) call, measured 0.191 and 0.590.

**Casts** (autocast's, ``cost.autocast``): a copy that converts dtypes runs torch's non-vectorized
``direct_copy_kernel`` at CAST_BANDWIDTH_FRACTION = 0.62 of W (measured in the same H200 step: fp32 to
bf16 copies of 16.8 M elements, 2.55 TB/s for weights (128 calls) and 2.78 TB/s for activations (388
calls), against W = 4.30 TB/s calibrated on ``torch.add``).

**Host** (per op, eager dispatch + launch; overlapped with the device per unit and pass in
``cost.units``: t = max(Σ device, Σ host))::

    h_f = DISPATCH_PY_US + LAUNCH_US                      = 7 + 3  = 10 µs per forward op
    h_b = DISPATCH_CPP_US + KERNELS_PER_BACKWARD_OP·LAUNCH_US = 1 + 2·3 = 7 µs per backward op

DISPATCH_PY_US: a one-element op with autograd recorded costs ~7 µs from Python (pytorch/pytorch#41383,
measured: 1 M calls of ``2*x`` in 6.8 s); DISPATCH_CPP_US: the same op from C++ ≈ 1 µs (ngimel in
the same thread; the autograd engine calls backward ops from C++); LAUNCH_US: back-to-back launches
of a 2.9 µs kernel ran at 3.8 µs per kernel (NVIDIA Developer Blog, A. Gray, "Getting Started with
CUDA Graphs", 2019), so one launch costs the host ≲ 3.8 µs; 3 taken. A backward op launches about
two kernels (input and weight gradient, or the gradient and its accumulation).

**Loss** (``loss_forward_bytes`` / ``loss_backward_bytes``; n = b·s·V logits): autocast runs
``cross_entropy`` in fp32 (torch.amp docs, "CUDA Ops that can autocast to float32"): the bf16 logits
are upcast (read 2, write 4 bytes per element), log-softmax writes fp32 (read 4, write 4) and keeps
its output for backward; ``nll_loss`` gathers one element per row. Backward: ``nll_loss_backward``
writes a dense fp32 gradient (4), ``_log_softmax_backward_data`` reads it and the output, writes the
input gradient (4 + 4 + 4), the upcast's backward casts it to bf16 (4 + 2)::

    forward  14·n bytes, 2 kernels      backward 22·n bytes, 3 kernels
    memory   saved 4·n (the fp32 log-softmax), and in backward 8·n more (two fp32 gradients) at once

Compiled (``--compile-loss on``, ``runtime.compiled.compiled_loss``; torchtitan compiles its loss so since
bbb1b616e): inductor fuses the upcast, log-softmax and nll, and AOT autograd's partitioner keeps the p-byte
logits (p = 2 in bf16) and one fp32 statistic per row instead of the fp32 log-softmax; its backward is one kernel
reading the logits and writing their gradient in their own dtype::

    forward  2·p·n bytes, 1 kernel      backward 2·p·n bytes, 1 kernel
    memory   saved p·n (the logits), and in backward p·n more (their gradient)

**Optimizer** (``torch.optim.AdamW``, foreach, torch 2.13 ``_multi_tensor_adam``): per fp32
parameter, each foreach kernel reads and writes whole tensors: ``mul_(p)`` 8, ``lerp_(m, g)`` 12,
``mul_(v)`` 8, ``addcmul_(v, g, g)`` 16, ``sqrt(v)`` 8, ``div_`` 8, ``add_(eps)`` 8,
``addcdiv_(p, m, ·)`` 16: ADAMW_FOREACH_BYTES_PER_PARAM = 84 (a fused AdamW moves 28). Its ``sqrt``
temporaries (4 bytes per local parameter) live only during the step, after backward has freed the
activations, so they do not raise the step's peak memory.
"""

from __future__ import annotations

import math

from autoshard.ir.topology import DeviceSpec

# Matmul tiling (NVIDIA Matrix Multiplication Background User's Guide §2.3: cuBLAS tiles from 64×64 to
# 256×128; 128×128 taken); SMs per device (NVIDIA H100 / A100 datasheets and architecture whitepapers)
MATMUL_TILE = 128
SMS_BY_DEVICE = {"H100": 132, "H200": 132, "A100": 108}  # by the model in the device's name (presets, torch's names)
# FlashAttention-2's fraction of dense peak (module doc): FA3 paper (H100), FA2 paper (A100)
FLASH_UTILIZATION_BY_DEVICE = {"H100": 0.35, "A100": 0.50}  # by the model in the device's name
FLASH_UTILIZATION_DEFAULT = 0.35
FLASH_REFERENCE_MATMUL_EFFICIENCY = 0.80  # η_large of the cards those fractions were measured on (module doc)
CAST_BANDWIDTH_FRACTION = 0.62  # dtype-converting copies vs W (module doc, "Casts": one H200, torch 2.11)
FLASH_BACKWARD_TO_FORWARD = 2.5  # FA2 §3.1.2: 5 matmuls in backward, 2 in forward
CAUSAL_WORK = 0.5  # a causal mask skips half of the score blocks
# Elementwise kernel: fixed device time per kernel in a stream (module doc: measured on one H200 in a step)
KERNEL_FIXED_US = 1.3
# Host per op (module doc): pytorch/pytorch#41383 (7 µs Python op with autograd, 1 µs from C++);
# NVIDIA "Getting Started with CUDA Graphs" (3.8 µs per back-to-back 2.9 µs kernel)
DISPATCH_PY_US = 7.0
DISPATCH_CPP_US = 1.0
LAUNCH_US = 3.0
KERNELS_PER_BACKWARD_OP = 2
HOST_FORWARD_OP_US = DISPATCH_PY_US + LAUNCH_US
HOST_BACKWARD_OP_US = DISPATCH_CPP_US + KERNELS_PER_BACKWARD_OP * LAUNCH_US
# Loss in fp32 (module doc): bytes per logit element and kernels
LOSS_UPCAST_BYTES_PER_LOGIT = 2 + 4  # the logits cast to fp32 (read bf16, write fp32)
LOSS_FORWARD_BYTES_PER_LOGIT = LOSS_UPCAST_BYTES_PER_LOGIT + 4 + 4  # the upcast, log-softmax (read, write)
LOSS_BACKWARD_BYTES_PER_LOGIT = 4 + 4 + 4 + 4 + 4 + 2  # nll grad, log-softmax grad (2 reads, 1 write), downcast
LOSS_FORWARD_KERNELS, LOSS_BACKWARD_KERNELS = 2, 3
LOSS_SAVED_BYTES_PER_LOGIT = 4  # the fp32 log-softmax kept for backward
LOSS_BACKWARD_TRANSIENT_BYTES_PER_LOGIT = 8  # the fp32 nll gradient and log-softmax gradient, at once
# loss parallelism (torch's loss_parallel) on a vocabulary shard: three fp32 tensors of the shard at once in its
# backward (autoshard dryrun of an hf Llama, V = 32,000, tp 2, fake tensors: 187.5 MiB transient, 3 x 62.5 MiB, where
# the gathered loss held 2 x 125 MiB)
LOSS_PARALLEL_BACKWARD_TRANSIENT_BYTES_PER_LOGIT = 12
# The compiled loss (``--compile-loss on``, module doc "Loss"): inductor's fused cross-entropy reads the 16-bit logits
# twice forward (the row max, then the sum of exponentials with the target's logit) and once backward, where one
# kernel writes the input gradient in the logits' dtype; it keeps the logits and a row statistic for backward
COMPILED_LOSS_FORWARD_READS, COMPILED_LOSS_BACKWARD_READS = 2, 1
COMPILED_LOSS_FORWARD_KERNELS, COMPILED_LOSS_BACKWARD_KERNELS = 1, 1
# AdamW foreach step: bytes per fp32 parameter (module doc; torch/optim/adam.py _multi_tensor_adam)
ADAMW_FOREACH_BYTES_PER_PARAM = 8 + 12 + 8 + 16 + 8 + 8 + 8 + 16

# inputs flattened to 2-D: M = numel / N; a grouped matmul's [S, N] output as one (its groups share the tiles' waves)
MATMUL_2D_TARGETS = (
    "aten.linear",
    "aten.mm",
    "aten.addmm",
    "aten._grouped_mm",
    "aten._scaled_grouped_mm",
    "transformers.grouped_mm_fallback",
)
MATMUL_BATCHED_TARGETS = ("aten.bmm", "aten.baddbmm", "aten.matmul")


def matmul_shape_efficiency(m: int, n: int, batch: int, device: DeviceSpec) -> float:
    """tile_q · wave_q of an m×n output in ``batch`` entries (module doc); 1 on a device of unknown SMs."""
    sms = next((n for model, n in SMS_BY_DEVICE.items() if model in device.name), None)
    if sms is None or m <= 0 or n <= 0:
        return 1.0
    rows, cols = math.ceil(m / MATMUL_TILE), math.ceil(n / MATMUL_TILE)
    tile_q = m * n / (rows * MATMUL_TILE * cols * MATMUL_TILE)
    tiles = batch * rows * cols
    wave_q = tiles / (math.ceil(tiles / sms) * sms)
    return tile_q * wave_q


def matmul_dims(target: str, shape: tuple[int, ...], flops: float) -> tuple[int, int, int, int]:
    """(batch, M, N, K) of a matmul-class op from its output shape and F = 2·batch·M·N·K."""
    n = shape[-1] if shape else 1
    numel = math.prod(shape) if shape else 1
    if target.startswith(MATMUL_BATCHED_TARGETS) and len(shape) >= 3:
        batch, m = math.prod(shape[:-2]), shape[-2]
    else:
        batch, m = 1, max(1, numel // max(1, n))
    k = max(1, round(flops / (2 * max(1, numel))))
    return batch, m, n, k


def matmul_flops_per_s(device: DeviceSpec, shape_efficiency: float) -> float:
    """η(M, N)·P (module doc)."""
    return device.peak_tflops * 1e12 * device.matmul_efficiency * shape_efficiency


def matmul_forward_s(
    target: str, shape: tuple[int, ...], flops: float, moved_bytes: float, device: DeviceSpec
) -> float:
    """max(F / (η(M, N)·P), bytes / W): the output's tiles set η."""
    batch, m, n, _ = matmul_dims(target, shape, flops)
    compute = flops / matmul_flops_per_s(device, matmul_shape_efficiency(m, n, batch, device))
    return max(compute, moved_bytes / bytes_per_s(device))


def matmul_backward_s(
    target: str, shape: tuple[int, ...], flops: float, moved_bytes: float, device: DeviceSpec
) -> float:
    """Input gradient (M×K output) + weight gradient (N×K output, batch entries of a batched matmul),
    each max(F / (η·P), bytes / W)."""
    batch, m, n, k = matmul_dims(target, shape, flops)
    w = bytes_per_s(device)
    dgrad = flops / matmul_flops_per_s(device, matmul_shape_efficiency(m, k, batch, device))
    wgrad = flops / matmul_flops_per_s(device, matmul_shape_efficiency(n, k, batch, device))
    return max(dgrad, moved_bytes / w) + max(wgrad, moved_bytes / w)


def flash_utilization(device: DeviceSpec) -> float:
    return next(
        (u for model, u in FLASH_UTILIZATION_BY_DEVICE.items() if model in device.name), FLASH_UTILIZATION_DEFAULT
    )


def flash_flops_per_s(device: DeviceSpec) -> float:
    """u / η_ref · η·P: FlashAttention's throughput beside a large matmul's on the same card (module doc)."""
    relative = flash_utilization(device) / FLASH_REFERENCE_MATMUL_EFFICIENCY
    return relative * device.matmul_efficiency * device.peak_tflops * 1e12


def flash_forward_s(flops: float, moved_bytes: float, causal: bool, device: DeviceSpec) -> float:
    """max(F·c / (u/η_ref · η·P), bytes / W) (module doc)."""
    work = flops * (CAUSAL_WORK if causal else 1.0)
    return max(work / flash_flops_per_s(device), moved_bytes / bytes_per_s(device))


def cast_s(moved_bytes: float, device: DeviceSpec, kernels: int = 1) -> float:
    """kernels · T_KERNEL + bytes / (CAST_BANDWIDTH_FRACTION · W): dtype-converting copies (module doc, "Casts")."""
    if moved_bytes <= 0:
        return 0.0
    return kernels * KERNEL_FIXED_US * 1e-6 + moved_bytes / (CAST_BANDWIDTH_FRACTION * bytes_per_s(device))


def elementwise_s(moved_bytes: float, device: DeviceSpec, kernels: int = 1) -> float:
    """kernels · T_KERNEL + bytes / W (module doc); 0 for an op that moves nothing (a view)."""
    if moved_bytes <= 0:
        return 0.0
    return kernels * KERNEL_FIXED_US * 1e-6 + moved_bytes / bytes_per_s(device)


def loss_forward_s(logits: float, device: DeviceSpec) -> float:
    """Upcast and fp32 log-softmax of ``logits`` elements (module doc, "Loss")."""
    return elementwise_s(LOSS_FORWARD_BYTES_PER_LOGIT * logits, device, LOSS_FORWARD_KERNELS)


def loss_backward_s(logits: float, device: DeviceSpec) -> float:
    """nll and log-softmax gradients in fp32, cast back to bf16 (module doc, "Loss")."""
    return elementwise_s(LOSS_BACKWARD_BYTES_PER_LOGIT * logits, device, LOSS_BACKWARD_KERNELS)


def compiled_loss_forward_s(logits: float, logit_bytes: float, device: DeviceSpec) -> float:
    """The compiled loss's forward: the logits read twice (module doc, "Loss")."""
    return elementwise_s(COMPILED_LOSS_FORWARD_READS * logit_bytes * logits, device, COMPILED_LOSS_FORWARD_KERNELS)


def compiled_loss_backward_s(logits: float, logit_bytes: float, device: DeviceSpec) -> float:
    """The compiled loss's backward: the logits read, their gradient written, one kernel (module doc, "Loss")."""
    moved = (COMPILED_LOSS_BACKWARD_READS + 1) * logit_bytes * logits
    return elementwise_s(moved, device, COMPILED_LOSS_BACKWARD_KERNELS)


def bytes_per_s(device: DeviceSpec) -> float:
    return device.memory_bandwidth_gbps * 1e9
