"""Per-step log lines on rank 0, and the metrics file ``autoshard verify`` reads."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from autoshard.ir.plan import write_atomic
from autoshard.runtime import faults

WARMUP_STEPS = 1  # the first step pays for allocation and lazy initialisation; throughput skips it


@dataclass
class StepLog:
    tokens_per_step: int
    is_main: bool
    log_every: int = 1
    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)  # each step's learning rate (the scheduler's)
    grad_norms: list[float | None] = field(default_factory=list)  # before clipping; None: the recipe does not clip
    _t0: float = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def end(self, step: int, loss: float, lr: float | None = None, grad_norm: float | None = None) -> None:
        """Step ``step`` is done: its loss, its learning rate and its gradient norm before clipping (None: not
        computed, the recipe does not clip)."""
        elapsed_s = time.perf_counter() - self._t0
        self.losses.append(loss)
        self.step_times_s.append(elapsed_s)
        if lr is not None:
            self.lrs.append(lr)
            self.grad_norms.append(grad_norm)
        if self.is_main and (step % self.log_every == 0):
            print(f"step {step:4d} | loss {loss:.4f} | {self.tokens_per_step / elapsed_s:10,.0f} tokens/s | "
                  f"{elapsed_s * 1e3:8.1f} ms" + (f" | lr {lr:.3e}" if lr is not None else "")
                  + (f" | grad norm {grad_norm:.4f}" if grad_norm is not None else ""), flush=True)
        faults.note_step(step)
        faults.inject("kill", step)
        faults.inject("hang", step)

    @property
    def median_step_s(self) -> float:
        timed = self.step_times_s[WARMUP_STEPS:] or self.step_times_s
        return statistics.median(timed)

    def summary(self) -> str:
        first, last = self.losses[0], self.losses[-1]
        peak = peak_device_bytes()
        return (f"done: loss {first:.4f} -> {last:.4f} over {len(self.losses)} steps; median step "
                f"{self.median_step_s * 1e3:.1f} ms, {self.tokens_per_step / self.median_step_s:,.0f} tokens/s"
                + (f"; peak {peak / 2**30:.2f} GiB allocated" if peak is not None else ""))


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
    if not metrics_out:
        return
    from autoshard.runtime import checkpoint  # DCP: imported by programs that write metrics or checkpoints only

    checkpoint.save_weights(Path(metrics_out) / WEIGHTS, model, optimizer, mesh)
    if dist.get_rank() == 0:
        _write_metrics(Path(metrics_out), log)
    _write_rank_median(Path(metrics_out), log)
    dist.barrier()


def read_weights(metrics_out: str | Path) -> dict[str, torch.Tensor]:
    """The final weights a program wrote with ``--metrics-out``, whole, by the model's names, read in this
    process (``checkpoint.read_weights``)."""
    from autoshard.runtime import checkpoint

    return checkpoint.read_weights(Path(metrics_out) / WEIGHTS)


def _write_rank_median(out: Path, log: StepLog) -> None:
    """Every rank's own median step, ``rank-{r}.json``: the job's pace is its slowest rank's, and
    ranks that share no collective in a step (a replicated TP layout) drift apart, so rank 0's
    steps may not show it (``slowest_rank_median_step_s``). A file, not a collective: nothing
    more for the ranks to agree on at shutdown."""
    out.mkdir(parents=True, exist_ok=True)
    median = log.median_step_s if log.step_times_s else None
    record = {"median_step_s": median, "peak_device_bytes": peak_device_bytes()}
    write_atomic(out / f"rank-{dist.get_rank()}.json", json.dumps(record).encode())


def slowest_rank_median_step_s(out: str | Path) -> float | None:
    """The largest of the ranks' median steps that ``finish`` wrote to ``out``."""
    medians = [json.loads(p.read_text())["median_step_s"] for p in Path(out).glob("rank-*.json")]
    return max((m for m in medians if m is not None), default=None)


def _write_metrics(out: Path, log: StepLog) -> None:
    """Through a fresh temporary (``write_atomic``): never a name another file could stand at."""
    out.mkdir(parents=True, exist_ok=True)
    median = log.median_step_s if log.step_times_s else None  # a resumed run may have no steps left
    metrics = {"losses": log.losses, "step_times_s": log.step_times_s, "median_step_s": median, "lrs": log.lrs,
               "grad_norms": log.grad_norms}
    write_atomic(out / "metrics.json", json.dumps(metrics, indent=1).encode())
