"""``autoshard calibrate``: measure this machine and write a cluster file for ``--cluster``.

N worker processes (``--devices-per-node``; default 2 CPU ranks, or every GPU) join one
process group (gloo on CPU, NCCL on GPU, rendezvous through a file) and rank 0 reports
what all of them measured:

- **collectives**: all-reduce, reduce-scatter, all-gather, broadcast over message sizes
  4 KiB … 64 MiB (×4 apart; to 4 MiB with ``--quick``; to 256 MiB on GPUs), S as comm.py
  counts it (the all-reduced buffer, the reduce-scatter input, the all-gather output);
- **point-to-point**: isend/irecv ping-pong between ranks 2i and 2i+1 (all pairs at once,
  like the stage boundaries of a pipeline); one-way time = round trip / 2;
- **matmul**: square n×n fp32 matmuls on CPU (bf16 on GPU), all ranks at once, because CPU
  ranks share cores and memory bandwidth in training too; throughput 2n³ / t;
- **elementwise**: ``torch.add(a, b, out=c)`` on large tensors, all ranks at once;
  bandwidth 3·bytes(a) / t, the bytes the annotate pass counts for it (two reads, a write).

Every figure is timed like this (``_time_op``; on a GPU a matmul or elementwise "call" is a batch of
launches about 2 ms long, ``_time_kernel``): a warm-up call, then a timed one; the ranks
agree (slowest rank) on k calls that take about ``Settings.point_s`` in all; after a
barrier each rank times each of its k calls back to back; a call's time is the slowest
rank's (a synchronous step waits for it); the figure is the median over the k calls, so a
call that another process on the machine delayed does not move it. The host probes and models,
which time the parts of a step, run their k calls in PROBE_BLOCKS blocks, each after a barrier,
and take the median over blocks of the slowest rank's block time per call (``_time_blocks``): what
the ranks take together, as a step that syncs them once does, however the scheduler orders them. CPU ranks use
``OMP_NUM_THREADS`` threads (default 1), as ``autoshard run`` starts them.

What is written (``build_cluster``):

- ``intra_node``: the one (α, B) that, put through comm.py's formulas, best reproduces the
  measured times of all collectives and sizes together (least squares of relative error,
  ``autoshard.cost.calibrate.fit_link``; the maths is there). The planner prices every
  collective on one link, so this is the link it should use; where the backend's
  collectives differ in efficiency (gloo's reduce-scatter and all-gather move fewer bytes
  per second than its all-reduce and broadcast) no single link fits all of them, so the
  fit error is reported, and each collective's own fit beside it, in the table and the file.
- ``device.peak_tflops`` = on CPU the median over the matmul sizes (512-2048) of the measured
  throughput; on a GPU the throughput at 8192³ with memory-bound kernels between the calls, the
  matmuls taking GPU_MATMUL_DUTY of device time as in a training step (back to back a GPU's power cap lowers
  its clock; in a step it does not as much), after GPU_WARMUP_S of the same pattern: the eager cost model's η_large,
  which it scales down by tile and wave quantization for smaller shapes), and ``matmul_efficiency``
  = 1. compute.py's roofline t = max(F / (η·P), M / W) uses only the product η·P, and a
  CPU's theoretical peak is not portably knowable, so η·P = measured makes the roofline
  predict the measured matmul times (the file's header shows how close, size by size).
- ``device.memory_bandwidth_gbps`` = the elementwise bandwidth; ``memory_bytes`` as the
  ``local-cpu`` preset computes it (host memory / N) or the GPU's memory.
- ``inter_node``: one machine cannot measure it; the ``local-cpu`` (gloo) or ``dgx-h100``
  (NCCL) preset's figure, marked "not measured".
"""

from __future__ import annotations

import datetime
import functools
import itertools
import json
import math
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from autoshard import host_probes
from autoshard.cost.calibrate import COLLECTIVES, LinkFit, Sample, fit_link, predict_s
from autoshard.cost.hardware import PRESETS, host_memory_bytes
from autoshard.errors import AutoshardError
from autoshard.ir.plan import write_text_atomic
from autoshard.ir.topology import Cluster, DeviceSpec, HostOverheads, LinkSpec
from autoshard.launch import MAX_LOCAL_CPU_RANKS
from autoshard.model_probes import (
    PROFILE_ROUNDS,
    ProfileRequest,
    measure_model,
    model_profile,
    with_pipeline,
    with_tp,
)

