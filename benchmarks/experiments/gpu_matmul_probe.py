"""Why a back-to-back GEMM loop reads a lower peak than the same GEMMs inside a training step (one GPU).

    python benchmarks/experiments/gpu_matmul_probe.py OUT.json

On an H200 (2026-11-26) calibrate's 8192³ loop read 675-700 TFLOP/s while the Llama-3.2-1B step's GEMMs ran
743-828 (``gpu_kernels.py``). This probe times bf16 GEMMs of calibrate's and the step's shapes

- back to back (calibrate's scheme), for a few seconds, per window of WINDOW_S, so a decay shows;
- interleaved with memory-bound kernels (``torch.add`` over a 1 GiB buffer) at several duty cycles (share of
  device time in GEMMs), the way a step interleaves them; only the GEMMs are timed (CUDA events around each);
- over inputs of several scales (the power a GEMM draws depends on its data's bit toggling);

and samples the SM clock, power and temperature with ``nvidia-smi`` beside every phase. Writes one JSON.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch

WINDOW_S = 0.25
SHAPES = {"8192^3": (8192, 8192, 8192), "step-w2": (8192, 8192, 2048), "step-w1": (8192, 2048, 8192)}


def tflops(m: int, k: int, n: int, seconds: float) -> float:
    """2·m·k·n / t."""
    return 2 * m * k * n / seconds / 1e12


class Smi:
    """nvidia-smi's clocks.sm, power.draw and temperature every 50 ms, in the background."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [
                "nvidia-smi",
                "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                "--format=csv,noheader,nounits",
                "-lms",
                "50",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.t0 = time.time()

    def stop(self) -> list[str]:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=5)
        return out.strip().splitlines()


def operands(shape, scale: float):
    m, k, n = shape
    a = (torch.randn(m, k, device="cuda") * scale).bfloat16()
    b = (torch.randn(k, n, device="cuda") * scale).bfloat16()
    return a, b, torch.empty(m, n, dtype=torch.bfloat16, device="cuda")


def back_to_back(shape, seconds: float, scale: float = 1.0) -> list[float]:
    """TFLOP/s per window of WINDOW_S, GEMMs queued back to back."""
    a, b, c = operands(shape, scale)
    per_window = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        calls = 0
        e0.record()
        t = time.perf_counter()
        while time.perf_counter() - t < WINDOW_S:
            for _ in range(8):
                torch.mm(a, b, out=c)
            calls += 8
            if calls % 64 == 0:
                torch.cuda.synchronize()
        e1.record()
        torch.cuda.synchronize()
        per_window.append(tflops(*shape, e0.elapsed_time(e1) / 1e3 / calls))
    return per_window


def mean_ms(op, calls: int, warmup: int = 0) -> float:
    """Device milliseconds per call of ``op``, ``calls`` queued back to back after ``warmup`` (CUDA events)."""
    for _ in range(warmup):
        op()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        op()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def interleaved(shape, duty: float, seconds: float, scale: float = 1.0) -> dict:
    """Each GEMM followed by memory-bound adds worth (1 - duty)/duty of its time; GEMMs timed by events."""
    a, b, c = operands(shape, scale)
    x, y, z = (torch.ones(1 << 29, dtype=torch.bfloat16, device="cuda") for _ in range(3))  # 1 GiB each
    gemm_ms = mean_ms(lambda: torch.mm(a, b, out=c), calls=20, warmup=5)
    add_ms = mean_ms(lambda: torch.add(x, y, out=z), calls=5)
    adds = 0 if duty >= 1 else max(1, round(gemm_ms * (1 - duty) / duty / add_ms))
    # partial adds: slice the buffer to hit the duty closely
    filler_ms = gemm_ms * (1 - duty) / duty if duty < 1 else 0.0
    numel = min(x.numel(), max(1 << 20, int(x.numel() * filler_ms / add_ms))) if duty < 1 else 0
    xs, ys, zs = x[:numel], y[:numel], z[:numel]
    windows, gemm_total_ms, all_ms = [], 0.0, 0.0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        pairs = []
        w0, w1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        w0.record()
        for _ in range(32):
            g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            g0.record()
            torch.mm(a, b, out=c)
            g1.record()
            if numel:
                torch.add(xs, ys, out=zs)
            pairs.append((g0, g1))
        w1.record()
        torch.cuda.synchronize()
        g_ms = sum(g0.elapsed_time(g1) for g0, g1 in pairs)
        gemm_total_ms += g_ms
        all_ms += w0.elapsed_time(w1)
        windows.append(tflops(*shape, g_ms / 1e3 / 32))
    return {
        "duty_target": duty,
        "duty_measured": gemm_total_ms / all_ms,
        "filler_numel": numel,
        "adds_equivalent": adds,
        "tflops_windows": windows,
        "tflops_median": statistics.median(windows[len(windows) // 3 :]),
    }


def main(out: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    smi = Smi()
    marks, result = [], {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def mark(name):
        marks.append([name, time.time()])
        print(name, flush=True)

    mark("idle")
    time.sleep(1.0)
    for name, shape in SHAPES.items():
        mark(f"b2b {name}")
        w = back_to_back(shape, 3.0)
        result[f"b2b {name}"] = {"tflops_windows": w, "tflops_median": statistics.median(w[len(w) // 3 :])}
        mark(f"idle after b2b {name}")
        time.sleep(1.5)
    for name in ("8192^3", "step-w2"):
        for duty in (0.75, 0.5, 0.3):
            mark(f"interleaved {name} duty {duty}")
            result[f"interleaved {name} duty {duty}"] = interleaved(SHAPES[name], duty, 2.5)
            time.sleep(1.0)
    for scale in (0.02, 0.1, 4.0):
        mark(f"b2b 8192^3 scale {scale}")
        w = back_to_back(SHAPES["8192^3"], 2.0, scale)
        result[f"b2b 8192^3 scale {scale}"] = {
            "tflops_windows": w,
            "tflops_median": statistics.median(w[len(w) // 3 :]),
        }
        time.sleep(1.0)
    mark("b2b 8192^3 long")
    w = back_to_back(SHAPES["8192^3"], 8.0)
    result["b2b 8192^3 long"] = {"tflops_windows": w, "tflops_median": statistics.median(w[len(w) // 3 :])}
    mark("end")
    time.sleep(0.3)
    result["smi"] = smi.stop()
    result["marks"] = marks
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for key, value in result.items():
        if isinstance(value, dict) and "tflops_median" in value:
            extra = f" duty {value['duty_measured']:.2f}" if "duty_measured" in value else ""
            print(f"{key:40s} {value['tflops_median']:7.1f} TFLOP/s{extra}")


if __name__ == "__main__":
    main(sys.argv[1])
