"""Price the published Megatron-LM configurations with the cost model and compare iteration times.

    python benchmarks/bench_megatron.py              # the three rows of NUMBERS.md
    python benchmarks/bench_megatron.py --all        # and the held-out rows below

Each row is priced exactly as it was run: its mesh (dp = GPUs / (tp · pp)), micro-batch, full
recompute, 1F1B or interleaved 1F1B with Megatron's ``--num-layers-per-virtual-pipeline-stage``,
layers split evenly over the pp · v stages, DDP without ZeRO, on ``dgx-a100-80gb`` with GPUs / 8
nodes. The model is ``benchmarks/megatron_gpt.py`` (captured on meta at the published shape) and
the program is Megatron-LM's (``MEGATRON_LM``): fp16 weights and gradients with fp32 Adam state
(``memory.MEGATRON_MIXED``), attention scores through HBM (``compute.materialized_attention_s``),
pipeline boundaries scatter-gathered over the TP ranks (SC21 §4.1). Nothing is fitted per row.

Published iteration time: SC21 rows report TFLOP/s per GPU counted with NUMBERS.md's
F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)), so t = F / (GPUs · TFLOP/s); Korthikanti et al. 2022
report seconds per iteration directly.

Sources of the rows:
    numbers  /work/shared/reference/NUMBERS.md (Narayanan et al. SC21, Table 1): 1.7B, 18.4B, 145.6B
    sc21     the other rows of SC21 Table 1 (TFLOP/s per GPU as the paper prints them); the
             configurations of all SC21 rows from NVIDIA/Megatron-LM examples/sc21/run_table_1.sh
    k22      Korthikanti et al. 2022 (arXiv 2205.05198), full-recompute iteration times, as quoted
             by calculon-ai/calculon calculon/megatron/validation.py with their configurations
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autoshard.cost.hardware import load_cluster
from autoshard.cost.parts import StepParts
from autoshard.cost.step import price_parts
from autoshard.cost.tables import CostTables, Runtime
from autoshard.ir.decisions import Decisions
from autoshard.ir.graph import OpGraph
from autoshard.ir.plan import Mesh
from autoshard.passes.tp_layout import hand_tp_layout
from autoshard.pipeline import capture_graph

SEQ, VOCAB = 2048, 51200
CLUSTER = "dgx-a100-80gb"
MODEL_FILE = ROOT / "benchmarks" / "megatron_gpt.py"
MEGATRON_LM = Runtime.named("megatron-lm", load_cluster(CLUSTER))


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

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def flops(self) -> float:
        """F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) (NUMBERS.md; full recompute counted)."""
        b, l, h = self.global_batch, self.layers, self.hidden
        return 96 * b * SEQ * l * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * l * h))

    @property
    def published_s(self) -> float:
        return self.seconds if self.seconds is not None else self.flops / (self.gpus * self.tflops * 1e12)

    def config(self) -> Decisions:
        schedule = "none" if self.pp == 1 else "interleaved-1f1b" if self.virtual_stages > 1 else "1f1b"
        return Decisions(mesh=Mesh(dp=self.dp, tp=self.tp, pp=self.pp), zero_stage=0, microbatch_size=self.micro_batch,
                      num_microbatches=self.microbatches, recompute="full", schedule=schedule,
                      virtual_stages=self.virtual_stages)

    def cuts(self) -> tuple[int, ...] | None:
        """Megatron's even split: l / (pp · v) layers per stage."""
        stages = self.pp * self.virtual_stages
        return tuple(k * self.layers // stages for k in range(1, stages)) if stages > 1 else None


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


def capture(row: Row) -> OpGraph:
    return capture_graph(f"{MODEL_FILE}:{row.factory}")[1]


def predict(row: Row, graph: OpGraph) -> StepParts:
    """The row's iteration priced as published (module doc)."""
    cluster = load_cluster(CLUSTER, nodes=max(1, row.gpus // 8))
    tables = CostTables(graph, cluster, MEGATRON_LM)
    hand_tp_layout(tables, row.config())
    return price_parts(tables, row.config(), row.cuts())


def error(row: Row, parts: StepParts) -> float:
    """Predicted over published iteration time, minus one."""
    return parts.step_time_s / row.published_s - 1


def table(results: list[tuple[Row, StepParts]]):
    from rich.table import Table

    t = Table(title=f"Megatron-LM iterations on {CLUSTER}: published vs predicted (seconds)")
    for col in ("row", "src", "tp·pp·dp", "m", "v", "published", "predicted", "error", "fwd+bwd", "recompute",
                "grad acc", "optim", "TP comm", "p2p", "DP exposed", "bubble", "GiB/rank"):
        t.add_column(col, justify="left" if col in ("row", "src") else "right")
    for row, p in results:
        t.add_row(row.name, row.source, f"{row.tp}·{row.pp}·{row.dp}", str(row.microbatches), str(row.virtual_stages),
                  f"{row.published_s:.2f}", f"{p.step_time_s:.2f}", f"{error(row, p):+.1%}",
                  f"{p.forward_s + p.backward_s:.2f}", f"{p.recompute_s:.2f}", f"{p.grad_accumulation_s:.2f}",
                  f"{p.optimizer_s:.3f}", f"{p.tp_comm_s:.2f}", f"{p.p2p_s:.2f}", f"{p.dp_comm_exposed_s:.2f}",
                  f"{p.bubble_s:.2f}", f"{p.memory.peak_bytes / 2**30:.1f}")
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also the held-out rows (sc21, k22)")
    args = parser.parse_args()
    from rich.console import Console

    console = Console(width=180)
    results = []
    for row in ROWS if args.all else NUMBERS_ROWS:
        start = time.perf_counter()
        graph = capture(row)
        results.append((row, predict(row, graph)))
        console.log(f"{row.name}: captured and priced in {time.perf_counter() - start:.1f} s")
    console.print(table(results))
    worst = max(abs(error(r, p)) for r, p in results)
    console.print(f"largest |error| {worst:.1%} over {len(results)} rows")


if __name__ == "__main__":
    main()