KIB, MIB = 2**10, 2**20
WORKER_TIMEOUT_S = 300  # a collective that hangs this long means a broken process group
MAX_REPEATS = 9  # --repeats: each repeat is a whole calibration (1-2 minutes on CPU ranks)
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
        comm = [f"{c} {_size(s)}" for c in COLLECTIVES for s in self.sizes_bytes] if ranks > 1 else []
        return (
            comm
            + [f"matmul {n}" for n in self.matmul_sizes]
            + ["elementwise add", "host overheads"]
            + [f"model {m.spec}" for m in models]
        )


@dataclass
class Measurements:
    """What rank 0 reports: seconds per call, the slowest rank's median."""

    backend: str
    ranks: int
    threads: int
    device_name: str
    memory_bytes: int
    dtype: str
    comm: list[Sample] = field(default_factory=list)
    matmul_s: dict[int, float] = field(default_factory=dict)  # n -> seconds per n×n @ n×n
    elementwise_bytes: int = 0  # bytes one add moves (two reads, one write)
    elementwise_s: float = 0.0
    host: dict[str, Any] = field(default_factory=dict)  # host_probes.measure: seconds per probe
    models: list = field(default_factory=list)  # per --model: b -> mode -> [forward_s, forward_backward_s]
    load_1min: float = 0.0  # the machine's load average when calibration started (other jobs)
    cpus: int = 1
    repeats: int = 1  # whole calibrations in a row whose every time is the median (``median_of_repeats``)

    @property
    def busy(self) -> str:
        """'load 3.1 on 2 CPUs': other processes compete with the ranks and slow what is measured."""
        return f"load {self.load_1min:.1f} on {self.cpus} CPUs at the start"


@dataclass
class Calibration:
    measurements: Measurements
    link_fit: LinkFit | None  # all collectives together: the written intra_node; None for one rank
    per_collective: dict[str, LinkFit | None]  # None: too noisy to fit alone
    cluster: Cluster
    wall_s: float

    @property
    def matmul_tflops(self) -> dict[int, float]:
        return {n: 2 * n**3 / t / 1e12 for n, t in self.measurements.matmul_s.items()}

    def roofline_errors(self) -> dict[int, float]:
        """Relative error of compute.py's roofline against each measured matmul."""
        d, out = self.cluster.device, {}
        for n, t in self.measurements.matmul_s.items():
            elem = 2 if self.measurements.dtype == "bfloat16" else 4
            predicted = max(
                2 * n**3 / (d.peak_tflops * 1e12 * d.matmul_efficiency),
                3 * n * n * elem / (d.memory_bandwidth_gbps * 1e9),
            )
            out[n] = predicted / t - 1
        return out


def check_output(path: str | Path) -> Path:
    """The -o path, checked before minutes of measuring are spent."""
    path = Path(path)
    if path.suffix not in (".yaml", ".yml"):
        raise AutoshardError(f"output '{path}' must end in .yaml or .yml; fix: e.g. -o cluster.yaml")
    if not path.parent.is_dir():
        raise AutoshardError(
            f"output directory '{path.parent}' does not exist; fix: create it, or write "
            f"-o {path.name} in the current directory"
        )
    if path.is_dir():
        raise AutoshardError(f"output '{path}' is a directory; fix: give a file name, e.g. -o {path}/cluster.yaml")
    return path


def calibrate(
    devices_per_node: int | None = None,
    quick: bool = False,
    on_step: Callable[[int, int, str], None] | None = None,
    models: list[ProfileRequest] = (),
    repeats: int = 1,
) -> Calibration:
    """Measure this machine with ``devices_per_node`` ranks (and ``models``, ``model_probes``), ``repeats`` times
    in a row, every time the median over the repeats (``median_of_repeats``); ``on_step(done, total, name)``
    reports progress."""
    start, load_1min = time.perf_counter(), os.getloadavg()[0]
    ranks, backend = resolve_ranks(devices_per_node)
    settings = Settings.for_backend(backend, quick)
    total = len(settings.steps(ranks, models)) * repeats
    progress = on_step or (lambda done, total, name: None)
    progress(0, total, f"starting {ranks} {backend} ranks")
    done = itertools.count(1)
    runs = [
        _run_workers(ranks, backend, settings, list(models), lambda name: progress(next(done), total, name))
        for _ in range(repeats)
    ]
    measured = median_of_repeats(runs)
    measured.load_1min, measured.cpus = load_1min, os.cpu_count() or 1
    return _calibration(measured, quick, time.perf_counter() - start, list(models))


