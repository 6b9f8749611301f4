"""Price the published Megatron-LM configurations through ``autoshard estimate`` and compare iteration times.

    python benchmarks/bench_megatron.py              # SC21 Table 1: the 3 docs/reference-numbers.md rows and 7 more
    python benchmarks/bench_megatron.py --all        # and the 4 Korthikanti et al. 2022 rows
    python benchmarks/bench_megatron.py --numbers    # the 3 docs/reference-numbers.md rows only
    python benchmarks/bench_megatron.py --attention written   # the model's attention written out, not SDPA

Every row is one command, printed with its result, run as a user runs it (a subprocess of the
``autoshard`` CLI; the capture cache makes a repeat a second or two)::

    autoshard estimate benchmarks/megatron_gpt.py:FACTORY --cluster dgx-a100-80gb --nodes GPUS/8
        --global-batch B --dp GPUS/(tp·pp) --tp T --pp P --zero 0 --microbatch-size b --recompute full
        --schedule none | 1f1b | interleaved-1f1b [--virtual-stages v] [--stage-cuts even]
        --runtime megatron-lm --json

that is, each configuration exactly as it was run: its mesh, micro-batch, full recompute, 1F1B or
interleaved 1F1B with Megatron's ``--num-layers-per-virtual-pipeline-stage`` (v = layers per pp rank /
that), layers split evenly over the pp·v stages (``--stage-cuts even``), DDP without ZeRO, on
``dgx-a100-80gb`` with GPUs / 8 nodes, priced as Megatron-LM runs it (``--runtime megatron-lm``:
``cost.tables.Runtime.named``). The model is ``benchmarks/megatron_gpt.py`` (captured on meta at the
published shape). Nothing is fitted per row; nothing here calls the cost model but the CLI.

Published iteration time: SC21 rows report TFLOP/s per GPU counted with docs/reference-numbers.md's
F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)), so t = F / (GPUs · TFLOP/s); Korthikanti et al. 2022
report seconds per iteration directly.

Sources of the rows:
    numbers  docs/reference-numbers.md (Narayanan et al. SC21, Table 1): 1.7B, 18.4B, 145.6B
    sc21     the other rows of SC21 Table 1 (TFLOP/s per GPU as the paper prints them); the
             configurations of all SC21 rows from NVIDIA/Megatron-LM examples/sc21/run_table_1.sh
    k22      Korthikanti et al. 2022 (arXiv 2205.05198), full-recompute iteration times, as quoted
             by calculon-ai/calculon calculon/megatron/validation.py with their configurations
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEQ, VOCAB = 2048, 51200
CLUSTER = "dgx-a100-80gb"
GPUS_PER_NODE = 8
MODEL_FILE = "benchmarks/megatron_gpt.py"  # relative to ROOT, where the commands run
TABLE_1 = ("numbers", "sc21")  # the sources that are SC21 Table 1 rows


@dataclass(frozen=True)
class Row:
    """One published configuration (module doc); ``tflops`` or ``seconds`` is what was published."""

    name: str
    source: str  # numbers | sc21 | k22
    factory: str  # in benchmarks/megatron_gpt.py
    layers: int
    hidden: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    micro_batch: int
    virtual_stages: int = 1  # layers per pp rank / --num-layers-per-virtual-pipeline-stage
    tflops: float | None = None
    seconds: float | None = None
    attention: str = "sdpa"  # sdpa | written (megatron_gpt.WrittenOutAttention: q @ kᵀ, masked_fill, softmax, @ v)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def flops(self) -> float:
        """F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) (docs/reference-numbers.md; full recompute counted)."""
        b, l, h = self.global_batch, self.layers, self.hidden  # noqa: E741 (the formula's l)
        return 96 * b * SEQ * l * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * l * h))

    @property
    def published_s(self) -> float:
        return self.seconds if self.seconds is not None else self.flops / (self.gpus * self.tflops * 1e12)

    @property
    def schedule(self) -> str:
        return "none" if self.pp == 1 else "interleaved-1f1b" if self.virtual_stages > 1 else "1f1b"

    def estimate_args(self) -> list[str]:
        """The ``autoshard estimate`` arguments that price this row as it was run (module doc)."""
        args = [
            f"{MODEL_FILE}:{self.factory}" + ("" if self.attention == "sdpa" else f"_{self.attention}"),
            "--cluster",
            CLUSTER,
            "--nodes",
            str(max(1, self.gpus // GPUS_PER_NODE)),
            "--global-batch",
            str(self.global_batch),
            "--dp",
            str(self.dp),
            "--tp",
            str(self.tp),
            "--pp",
            str(self.pp),
            "--zero",
            "0",
            "--microbatch-size",
            str(self.micro_batch),
            "--recompute",
            "full",
            "--schedule",
            self.schedule,
            "--sequence-parallel",
            "off",
        ]  # SC21: no SP
        if self.virtual_stages > 1:
            args += ["--virtual-stages", str(self.virtual_stages)]
        if self.pp > 1:
            args += ["--stage-cuts", "even"]  # Megatron-LM: l / (pp·v) layers per stage
        return ["estimate", *args, "--runtime", "megatron-lm", "--json"]


ROWS = (
    Row("1.7B", "numbers", "sc21_1_7b", 24, 2304, 1, 1, 32, 512, 16, tflops=137),
    Row("18.4B", "numbers", "sc21_18_4b", 40, 6144, 8, 1, 256, 1024, 8, tflops=135),
    Row("145.6B", "numbers", "sc21_145_6b", 80, 12288, 8, 8, 1536, 2304, 2, 2, tflops=148),
    Row("3.6B", "sc21", "sc21_3_6b", 30, 3072, 2, 1, 64, 512, 16, tflops=138),
    Row("7.5B", "sc21", "sc21_7_5b", 36, 4096, 4, 1, 128, 512, 16, tflops=142),
    Row("39.1B", "sc21", "sc21_39_1b", 48, 8192, 8, 2, 512, 1536, 4, tflops=138),
    Row("76.1B", "sc21", "sc21_76_1b", 60, 10240, 8, 4, 1024, 1792, 2, 3, tflops=140),
    Row("310.1B", "sc21", "sc21_310_1b", 96, 16384, 8, 16, 1920, 2160, 1, 2, tflops=155),
    Row("529.6B", "sc21", "sc21_529_6b", 105, 20480, 8, 35, 2520, 2520, 1, 3, tflops=163),
    Row("1008B", "sc21", "sc21_1008b", 128, 25600, 8, 64, 3072, 3072, 1, tflops=163),
    Row("22B", "k22", "k22_22b", 48, 6144, 8, 1, 8, 4, 4, seconds=1.42),
    Row("175B", "k22", "k22_175b", 96, 12288, 8, 8, 64, 64, 1, 3, seconds=18.13),
    Row("530B", "k22", "k22_530b", 105, 20480, 8, 35, 280, 280, 1, 3, seconds=49.05),
    Row("1T", "k22", "k22_1t", 128, 25600, 8, 64, 512, 512, 1, seconds=94.42),
)
NUMBERS_ROWS = tuple(r for r in ROWS if r.source == "numbers")
TABLE_1_ROWS = tuple(r for r in ROWS if r.source in TABLE_1)


def autoshard_command() -> list[str]:
    """The ``autoshard`` console script of this Python (its venv), else ``python -m autoshard.cli``."""
    script = Path(sys.executable).with_name("autoshard")
    return [str(script)] if script.exists() else [sys.executable, "-m", "autoshard.cli"]


def command_line(row: Row) -> str:
    """The row's command as a user types it."""
    return shlex.join(["autoshard", *row.estimate_args()])


