"""What each rank of ``autoshard calibrate`` measures (``calibrate``'s module doc): the collectives over the
message sizes of ``Settings``, matmuls, an elementwise add, the host probes and the model probes, each timed in
blocks after a barrier (``Bench``); ``worker`` is one rank's process.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard import host_probes
from autoshard.cost.calibrate import COLLECTIVES
from autoshard.cost.hardware import host_memory_bytes
from autoshard.model_probes import (
    PROFILE_ROUNDS,
    ProfileRequest,
    measure_model,
)

KIB = 2**10


MIB = 2**20


WORKER_TIMEOUT_S = 300  # a collective that hangs this long means a broken process group


PROBE_TIME_FACTOR = 3  # host probes and models: 3 × a collective's timing budget (their figures are differences)


PROBE_BLOCKS = 3  # host probes and models: their calls run in this many blocks, each after a barrier (_time_blocks)


@dataclass(frozen=True)
class Settings:
    """What to measure and how long to spend on each figure."""

    sizes_bytes: tuple[int, ...]
    matmul_sizes: tuple[int, ...]
    elementwise_numel: int
    point_s: float  # time each figure for about this long, in min_calls..max_calls calls
    min_calls: int
    max_calls: int

    @classmethod
    def for_backend(cls, backend: str, quick: bool) -> Settings:
        if backend == "nccl":  # GPUs: bf16 matmuls to 8192 (the peak's size, _device), up to 256 MiB messages
            return cls(
                sizes_bytes=message_sizes(4 * KIB, 64 * MIB if quick else 256 * MIB),
                matmul_sizes=(2048, 4096, 8192),
                elementwise_numel=2**28,
                point_s=0.05 if quick else 0.2,
                min_calls=5,
                max_calls=200 if quick else 1000,
            )
        if quick:
            return cls(
                sizes_bytes=message_sizes(4 * KIB, 4 * MIB),
                matmul_sizes=(512, 1024),
                elementwise_numel=2**23,
                point_s=0.08,
                min_calls=3,
                max_calls=40,
            )
        return cls(
            sizes_bytes=message_sizes(4 * KIB, 64 * MIB),
            matmul_sizes=(512, 1024, 2048),
            elementwise_numel=2**24,
            point_s=0.3,
            min_calls=7,
            max_calls=200,
        )

    def steps(self, ranks: int, models: list[ProfileRequest] = ()) -> list[str]:
        """The progress-bar steps, in the order the workers run them."""
        comm = [f"{c} {size_text(s)}" for c in COLLECTIVES for s in self.sizes_bytes] if ranks > 1 else []
        return (
            comm
            + [f"matmul {n}" for n in self.matmul_sizes]
            + ["elementwise add", "host overheads"]
            + [f"model {m.spec}" for m in models]
        )


def message_sizes(smallest: int, largest: int) -> tuple[int, ...]:
    """Message sizes ×4 apart."""
    return tuple(smallest * 4**i for i in range(round(math.log(largest / smallest, 4)) + 1))


def size_text(n: float) -> str:
    return f"{n / MIB:g} MiB" if n >= MIB else f"{n / KIB:g} KiB"


def worker(
    rank: int, ranks: int, backend: str, settings: Settings, models: list[ProfileRequest], tmp: str, queue, threads: int
) -> None:
    """One rank: join the group, measure everything, rank 0 writes ``result.json``."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads)
    dist.init_process_group(
        backend,
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=ranks,
        timeout=datetime.timedelta(seconds=WORKER_TIMEOUT_S),
    )
    try:
        bench = Bench(device, settings, (lambda name: queue.put(name)) if rank == 0 else (lambda name: None))
        result = bench.run(models)
        if rank == 0:
            Path(tmp, "result.json").write_text(json.dumps(result))
    except BaseException:
        dist.destroy_process_group()
        raise
    # Done: destroy the groups and exit 0 without the interpreter's teardown, as a program's rank ends
    # (``runtime.shutdown``): the meshes and DTensor modules of the model probes hold their groups, whose C++ side
    # gloo then tears down during finalization (pytorch/pytorch#179291); on the loaded 2-core CI machine a worker
    # died there with SIGSEGV once (2026-11-28), failing a calibration whose figures were all taken.
    from autoshard.runtime.distributed import shutdown

    shutdown()