def median_of_repeats(runs: list[Measurements]) -> Measurements:
    """One record of whole calibrations made one after the other: every time the median over them, the rest the
    first's (the same probes run in the same order, so the records line up entry by entry)::

        t = med_r t_r        for each collective and size, matmul size, the elementwise op, host probe, model time

    A calibration takes one to two minutes, and on a shared machine a slow period of about that length moves every
    figure of one calibration alike (on a 2-core VM, 2026-11-27: twice the model's times 1.5-1.6 times the
    calibrations minutes either side, pricing the runs after it 23-80 % over). The median of three sits with the
    two that agree. Times are combined before anything is fitted, so fits and differences (the host probes')
    are of medians."""
    first = runs[0]
    if len(runs) == 1:
        return first
    comm = []
    for i, s in enumerate(first.comm):
        same = [r.comm[i] for r in runs]
        assert all((x.collective, x.ranks, x.size_bytes) == (s.collective, s.ranks, s.size_bytes) for x in same)
        comm.append(replace(s, time_s=statistics.median(x.time_s for x in same)))
    return replace(
        first,
        comm=comm,
        matmul_s=_median_tree([r.matmul_s for r in runs]),
        elementwise_s=statistics.median(r.elementwise_s for r in runs),
        host=_median_tree([r.host for r in runs]),
        models=_median_tree([r.models for r in runs]),
        repeats=len(runs),
    )


def _median_tree(trees: list[Any]) -> Any:
    """Nested dicts and lists of numbers (the probes' records) with every number the median over ``trees``; counts
    (equal in every tree) and anything not a number are the first tree's. A record one calibration lacks (a model
    probe that failed in it and gave None or left its key out, ``model_probes._pipeline_times``) is the median of those
    that have it."""
    trees = [t for t in trees if t is not None] or trees
    first = trees[0]
    if isinstance(first, dict):
        present = [t for t in trees if isinstance(t, dict)]
        keys = dict.fromkeys(k for t in present for k in t)  # every tree's, in the order they first appear
        return {k: _median_tree([t[k] for t in present if k in t]) for k in keys}
    if isinstance(first, list):
        return [_median_tree([t[i] for t in trees]) for i in range(len(first))]
    if isinstance(first, bool) or not isinstance(first, (int, float)) or all(t == first for t in trees):
        return first
    return statistics.median(trees)


def microbatch_sizes_flag(text: str) -> tuple[int, ...]:
    """--microbatch-sizes "1,2,4,8" as sizes; one line naming the fix otherwise."""
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",")}))
    except ValueError:
        sizes = ()
    if not sizes or sizes[0] < 1 or len(sizes) > 16:
        raise AutoshardError(
            f"--microbatch-sizes {text!r} must be up to 16 positive integers separated by commas; "
            "fix: e.g. --microbatch-sizes 1,2,4,8"
        )
    return sizes


def repeats_flag(text: str) -> int:
    """--repeats "3" as a count of whole calibrations; one line naming the fix otherwise."""
    try:
        repeats = int(text)
    except ValueError:
        repeats = 0
    if not 1 <= repeats <= MAX_REPEATS:
        raise AutoshardError(
            f"--repeats {text!r} must be a whole number from 1 to {MAX_REPEATS}; fix: e.g. --repeats 3 (an odd "
            "count, so the median is one calibration's time)"
        )
    return repeats


def resolve_ranks(devices_per_node: int | None) -> tuple[int, str]:
    """(ranks, backend) to measure with: NCCL over the GPUs if there are any, else gloo."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus else "gloo"
    ranks = (gpus or 2) if devices_per_node is None else devices_per_node
    _check_ranks(ranks, backend)
    return ranks, backend


def _check_ranks(ranks: int, backend: str) -> None:
    import torch

    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise AutoshardError(f"--devices-per-node {ranks!r} must be a positive integer; fix: pass e.g. 2")
    if backend == "nccl" and ranks > torch.cuda.device_count():
        raise AutoshardError(
            f"--devices-per-node {ranks} but this machine has {torch.cuda.device_count()} GPU(s); "
            f"fix: pass --devices-per-node {torch.cuda.device_count()} or fewer"
        )
    if backend == "gloo" and ranks > MAX_LOCAL_CPU_RANKS:
        raise AutoshardError(
            f"--devices-per-node {ranks} CPU processes is more than this machine should run; "
            "fix: pass the number of ranks a node will run, e.g. 2"
        )


# --------------------------------------------------------------------------- parent side


def _run_workers(
    ranks: int, backend: str, settings: Settings, models: list[ProfileRequest], on_step: Callable[[str], None]
) -> Measurements:
    """Spawn the workers, relay rank 0's progress, and read its result file."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="autoshard-calibrate-") as tmp:
        queue = mp.get_context("spawn").SimpleQueue()
        args = (ranks, backend, settings, models, tmp, queue, _threads())
        ctx = mp.start_processes(_worker, args=args, nprocs=ranks, join=False, start_method="spawn")
        try:
            while not ctx.join(timeout=0.1):
                _relay(queue, on_step)
        except mp.ProcessRaisedException as exc:
            raise AutoshardError(
                f"a calibration worker failed: {_last_line(str(exc))}; fix: rerun with --debug for the traceback"
            ) from exc
        except mp.ProcessExitedException as exc:
            raise AutoshardError(
                f"a calibration worker died ({exc}); fix: check memory, rerun with fewer --devices-per-node"
            ) from exc
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.terminate()
        _relay(queue, on_step)
        return _read_result(Path(tmp) / "result.json")


