"""Per-step log lines on rank 0, a JSONL / TensorBoard stream, the run against the plan's prediction at the
end, and the metrics file ``autoshard verify`` reads.

Each step's line: loss, tokens/s, step time, learning rate and gradient norm (where the recipe clips), MFU
and memory. MFU is the plan's model FLOPs per step over what the job's devices could do in the step::

    MFU = F_step / (t_step · N · P)      F_step = mfu_pred · t_pred · N · P   (the plan's ``Prediction``)

so F_step is the model's 6·params·tokens-style count the cost model used (``cost.step``), N the plan's
world size, P the cluster's peak FLOP/s per device. Memory is ``torch.cuda.max_memory_allocated`` on a GPU
(what the plan's sum of parts predicts: the peak before the allocator's slack) and the process's peak
resident set on a CPU rank (``resource.getrusage``: the host memory the step held, no plan counts it).
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autoshard.ir.plan import write_atomic
from autoshard.runtime import faults

WARMUP_STEPS = 1  # the first step pays for allocation and lazy initialisation; throughput skips it
ETA_WINDOW_STEPS = 100  # each step's ETA: the median of the last this many steps (``StepLog.recent_median_step_s``)


@dataclass(frozen=True)
class Prediction:
    """What the plan predicted for one step (an emitted program's ``PREDICTED`` constant)."""

    step_time_s: float
    mfu: float  # model FLOPs over the devices' peak in the predicted step
    peak_flops_per_s: float  # one device's peak, the cluster's (P above)
    devices: int  # the plan's world size (N)
    allocated_bytes: int  # per rank: the plan's memory parts summed (no allocator slack)
    memory_peak_bytes: int  # per rank, with the allocator's slack: what must fit

    @property
    def model_flops_per_step(self) -> float:
        """F_step = mfu · t · N · P (module doc)."""
        return self.mfu * self.step_time_s * self.devices * self.peak_flops_per_s

    def mfu_of(self, step_s: float) -> float:
        return self.model_flops_per_step / (step_s * self.devices * self.peak_flops_per_s)


@dataclass
class StepLog:
    tokens_per_step: int
    is_main: bool
    log_every: int = 1
    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    step_ends_s: list[float] = field(default_factory=list)  # each step's end, wall clock (time.time()): ranks compare
    lrs: list[float] = field(default_factory=list)  # each step's learning rate (the scheduler's)
    grad_norms: list[float | None] = field(default_factory=list)  # before clipping; None: the recipe does not clip
    prediction: Prediction | dict | None = None  # the plan's (MFU per step, the end's comparison); a dict: its fields
    jsonl: str | None = None  # rank 0 appends one JSON object per step here
    tensorboard: str | None = None  # rank 0 writes scalars here (torch.utils.tensorboard; needs tensorboard)
    last_step: int | None = None  # the run's last step (--steps - 1): each line's ETA
    _t0: float = 0.0
    _writer: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.prediction, dict):
            self.prediction = Prediction(**self.prediction)
        if self.is_main and self.tensorboard:
            self._writer = tensorboard_writer(self.tensorboard)
        if self.is_main and self.jsonl:
            Path(self.jsonl).parent.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def end(self, step: int, loss: float, lr: float | None = None, grad_norm: float | None = None) -> None:
        """Step ``step`` is done: its loss, its learning rate and its gradient norm before clipping (None: not
        computed, the recipe does not clip)."""
        elapsed_s = time.perf_counter() - self._t0
        self.losses.append(loss)
        self.step_times_s.append(elapsed_s)
        self.step_ends_s.append(time.time())
        if lr is not None:
            self.lrs.append(lr)
            self.grad_norms.append(grad_norm)
        if self.is_main:
            self._report(step, loss, elapsed_s, lr, grad_norm)
        faults.note_step(step)
        faults.inject("kill", step)
        faults.inject("hang", step)

    def _report(self, step: int, loss: float, elapsed_s: float, lr: float | None, grad_norm: float | None) -> None:
        record = step_record(step, loss, elapsed_s, self.tokens_per_step, lr, grad_norm, self.prediction)
        if self.last_step is not None:
            record["eta_s"] = (self.last_step - step) * self.recent_median_step_s  # steady state, in O(1) per step
        if step % self.log_every == 0:
            print(step_line(record), flush=True)
        if self.jsonl:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for key, value in record.items():
                if key != "step" and value is not None:
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()

    @property
    def recent_median_step_s(self) -> float:
        """The median of the last ETA_WINDOW_STEPS timed steps: each step's ETA, the run's pace now, at a cost that
        does not grow with the run (the median of every step so far sorts them all, each step)."""
        times = self.step_times_s
        first = max(WARMUP_STEPS, len(times) - ETA_WINDOW_STEPS) if len(times) > WARMUP_STEPS else 0
        return statistics.median(times[first:])  # a slice of at most the window: no copy of the whole run

    @property
    def median_step_s(self) -> float:
        timed = self.step_times_s[WARMUP_STEPS:] or self.step_times_s
        return statistics.median(timed)

    def summary(self) -> str:
        first, last = self.losses[0], self.losses[-1]
        peak = peak_device_bytes()
        return (
            f"done: loss {first:.4f} -> {last:.4f} over {len(self.losses)} steps; median step "
            f"{self.median_step_s * 1e3:.1f} ms, {self.tokens_per_step / self.median_step_s:,.0f} tokens/s"
            + (f"; peak {peak / 2**30:.2f} GiB allocated" if peak is not None else "")
        )

    def against_prediction(self) -> str:
        """The run beside the plan: median step, tokens/s, MFU and memory, measured / predicted (rank 0's)."""
        pred = self.prediction
        if pred is None or not self.step_times_s:
            return ""
        step_s = self.median_step_s
        rows = [
            (
                "median step",
                f"{step_s * 1e3:.1f} ms",
                f"{pred.step_time_s * 1e3:.1f} ms",
                _ratio(step_s, pred.step_time_s),
            ),
            (
                "tokens/s",
                f"{self.tokens_per_step / step_s:,.0f}",
                f"{self.tokens_per_step / pred.step_time_s:,.0f}",
                _ratio(pred.step_time_s, step_s),
            ),
            ("MFU", f"{pred.mfu_of(step_s):.1%}", f"{pred.mfu:.1%}", ""),
        ]
        peak = peak_device_bytes()
        if peak is not None:
            rows.append(
                ("peak memory (allocated)", _gib(peak), _gib(pred.allocated_bytes), _ratio(peak, pred.allocated_bytes))
            )
        width = max(len(r[0]) for r in rows)
        lines = [f"{'':{width}}  {'measured':>14}  {'predicted':>14}  measured / predicted"]
        lines += [f"{name:{width}}  {m:>14}  {p:>14}  {r}" for name, m, p, r in rows]
        return "\n".join(lines)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def step_record(
    step: int,
    loss: float,
    elapsed_s: float,
    tokens_per_step: int,
    lr: float | None,
    grad_norm: float | None,
    prediction: Prediction | None,
) -> dict[str, Any]:
    """One step's figures (the JSONL line; the printed line shows them)."""
    return {
        "step": step,
        "loss": loss,
        "step_s": elapsed_s,
        "tokens_per_s": tokens_per_step / elapsed_s,
        "lr": lr,
        "grad_norm": grad_norm,
        "mfu": prediction.mfu_of(elapsed_s) if prediction is not None else None,
        "memory_bytes": memory_bytes(),
    }