KERNEL_BATCH_S = 2e-3  # a GPU kernel is timed in batches of about this long (Bench._time_kernel)


# ... after this long of back-to-back launches: on one H200 the quick calibration's 8192³ matmul read 700 TFLOP/s
# timed from cold (2026-11-26 20:03 UTC) where the same shapes ran 795-828 inside a training step
GPU_WARMUP_S = 0.5


# A GPU matmul is timed with memory-bound kernels between its calls, the matmuls taking this share of device
# time, because its throughput depends on it: back to back, bf16 GEMMs hold an H200 at its 700 W power cap
# (nvidia-smi's throttle reason "SW power cap") and its SM clock falls to 1.5 GHz (644-690 TFLOP/s); between
# memory-bound kernels the clock stays at 1.9-1.98 GHz (757-808). The Llama-3.2-1B step spent 46 % of its device
# time in matmuls and 53 % in matmuls and attention, whose GEMMs ran 743-828 (benchmarks/experiments/gpu_matmul_probe.py,
# benchmarks/results/gpu-h200-2026-11-26/probe.json: an (8192, 8192) x (8192, 2048) GEMM read 690 back to back,
# 742 at duty 0.77, 799 at 0.52, 808 at 0.32; the step's 800).
GPU_MATMUL_DUTY = 0.5