def _relay(queue, on_step: Callable[[str], None]) -> None:
    while not queue.empty():
        on_step(queue.get())


def _threads() -> int:
    """Threads per CPU rank, as ``autoshard run`` starts them (launch.py)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def _read_result(path: Path) -> Measurements:
    d = json.loads(path.read_text())
    comm = [Sample(*row) for row in d.pop("comm")]
    matmul = {int(n): t for n, t in d.pop("matmul_s").items()}
    return Measurements(**d, comm=comm, matmul_s=matmul)


def _calibration(m: Measurements, quick: bool, wall_s: float, models: list[ProfileRequest] = ()) -> Calibration:
    per_collective = {c: fit_or_none([s for s in m.comm if s.collective == c]) for c in COLLECTIVES} if m.comm else {}
    link_fit = fit_link(m.comm) if m.comm else None
    cluster = build_cluster(m, link_fit, quick, per_collective)
    if models:
        origin = (
            f"measured by autoshard calibrate on {socket.gethostname()} {datetime.date.today().isoformat()} "
            f"({m.busy}), {m.ranks} {m.backend} ranks at once, median over blocks of calls of the slowest rank's block time per call"
            + (f", then over {m.repeats} calibrations in a row" if m.repeats > 1 else "")
        )
        profiles = tuple(model_profile(r, t, m.ranks, origin) for r, t in zip(models, m.models))
        cluster = replace(cluster, profiles=profiles)  # the pipeline fits price stages with the profiles
        profiles = tuple(
            with_tp(with_pipeline(p, r, t, cluster), r, t, cluster) for p, r, t in zip(profiles, models, m.models)
        )
        cluster = replace(cluster, profiles=profiles)
    return Calibration(m, link_fit, per_collective, cluster, wall_s)


def fit_or_none(samples: list[Sample]) -> LinkFit | None:
    """A per-collective fit, only reported: one whose times do not grow with size is left out."""
    try:
        return fit_link(samples)
    except AutoshardError:
        return None


def build_cluster(
    m: Measurements, fit: LinkFit | None, quick: bool, per_collective: dict[str, LinkFit | None] | None = None
) -> Cluster:
    """The measured cluster: one node of ``m.ranks`` devices (what is written and how: module doc)."""
    host = socket.gethostname()
    day = datetime.date.today().isoformat()
    repeats = f" --repeats {m.repeats}" if m.repeats > 1 else ""
    origin = f"measured by autoshard calibrate{' --quick' if quick else ''}{repeats} on {host} {day} ({m.busy})"
    default = PRESETS["local-cpu" if m.backend == "gloo" else "dgx-h100"]
    inter = LinkSpec(
        default.inter_node.bandwidth_gbps,
        default.inter_node.latency_us,
        f"not measured (calibrate sees one node); {default.name} preset: {default.inter_node.source}",
    )
    intra = _intra_link(m, fit, origin, default, per_collective)
    cluster = Cluster(f"calibrated-{host}", 1, m.ranks, _device(m, origin), intra, inter, m.backend)
    overheads = _host(m, cluster, origin) if m.host else HostOverheads.none()
    if m.backend == "gloo":  # CPU ranks share the node's cores (cost.pipeline_step, "Shared cores")
        overheads = replace(overheads, shared_cores=float(max(1, m.cpus // m.threads)))
    return replace(cluster, host=overheads) if overheads.measured else cluster


def _host(m: Measurements, cluster: Cluster, origin: str) -> HostOverheads:
    """Host overheads from the probes (``host_probes``), priced against the device and link just fitted."""
    return host_probes.fit_host(
        m.host,
        host_probes.probe_counts(cluster),
        cluster,
        m.ranks,
        f"{origin}, {m.ranks} {m.backend} ranks at once: autoshard.host_probes on "
        f"{host_probes.BLOCKS} blocks of width {host_probes.WIDTH}",
    )


def _device(m: Measurements, origin: str) -> DeviceSpec:
    """On GPUs the peak is the largest matmul's throughput (8192³): the eager cost model's η_large, which
    its tile and wave quantization scale down for smaller shapes (``cost.eager``); on CPU ranks (the fused
    roofline, one η for every matmul) the median over the sizes."""
    by_n = {n: 2 * n**3 / t / 1e12 for n, t in m.matmul_s.items()}
    gpu = m.backend == "nccl"
    tflops = by_n[max(by_n)] if gpu else statistics.median(by_n.values())
    rule = (
        f"bf16 matmul throughput at n = {max(by_n)} between memory-bound kernels (matmuls {GPU_MATMUL_DUTY:.0%} of "
        "device time, as in a training step)"
        if gpu
        else f"median {m.dtype} matmul throughput over n = {', '.join(map(str, m.matmul_s))}"
    )
    who = f"{m.ranks} {m.backend} ranks" + (f" of {m.threads} thread(s)" if m.backend == "gloo" else "")
    return DeviceSpec(
        name=m.device_name,
        peak_tflops=four_digits(tflops),
        memory_bytes=m.memory_bytes,
        memory_bandwidth_gbps=four_digits(m.elementwise_bytes / m.elementwise_s / 1e9),
        matmul_efficiency=1.0,
        source=f"{origin}, {who} at once: peak_tflops = {rule} (matmul_efficiency 1, so the roofline predicts "
        f"measured matmuls), "
        f"memory_bandwidth_gbps = torch.add of {_size(m.elementwise_bytes // 3)} tensors (3 × bytes / time)"
        + (", memory_bytes = host MemTotal / devices_per_node" if m.backend == "gloo" else ""),
    )


def _intra_link(
    m: Measurements,
    fit: LinkFit | None,
    origin: str,
    default: Cluster,
    per_collective: dict[str, LinkFit | None] | None = None,
) -> LinkSpec:
    if fit is None:
        return LinkSpec(
            default.intra_node.bandwidth_gbps,
            default.intra_node.latency_us,
            f"not measured (one rank); {default.name} preset: {default.intra_node.source}",
        )
    sizes = sorted(s.size_bytes for s in m.comm)
    own = tuple(
        (name, four_digits(f.latency_us), four_digits(f.bandwidth_gbps))
        for name, f in (per_collective or {}).items()
        if f
    )
    return LinkSpec(
        four_digits(fit.bandwidth_gbps),
        four_digits(fit.latency_us),
        f"{origin}, {m.backend} with {m.ranks} ranks: α and B fitted by least squares of relative error "
        f"to comm.py's formulas over {', '.join(COLLECTIVES)} at {_size(sizes[0])}-{_size(sizes[-1])} "
        f"({fit.samples} medians); fit error max {fit.max_rel_error:.0%}, rms {fit.rms_rel_error:.0%}; "
        f"collectives: each one's own fit, which the cost model prices it with",
        own,
    )


def four_digits(x: float) -> float:
    """Four significant digits: the measurements are not better than that."""
    return float(f"{x:.4g}")


def message_sizes(smallest: int, largest: int) -> tuple[int, ...]:
    """Message sizes ×4 apart."""
    return tuple(smallest * 4**i for i in range(round(math.log(largest / smallest, 4)) + 1))


def _size(n: float) -> str:
    return f"{n / MIB:g} MiB" if n >= MIB else f"{n / KIB:g} KiB"


# --------------------------------------------------------------------------- the file


def write_cluster_file(path: str | Path, cal: Calibration, command: str) -> Path:
    """Write ``cal.cluster`` as a YAML cluster file atomically, the measurements as comments."""
    path = Path(path)
    body = yaml.safe_dump(cal.cluster.to_dict(), sort_keys=False, allow_unicode=True, width=10_000)
    write_text_atomic(path, _header(cal, command, path) + body)
    return path


def _header(cal: Calibration, command: str, path: Path) -> str:
    m = cal.measurements
    lines = [
        f"Cluster file written by `{command}` ({cal.wall_s:.0f} s).",
        f"Use it: autoshard plan model.py:build --cluster {path} --global-batch ...",
        f"{m.ranks} {m.backend} ranks, {m.dtype}; every time is the median over calls of the slowest rank"
        " (the host probes and models: over blocks of calls)"
        + (f", then over {m.repeats} calibrations in a row." if m.repeats > 1 else "."),
        f"Machine {m.busy}: other processes slow what is measured; calibrate an idle machine.",
        "",
    ]
    if cal.link_fit is not None:
        lines += [
            "alpha-beta fits (autoshard.cost.calibrate), relative error of the fitted model:",
            f"  {'collective':<15} {'latency_us':>10} {'GB/s':>8} {'max err':>8} {'rms err':>8}",
        ]
        for name, fit in [("all (written)", cal.link_fit), *cal.per_collective.items()]:
            figures = (
                f"{fit.latency_us:>10.1f} {fit.bandwidth_gbps:>8.3g} {fit.max_rel_error:>8.1%} "
                f"{fit.rms_rel_error:>8.1%}"
                if fit
                else "no fit: times do not grow with size"
            )
            lines.append(f"  {name:<15} {figures}")
        lines += [
            "",
            "measured / predicted with the written intra_node, microseconds:",
            "  " + f"{'size':>8}" + "".join(f" {c:>21}" for c in COLLECTIVES),
        ]
        link = cal.cluster.intra_node
        columns = [sorted((s for s in m.comm if s.collective == c), key=lambda s: s.size_bytes) for c in COLLECTIVES]
        for row in zip(*columns):  # the same nominal size in each (rounded to whole elements per rank)
            cells = [
                f"{s.time_s * 1e6:>10.0f} / {predict_s(s.collective, s.ranks, s.size_bytes, link) * 1e6:<8.0f}"
                for s in row
            ]
            lines.append(f"  {_size(row[-1].size_bytes):>8} " + " ".join(cells))
        lines.append("")
    lines.append(
        "matmul n: TFLOP/s (roofline error) "
        + ", ".join(f"{n}: {t:.3g} ({cal.roofline_errors()[n]:+.0%})" for n, t in cal.matmul_tflops.items())
    )
    return "".join(f"# {line}".rstrip() + "\n" for line in lines) + "\n"


# --------------------------------------------------------------------------- the table


def render(cal: Calibration, console=None) -> None:
    """A small table of the written figures and their errors against the measurements."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(
        title=f"Calibrated {cal.cluster.name}: {cal.measurements.ranks} {cal.cluster.backend} ranks "
        f"({cal.wall_s:.0f} s, {cal.measurements.busy})",
        caption="error: |model − measured| / measured over the sizes; '… alone': one collective's own fit, "
        "for comparison (the file has the joint fit)",
    )
    for col in ("figure", "value", "error max / rms"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    link, device = cal.cluster.intra_node, cal.cluster.device
    if cal.link_fit is not None:
        table.add_row(
            "intra_node α, B", f"{link.latency_us:.3g} µs, {link.bandwidth_gbps:.3g} GB/s", _err(cal.link_fit)
        )
        for name, fit in cal.per_collective.items():
            figures = f"{fit.latency_us:.3g} µs, {fit.bandwidth_gbps:.3g} GB/s" if fit else "no fit (noisy)"
            table.add_row(f"  {name} alone", figures, _err(fit) if fit else "")
    else:
        table.add_row("intra_node", "not measured (one rank)", "")
    errors = cal.roofline_errors()
    worst = max(errors.values(), key=abs)
    rms = math.sqrt(statistics.mean(e * e for e in errors.values()))
    table.add_row(
        f"peak_tflops ({cal.measurements.dtype} matmul)",
        f"{device.peak_tflops:.3g} TFLOP/s",
        f"{abs(worst):.0%} / {rms:.0%}",
    )
    table.add_row("memory_bandwidth_gbps", f"{device.memory_bandwidth_gbps:.3g} GB/s", "")
    table.add_row("memory_bytes per rank", f"{device.memory_bytes / 2**30:.1f} GiB", "")
    console.print(table)


def _err(fit: LinkFit) -> str:
    return f"{fit.max_rel_error:.0%} / {fit.rms_rel_error:.0%}"


# --------------------------------------------------------------------------- worker side


def _worker(
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
                self.report(f"{name} {_size(size)}")
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
            self.report(f"p2p {_size(size)}")
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
