"""How steady calibrate's host probes are: the probe model's steps (``autoshard.host_probes``) timed in rounds.

    python benchmarks/experiments/host_probe_noise.py ROUNDS [cpu|cuda]

Each round times a forward, a forward and backward, and the same with selective and with full recompute
(median over about 0.3 s of calls each, with the garbage collector on, then off), and prints the
recompute's excess over the plain step: the differences ``host_probes.fit_host`` divides into
``selective_op_us`` and ``checkpoint_block_us``.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import torch

from autoshard import host_probes
from autoshard.runtime.parallel import apply_recompute


def timer(device: str, budget_s: float = 0.3):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def time_op(op) -> float:
        op()
        sync()
        started = time.perf_counter()
        op()
        sync()
        calls = max(5, int(budget_s / (time.perf_counter() - started)))
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            op()
            sync()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    return time_op


def main(rounds: int, device: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    time_op = timer(device)
    x = host_probes.probe_input().to(device)
    blocks = [f"h.{k}" for k in range(host_probes.BLOCKS)]
    plain = host_probes.probe_model().to(device)
    recomputed = {m: apply_recompute(host_probes.probe_model().to(device), blocks, m) for m in ("selective", "full")}
    for _ in range(rounds):
        for collector in ("on", "off"):
            if collector == "off":
                gc.collect()
                gc.disable()
            fwd_bwd = time_op(host_probes.fwd_bwd(plain, x))
            fwd = time_op(lambda: plain(x))
            sel = time_op(host_probes.fwd_bwd(recomputed["selective"], x))
            full = time_op(host_probes.fwd_bwd(recomputed["full"], x))
            gc.enable()
            print(
                f"gc {collector} fwd {fwd * 1e3:.2f} fb {fwd_bwd * 1e3:.2f} sel {sel * 1e3:.2f} full {full * 1e3:.2f} ms"
                f"  sel-fb {(sel - fwd_bwd) * 1e3:.2f} full-fb {(full - fwd_bwd) * 1e3:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cpu")