def step_line(r: dict[str, Any]) -> str:
    """``step    3 | loss 2.8123 | 12,345 tokens/s |   41.2 ms | lr ... | grad norm ... | MFU ... | mem ...``"""
    return (
        f"step {r['step']:4d} | loss {r['loss']:.4f} | {r['tokens_per_s']:10,.0f} tokens/s | "
        f"{r['step_s'] * 1e3:8.1f} ms"
        + (f" | lr {r['lr']:.3e}" if r["lr"] is not None else "")
        + (f" | grad norm {r['grad_norm']:.4f}" if r["grad_norm"] is not None else "")
        + (f" | MFU {r['mfu']:5.1%}" if r["mfu"] is not None else "")
        + (f" | mem {r['memory_bytes'] / 2**30:.2f} GiB" if r["memory_bytes"] is not None else "")
        + (f" | ETA {_clock(r['eta_s'])}" if r.get("eta_s") is not None else "")
    )


def _clock(seconds: float) -> str:
    """``1h02m03s``, ``2m05s``, ``7s``."""
    s = round(seconds)
    h, m = divmod(s, 3600)
    m, s = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def memory_bytes() -> int | None:
    """This rank's peak memory so far: the GPU's allocated bytes, or the CPU process's peak resident set."""
    device = peak_device_bytes()
    if device is not None:
        return device
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss if sys.platform == "darwin" else rss * 1024


def tensorboard_writer(folder: str):
    """``torch.utils.tensorboard.SummaryWriter`` on ``folder``; one line naming the fix without tensorboard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        from autoshard.errors import AutoshardError

        raise AutoshardError(
            "--tensorboard needs the tensorboard package; fix: pip install tensorboard, or leave "
            "--tensorboard out (--log-jsonl writes the same figures as JSON lines)"
        ) from None
    return SummaryWriter(folder)


def _ratio(measured: float, predicted: float) -> str:
    return f"{measured / predicted:.3f}" if predicted else "-"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def peak_device_bytes() -> int | None:
    """This rank's peak GPU memory so far (``torch.cuda.max_memory_allocated``: what the cost model's
    ``memory_peak_bytes_per_rank`` predicts); None on CPU ranks, which have no such counter."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.max_memory_allocated()


WEIGHTS = "weights"  # the folder in ``--metrics-out`` holding the final weights (a DCP checkpoint)