def estimate(row: Row) -> dict:
    """The plan JSON ``autoshard estimate`` prints for the row (a failure ends the benchmark with its line)."""
    proc = subprocess.run([*autoshard_command(), *row.estimate_args()], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{row.name}: `{command_line(row)}` exited {proc.returncode}: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def error(row: Row, plan: dict) -> float:
    """Predicted over published iteration time, minus one."""
    return plan["predicted"]["step_time_s"] / row.published_s - 1


def summary(results: list[tuple[Row, dict]]) -> tuple[float, float]:
    """MAPE and the largest |error| over ``results``."""
    errors = [abs(error(r, p)) for r, p in results]
    return sum(errors) / len(errors), max(errors)


def table(results: list[tuple[Row, dict]]):
    from rich.table import Table

    t = Table(title=f"Megatron-LM iterations on {CLUSTER}: published vs `autoshard estimate --runtime megatron-lm` (s)")
    for col in (
        "row",
        "src",
        "tp·pp·dp",
        "m",
        "v",
        "published",
        "predicted",
        "error",
        "compute",
        "exposed comm",
        "bubble",
        "GiB/rank",
    ):
        t.add_column(col, justify="left" if col in ("row", "src") else "right")
    for row, plan in results:
        p = plan["predicted"]
        t.add_row(
            row.name,
            row.source,
            f"{row.tp}·{row.pp}·{row.dp}",
            str(row.microbatches),
            str(row.virtual_stages),
            f"{row.published_s:.2f}",
            f"{p['step_time_s']:.2f}",
            f"{error(row, plan):+.1%}",
            f"{p['compute_s']:.2f}",
            f"{p['comm_exposed_s']:.2f}",
            f"{p['bubble_s']:.2f}",
            f"{p['memory_peak_bytes_per_rank'] / 2**30:.1f}",
        )
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="also the Korthikanti et al. 2022 rows (k22)")
    which.add_argument("--numbers", action="store_true", help="only the three NUMBERS.md rows")
    parser.add_argument(
        "--attention",
        choices=("sdpa", "written"),
        default="sdpa",
        help="the model's attention: F.scaled_dot_product_attention, or written out as Megatron-LM's 2021 CoreAttention",
    )
    args = parser.parse_args()
    from rich.console import Console

    console = Console(width=200)
    rows = ROWS if args.all else NUMBERS_ROWS if args.numbers else TABLE_1_ROWS
    rows = [replace(row, attention=args.attention) for row in rows]
    results = []
    for row in rows:
        start = time.perf_counter()
        results.append((row, estimate(row)))
        console.print(f"{row.name} ({time.perf_counter() - start:.1f} s): {command_line(row)}", soft_wrap=True)
    console.print(table(results))
    table_1 = [x for x in results if x[0].source in TABLE_1]
    for name, subset in (("SC21 Table 1", table_1), ("all rows", results if len(table_1) < len(results) else [])):
        if subset:
            mape, worst = summary(subset)
            console.print(f"{name}: MAPE {mape:.1%}, largest |error| {worst:.1%} over {len(subset)} rows")


if __name__ == "__main__":
    main()
