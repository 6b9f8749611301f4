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
from autoshard.calibrate_bench import (
    GPU_MATMUL_DUTY,
    Settings,
    size_text,
    worker,
)
from autoshard.cost.calibrate import COLLECTIVES, LinkFit, Sample, fit_link, predict_s
from autoshard.cost.hardware import PRESETS
from autoshard.errors import AutoshardError
from autoshard.ir.plan import write_text_atomic
from autoshard.ir.topology import Cluster, DeviceSpec, HostOverheads, LinkSpec
from autoshard.launch import MAX_LOCAL_CPU_RANKS
from autoshard.model_probes import (
    ProfileRequest,
    model_profile,
    with_pipeline,
    with_tp,
)

MAX_REPEATS = 9  # --repeats: each repeat is a whole calibration (1-2 minutes on CPU ranks)


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


def _run_workers(
    ranks: int, backend: str, settings: Settings, models: list[ProfileRequest], on_step: Callable[[str], None]
) -> Measurements:
    """Spawn the workers, relay rank 0's progress, and read its result file."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="autoshard-calibrate-") as tmp:
        queue = mp.get_context("spawn").SimpleQueue()
        args = (ranks, backend, settings, models, tmp, queue, _threads())
        ctx = mp.start_processes(worker, args=args, nprocs=ranks, join=False, start_method="spawn")
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
        f"memory_bandwidth_gbps = torch.add of {size_text(m.elementwise_bytes // 3)} tensors (3 × bytes / time)"
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
        f"to comm.py's formulas over {', '.join(COLLECTIVES)} at {size_text(sizes[0])}-{size_text(sizes[-1])} "
        f"({fit.samples} medians); fit error max {fit.max_rel_error:.0%}, rms {fit.rms_rel_error:.0%}; "
        f"collectives: each one's own fit, which the cost model prices it with",
        own,
    )


def four_digits(x: float) -> float:
    """Four significant digits: the measurements are not better than that."""
    return float(f"{x:.4g}")


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
            lines.append(f"  {size_text(row[-1].size_bytes):>8} " + " ".join(cells))
        lines.append("")
    lines.append(
        "matmul n: TFLOP/s (roofline error) "
        + ", ".join(f"{n}: {t:.3g} ({cal.roofline_errors()[n]:+.0%})" for n, t in cal.matmul_tflops.items())
    )
    return "".join(f"# {line}".rstrip() + "\n" for line in lines) + "\n"


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