class Bench:
    """The measurements of one rank (the timing scheme is in the module doc)."""

    def __init__(self, device, settings: Settings, report: Callable[[str], None]):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.device, self.s, self.report = torch, dist, device, settings, report
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        self.group, self.broadcast_src = None, 0  # the group collectives run in (None: all ranks), its root
        self.gpu = device.type == "cuda"
        self.dtype = torch.bfloat16 if self.gpu else torch.float32

    def run(self, models: list[ProfileRequest] = ()) -> dict[str, Any]:
        comm = self.collectives() + self.p2p() if self.ranks > 1 else []
        matmul_s = {n: self.matmul(n) for n in self.s.matmul_sizes}
        elem_bytes, elem_s = self.elementwise()
        host = host_probes.measure(self._time_probe, self.ranks)
        self.report("host overheads")
        profiles = []
        for request in models:
            profiles.append(measure_model(self._time_model_round, request, self.device))
            self.report(f"model {request.spec}")
        return {
            "host": host,
            "models": profiles,
            "backend": self.dist.get_backend(),
            "ranks": self.ranks,
            "threads": self.torch.get_num_threads(),
            "device_name": self.device_name(),
            "memory_bytes": self.memory_bytes(),
            "dtype": str(self.dtype).removeprefix("torch."),
            "comm": comm,
            "matmul_s": matmul_s,
            "elementwise_bytes": elem_bytes,
            "elementwise_s": elem_s,
        }

    def collectives(self) -> list[list]:
        rows = []
        for name in COLLECTIVES[:-1]:  # p2p has its own pattern
            for size in self.s.sizes_bytes:
                op, size = self._collective(name, size)
                rows.append([name, self.ranks, size, self._time_op(op)])
                self.report(f"{name} {size_text(size)}")
        return rows

    def _collective(self, name: str, size_bytes: int) -> tuple[Callable[[], None], int]:
        """The call, and S as comm.py counts it (rounded to whole elements per rank)."""
        torch, dist, p = self.torch, self.dist, self.ranks
        elem = torch.tensor([], dtype=self.dtype).element_size()
        numel = max(p, size_bytes // elem // p * p)
        full = torch.ones(numel, dtype=self.dtype, device=self.device)
        shard = torch.ones(numel // p, dtype=self.dtype, device=self.device)
        received = torch.empty_like(full)  # all_to_all: each rank sends S = numel elements, 1/p to each
        g = self.group
        ops = {
            "all_reduce": lambda: dist.all_reduce(full, group=g),
            "reduce_scatter": lambda: dist.reduce_scatter_single(shard, full, group=g),
            "all_gather": lambda: dist.all_gather_single(full, shard, group=g),
            "broadcast": lambda: dist.broadcast(full, src=self.broadcast_src, group=g),
            "all_to_all": lambda: dist.all_to_all_single(received, full, group=g),
        }
        return ops[name], numel * elem

    def p2p(self) -> list[list]:
        """isend/irecv ping-pong in pairs (2i, 2i+1); one-way time = round trip / 2."""
        rows = []
        for size in self.s.sizes_bytes:
            buf = self.torch.ones(size // 4, dtype=self.torch.float32, device=self.device)
            rows.append(["p2p", self.ranks, size, self._time_op(functools.partial(self._ping_pong, buf)) / 2])
            self.report(f"p2p {size_text(size)}")
        return rows

    def _ping_pong(self, buf) -> None:
        """Even ranks send then receive, odd ranks receive then send; a last odd rank out waits."""
        dist, peer = self.dist, self.rank ^ 1
        if peer >= self.ranks:
            return
        first, second = (dist.isend, dist.irecv) if self.rank % 2 == 0 else (dist.irecv, dist.isend)
        first(buf, peer).wait()
        second(buf, peer).wait()

    def matmul(self, n: int) -> float:
        torch = self.torch
        a, b = (torch.randn(n, n, device=self.device).to(self.dtype) for _ in range(2))
        c = torch.empty(n, n, dtype=self.dtype, device=self.device)
        op = lambda: torch.mm(a, b, out=c)  # noqa: E731
        t = self._time_matmul_in_step(op) if self.gpu else self._time_kernel(op)
        self.report(f"matmul {n}")
        return t

    def _time_matmul_in_step(self, op: Callable[[], None], calls_per_window: int = 16) -> float:
        """A GPU matmul's device time between memory-bound kernels (GPU_MATMUL_DUTY: why). Each call is
        followed by ⌈f / t_add⌉ ``torch.add`` calls over one slice, sized so the adds take f = (1 − d)/d of the
        matmul's time; CUDA events around each call time the matmuls alone. The figure is the median over windows of
        ``calls_per_window`` calls, after GPU_WARMUP_S of the same pattern, and the slowest rank's."""
        torch = self.torch
        matmul_s = self._time_kernel(op)
        x, y, z = (torch.ones(self.s.elementwise_numel, dtype=self.dtype, device=self.device) for _ in range(3))
        add_s = self._time_kernel(lambda: torch.add(x, y, out=z))
        filler_s = matmul_s * (1 - GPU_MATMUL_DUTY) / GPU_MATMUL_DUTY
        adds = math.ceil(filler_s / add_s)  # whole adds of one slice, so a long matmul gets its share too
        numel = int(min(x.numel(), max(1, x.numel() * filler_s / adds / add_s)))
        xs, ys, zs = x[:numel], y[:numel], z[:numel]

        def window() -> float:
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(calls_per_window)
            ]
            for start, end in events:
                start.record()
                op()
                end.record()
                for _ in range(adds):
                    torch.add(xs, ys, out=zs)
            torch.cuda.synchronize()
            return sum(start.elapsed_time(end) for start, end in events) / 1e3 / calls_per_window

        started = time.perf_counter()
        while time.perf_counter() - started < GPU_WARMUP_S:
            window()
        windows = max(
            self.s.min_calls, min(self.s.max_calls, math.floor(self.s.point_s / (2 * matmul_s * calls_per_window)))
        )
        times = [window() for _ in range(windows)]
        return statistics.median(self._max_over_ranks(times))

    def elementwise(self) -> tuple[int, float]:
        torch = self.torch
        a, b, c = (torch.ones(self.s.elementwise_numel, dtype=self.dtype, device=self.device) for _ in range(3))
        t = self._time_kernel(lambda: torch.add(a, b, out=c))
        self.report("elementwise add")
        return 3 * a.numel() * a.element_size(), t

    def _time_kernel(self, op: Callable[[], None]) -> float:
        """``_time_op`` for one device kernel (matmul, elementwise). On a GPU a call is
        r = ⌈KERNEL_BATCH_S / t_warm⌉ launches back to back and its time / r: a training step
        queues its kernels ahead of the device, so a kernel's cost there is its device time, not
        launch + synchronise (measured on an H200: a 2048³ bf16 matmul timed alone ran at 383
        TFLOP/s, 664 in batches; 4096³ 648 vs 789). On CPU a call is one launch, as before."""
        if not self.gpu:
            return self._time_op(op)
        self._spin(op, GPU_WARMUP_S)
        t0 = time.perf_counter()
        op()
        self._sync()
        repeat = max(1, math.ceil(KERNEL_BATCH_S / max(time.perf_counter() - t0, 1e-9)))
        repeat = int(self._max_over_ranks([float(repeat)])[0])  # every rank runs the same calls

        def batch() -> None:
            for _ in range(repeat):
                op()

        return self._time_op(batch) / repeat

    def _spin(self, op: Callable[[], None], seconds: float) -> None:
        """Run ``op`` back to back for about ``seconds``, then synchronise: the GPU's clocks rise under
        sustained load, as they are through a training step (module doc)."""
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            for _ in range(8):
                op()
            self._sync()

    def _time_probe(self, op: Callable[[], None]) -> float:
        """``_time_blocks`` for the host probes and models: their figures are differences of times, so each gets
        PROBE_TIME_FACTOR × the time of a collective's point."""
        return self._time_blocks(op, self.s.point_s * PROBE_TIME_FACTOR)

    def _time_model_round(self, op: Callable[[], None]) -> float:
        """``_time_probe`` for one of a model profile's rounds: the rounds share its budget, so ``calibrate --model``
        takes as long as with one round (``model_probes._paired_rounds``)."""
        return self._time_blocks(op, self.s.point_s * PROBE_TIME_FACTOR / PROFILE_ROUNDS)

    def _time_blocks(self, op: Callable[[], None], budget_s: float) -> float:
        """The time per call of the parts of a step (a forward, a backward, an optimizer step, a probe's ops) as a step
        spends it: the k calls that take about ``budget_s`` (``_calls``) run as PROBE_BLOCKS blocks of n = ⌈k / PROBE_BLOCKS⌉, each after a
        barrier, and the figure is the median over blocks of the slowest rank's block time / n.

        A step syncs its ranks once (its loss's all-reduce), so on ranks that share cores it lasts as long as all of
        them take to run its parts, however the scheduler orders them. A call's own time does not tell that: where
        the scheduler runs two of 4 ranks on 2 cores while the other two wait, the first two time every call at a
        whole core's speed and the two others time one call long (the wait) and the rest as fast. Timed side by
        side (4 ranks on 2 cores, the GPT example's b 8 forward and backward, 2026-11-28,
        ``benchmarks/results/cpu-ranks-2026-11-28d/block_vs_call.py``), the median over calls of the ranks' mean
        read 25-28 ms in a fresh process and 15-26 ms once ``host_probes`` had run, the block time 22-31 ms (2 ranks:
        both 13.5-15 ms). Against a run's own statistic (each rank's median over steps back to back, the slowest
        rank's; ``statistics_ab.py``, one process, interleaved), forward + backward + AdamW at b 8 read 36.2 ms as a
        run reads it, 35.5 as blocks and 30.7 as the median of the ranks' mean. The slowest rank per call, which
        collectives keep (``_time_op``), counts every slice some rank lost: 39.3 ms there."""
        per_block = math.ceil(self._calls(op, budget_s) / PROBE_BLOCKS)
        times = []
        for _ in range(PROBE_BLOCKS):
            self.dist.barrier()
            t0 = time.perf_counter()
            for _ in range(per_block):
                op()
                self._sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(self._max_over_ranks(times)) / per_block

    def _time_op(self, op: Callable[[], None]) -> float:
        """Median over calls of the slowest rank's time per call (module doc)."""
        calls = self._calls(op, self.s.point_s)
        times = []
        self.dist.barrier()
        for _ in range(calls):
            t0 = time.perf_counter()
            op()
            self._sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(self._max_over_ranks(times))

    def _calls(self, op: Callable[[], None], budget_s: float) -> int:
        """A warm-up call, then a timed one: the calls (``Settings.min_calls`` … ``max_calls``) that take about
        ``budget_s`` on the slowest rank, the same on every rank."""
        op()
        self._sync()
        t0 = time.perf_counter()
        op()
        self._sync()
        warm = self._max_over_ranks([time.perf_counter() - t0])[0]
        return max(self.s.min_calls, min(self.s.max_calls, math.floor(budget_s / max(warm, 1e-9))))

    def _max_over_ranks(self, values: list[float]) -> list[float]:
        t = self.torch.tensor(values, dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.tolist()

    def _sync(self) -> None:
        if self.gpu:
            self.torch.cuda.synchronize()

    def device_name(self) -> str:
        return self.torch.cuda.get_device_name(self.device) if self.gpu else "cpu-process"

    def memory_bytes(self) -> int:
        if self.gpu:
            return self.torch.cuda.get_device_properties(self.device).total_memory
        return host_memory_bytes() // self.ranks