def finish(model, optimizer, log: StepLog, metrics_out: str | None, mesh=None) -> None:
    """Print the summary; with ``metrics_out``, rank 0 writes the losses and step times (``metrics.json``), every
    rank its median step (``rank-R.json``), and every rank its shards of the final weights (``weights/``, a DCP
    checkpoint: ``checkpoint.save_weights``, a collective; nothing is gathered). ``model``, ``optimizer`` and
    ``mesh`` as ``checkpoint.save`` takes them (a pipeline's stages and ``StageOptimizers``)."""
    if log.is_main and log.losses:
        print(log.summary(), flush=True)
        table = log.against_prediction()
        if table:
            print(table, flush=True)
    log.close()
    if not metrics_out:
        return
    from autoshard.runtime import checkpoint  # DCP: imported by programs that write metrics or checkpoints only

    checkpoint.save_weights(Path(metrics_out) / WEIGHTS, model, optimizer, mesh)
    if dist.get_rank() == 0:
        _write_metrics(Path(metrics_out), log)
    _write_rank_record(Path(metrics_out), log)
    dist.barrier()


def read_weights(metrics_out: str | Path) -> dict[str, torch.Tensor]:
    """The final weights a program wrote with ``--metrics-out``, whole, by the model's names, read in this
    process (``checkpoint.read_weights``)."""
    from autoshard.runtime import checkpoint

    return checkpoint.read_weights(Path(metrics_out) / WEIGHTS)


def _write_rank_record(out: Path, log: StepLog) -> None:
    """Every rank's own median step and step times, ``rank-{r}.json``: the job's pace is its slowest rank's, and
    ranks that share no collective in a step (a replicated TP layout) drift apart, so rank 0's
    steps may not show it (``slowest_rank_median_step_s``). A file, not a collective: nothing
    more for the ranks to agree on at shutdown."""
    out.mkdir(parents=True, exist_ok=True)
    median = log.median_step_s if log.step_times_s else None
    record = {
        "median_step_s": median,
        "step_times_s": log.step_times_s,
        "step_ends_s": log.step_ends_s,
        "peak_device_bytes": peak_device_bytes(),
    }
    write_atomic(out / f"rank-{dist.get_rank()}.json", json.dumps(record).encode())


def slowest_rank_median_step_s(out: str | Path) -> float | None:
    """The largest of the ranks' median steps that ``finish`` wrote to ``out``."""
    medians = [json.loads(p.read_text())["median_step_s"] for p in Path(out).glob("rank-*.json")]
    return max((m for m in medians if m is not None), default=None)


def steady_step_s(out: str | Path) -> float | None:
    """The job's step time while every rank runs its timed steps: the largest over ranks of the median of its
    steps that lie in the window W = [latest end of a rank's warm-up, earliest end of a rank's last step]::

        W = [max_r e_r(WARMUP_STEPS − 1), min_r e_r(n − 1)]     step i of rank r counts if e_r(i) − t_r(i) ≥ W₀, e_r(i) ≤ W₁

    Ranks that meet every step (a collective, a pipeline's transfers) keep together, and this is their median
    step (``slowest_rank_median_step_s``). Ranks that share nothing in a step (a replicated TP layout) drift apart,
    and where they share cores a rank that starts early or ends late has a core to itself: those steps are not
    the pace the job keeps (4 ranks on 2 cores, GPT example, 2026-11-29, ``benchmarks/results/cpu-ranks-2026-11-29/
    steady.out.txt``: tp 4 at micro-batch 8 read 62.5 ms by the slowest median and 70.1 ms here, dp 4 alike within
    3 %). Falls back to the slowest rank's median where a rank has no step in W or a record has no step ends."""
    records = [json.loads(p.read_text()) for p in Path(out).glob("rank-*.json")]
    ends = [r.get("step_ends_s") or [] for r in records]
    if not records or any(len(e) <= WARMUP_STEPS or len(e) != len(r["step_times_s"]) for e, r in zip(ends, records)):
        return slowest_rank_median_step_s(out)
    first, last = max(e[WARMUP_STEPS - 1] for e in ends), min(e[-1] for e in ends)
    inside = [
        [t for t, e in zip(r["step_times_s"][WARMUP_STEPS:], end[WARMUP_STEPS:]) if e - t >= first and e <= last]
        for r, end in zip(records, ends)
    ]
    if not all(inside):
        return slowest_rank_median_step_s(out)
    return max(statistics.median(steps) for steps in inside)


def _write_metrics(out: Path, log: StepLog) -> None:
    """Through a fresh temporary (``write_atomic``): never a name another file could stand at."""
    out.mkdir(parents=True, exist_ok=True)
    median = log.median_step_s if log.step_times_s else None  # a resumed run may have no steps left
    metrics = {
        "losses": log.losses,
        "step_times_s": log.step_times_s,
        "median_step_s": median,
        "lrs": log.lrs,
        "grad_norms": log.grad_norms,
    }
    write_atomic(out / "metrics.json", json.dumps(metrics, indent=1).encode())
