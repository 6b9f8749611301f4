"""Published, measured GPU training runs, each priced through ``autoshard estimate`` as it was run.

    python benchmarks/bench_published.py            # every row: markdown table, writes benchmarks/results/published.json
    python benchmarks/bench_published.py --json     # the same results as JSON on stdout
    python benchmarks/bench_published.py --no-float8-layouts   # skip the bf16 layouts of float8 runs (the slow 405B ones)
    python benchmarks/bench_published.py --fit      # the Grand Teton matmul efficiency the fitting rows imply

A row is one published measurement: where it is published, the configuration that ran (model shape,
GPUs, dp / tp / pp / cp, ZeRO or FSDP, micro-batch, global batch, sequence length, recompute, pipeline
schedule), the hardware it ran on, what was measured (tokens/s per GPU or seconds per iteration, peak
memory per GPU where published), what a program needs to reproduce it, and whether autoshard can emit
that program today. A row autoshard can write down carries its ``autoshard estimate`` arguments
(``Run.estimate_args``, the pattern of ``benchmarks/bench_megatron.py``, whose ``Row`` records the
Megatron-LM rows here are built from); one it cannot carries the reason. Each command runs as a user
runs it: a subprocess of the ``autoshard`` CLI reading its ``--json`` (the same arguments go through
``autoshard.cli.main`` in-process in tests/test_published_rows.py). One constant is fitted, on the declared
fitting rows only (``FIT``, ``fit_matmul_efficiency``): the matmul efficiency of torchtitan's 500 W Grand Teton
H100s, which no measurement here can reach (the power cap sets a GEMM's clock; ``--fit`` re-derives it).

What a row's prediction means (``Run.status``):

    as run       the run as it ran: the configuration and the runtime the cost model prices (autoshard's
                 eager bf16 program for torchtitan's eager FSDP rows, its compiled one (``--compile on``) for
                 the bf16 torch.compile FSDP rows and the async-TP benchmark's bf16 FSDP x TP rows (with
                 ``--async-tp on`` where the run had it, and ``--compile-loss`` as the run's torchtitan compiled its
                 loss: ``COMPILED_LOSS_BY_SOURCE``), with torchao's float8 linears (``--float8 tensorwise`` or
                 ``rowwise``, ``cost.float8``) for the float8 FSDP rows; ``--runtime megatron-lm`` for
                 Megatron-LM's). Only these rows make the headline error.
    async TP     the run as it ran save async TP inside pipeline stages, which autoshard's programs do not have
                 (``ir.decisions.async_tp_refusal``: there TP's collectives are traced custom ops, which inductor's
                 micro-pipeline pass does not match); priced as autoshard's compiled program with the rest of the
                 run (float8 linears, loss parallelism), TP's collectives exposed, so its time is not the run's.
    compile      the configuration under torch.compile, with what autoshard's programs would not compile; priced
                 as autoshard's eager program (with its float8 linears where the run had them, beside TP and
                 pipeline stages too, and loss parallelism where the run had it and autoshard emits it:
                 ``loss_parallel_emitted``). No row holds it today (compiled blocks beside cp inside pipeline stages
                 are emitted since 2026-12-02).
    float8       the run used float8 matmuls (torchao) in a layout autoshard emits no float8 for
                 (``ir.decisions.float8_runs``: expert parallelism); the bf16 layout is priced for reference
                 (memory is close: torchao's table moves 0.1 GiB between bf16 and float8), its time is not a
                 prediction of the run. No row holds it today.
    not priced   no command: the reason says why (hardware not described, ...).

Published time → step time: torchtitan logs ``tps`` = tokens a data-parallel rank saw / (seconds ·
cp·tp·pp) (torchtitan train.py at 9dec370: ``ntokens_since_last_log / (time_delta ·
non_data_parallel_size)``), so step = global batch · seq / (GPUs · tps); its memory is
``max_reserved`` GiB (the caching allocator's reserve, which autoshard's peak does not model).
Megatron-LM rows: ``benchmarks/bench_megatron.py`` (SC21 TFLOP/s per GPU → seconds; Korthikanti et al.
2022 seconds).

A future fit may use ``FIT`` (at most a third of the rows; torchtitan's two eager bf16 8B rows are
always held out); every other priced row is held out. No fit has been made.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_megatron import ROWS as MEGATRON_ROWS  # noqa: E402
from benchmarks.bench_megatron import SEQ as MEGATRON_SEQ  # noqa: E402
from benchmarks.bench_megatron import Row as MegatronRow  # noqa: E402
from benchmarks.bench_megatron import autoshard_command  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "published.json"
GRAND_TETON = "benchmarks/clusters/grand_teton_h100.yaml"  # relative to ROOT, where the commands run
H200 = "benchmarks/clusters/h200_whitefiber.yaml"
LLAMA = "benchmarks/llama3.py"
STATUSES = ("as run", "async TP", "compile", "float8", "not priced")

TT_2412 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (at b5bcd76; runs at torchtitan 9dec370)"
TT_ASYNC = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (at b5bcd76)"
TT_H200 = "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (at b5bcd76)"
TORCHAO = "pytorch/ao torchao/float8/README.md, 'e2e training benchmarks' (at 49cb18a; moved to the docs since)"
# Whether the torchtitan a source's runs used compiled its loss (--compile-loss): torchtitan compiles the loss under
# --training.compile since its commit bbb1b616e (2025-04-02; components/loss.py build_cross_entropy_loss). The
# December 2024 runs (9dec370) predate it; the async-TP benchmark (820504e, 2025-06-13) and the H200 runs (e7c0cae,
# 2025-06-13) have it; torchao's table names torchtitan 0.0.2 beside torch 2.7.0a0, a main-branch build from before
# torch 2.7's branch cut (March 2025), so a torchtitan from before the commit
COMPILED_LOSS_BY_SOURCE = {TT_2412: False, TT_ASYNC: True, TT_H200: True, TORCHAO: False}


@dataclass(frozen=True)
class Hardware:
    gpu: str
    memory: str  # per GPU: capacity, bandwidth
    power: str
    interconnect: str
    cluster: str | None  # the --cluster that describes it, None where autoshard has none


GRAND_TETON_HW = Hardware(
    "H100 (HBM2e variant, Grand Teton)",
    "96 GB HBM2e, 2.4 TB/s",
    "500 W (default limit)",
    "8 per host, NVLink all-to-all; RDMA 400 Gb/s per GPU",
    GRAND_TETON,
)
H100_UNSTATED_HW = Hardware(
    "H100 (variant not stated)",
    "not stated (preset: 80 GB HBM3, 3.35 TB/s)",
    "not stated",
    "8 GPUs, one node (torchao README)",
    "dgx-h100",
)
H200_HW = Hardware(
    "H200",
    "141 GB HBM3e, 4.8 TB/s (datasheet; the file does not say)",
    "not stated",
    "8 per host, NVLink; RDMA 400 Gb/s (Mellanox CX-7) per GPU",
    H200,
)
MI300X_HW = Hardware(
    "AMD MI300X", "192 GB HBM3 (datasheet; the README does not say)", "not stated", "8 GPUs, one node", None
)
SELENE_HW = Hardware(
    "A100 SXM 80GB (Selene, DGX A100)",
    "80 GB HBM2e, 2.0 TB/s",
    "not stated (A100 SXM TDP 400 W)",
    "NVSwitch, NVLink 3 300 GB/s per GPU; 8 x 200 Gb/s HDR IB per node",
    "dgx-a100-80gb",
)


@dataclass(frozen=True)
class Run:
    """One published measurement (module doc). ``args`` is the whole ``autoshard estimate`` argument list,
    or empty with ``reason`` saying why there is none."""

    name: str
    source: str
    model: str  # shape
    gpus: int
    dp: int
    tp: int
    pp: int
    cp: int
    sharding: str  # "FSDP (ZeRO-3)", "DDP (ZeRO-0)"
    micro_batch: int
    global_batch: int
    seq: int
    recompute: str  # as the source says it
    schedule: str
    hardware: Hardware
    needs: tuple[str, ...]  # what a program needs to reproduce the run
    emits: str  # whether autoshard can emit that program today
    status: str  # STATUSES
    reason: str = ""  # why the prediction is not of the run as run (or why there is none)
    tokens_per_gpu_s: float | None = None
    step_s: float | None = None  # published seconds per iteration (else from tokens_per_gpu_s)
    memory_gib: float | None = None
    args: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self):
        assert self.status in STATUSES, self.status
        assert self.dp * self.tp * self.pp * self.cp == self.gpus, self.name
        assert (self.tokens_per_gpu_s is None) != (self.step_s is None), self.name
        assert bool(self.args) == (self.status != "not priced"), self.name
        assert self.status == "as run" or self.reason, self.name

    @property
    def published_step_s(self) -> float:
        if self.step_s is not None:
            return self.step_s
        return self.global_batch * self.seq / (self.gpus * self.tokens_per_gpu_s)

    def estimate_args(self) -> list[str]:
        """The ``autoshard estimate`` arguments that price the row (``[]`` for a row autoshard cannot price)."""
        return list(self.args)

    def command_line(self) -> str:
        return shlex.join(["autoshard", *self.args]) if self.args else ""


def llama_args(
    factory: str,
    cluster: str,
    gpus: int,
    global_batch: int,
    seq: int,
    dp: int,
    tp: int,
    pp: int,
    cp: int,
    micro_batch: int,
    recompute: str,
    schedule: str = "none",
    cuts: tuple[int, ...] = (),
    virtual_stages: int = 1,
) -> tuple[str, ...]:
    """A torchtitan configuration as ``autoshard estimate`` arguments: FSDP = ZeRO-3 over dp (·cp), sequence
    parallelism with TP (torchtitan's TP plan shards the norms' sequence), layers cut where torchtitan cut."""
    args = [
        "estimate",
        f"{LLAMA}:{factory}",
        "--cluster",
        cluster,
        "--nodes",
        str(max(1, gpus // 8)),
        "--global-batch",
        str(global_batch),
        "--seq-len",
        str(seq),
        "--dp",
        str(dp),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--cp",
        str(cp),
        "--zero",
        "3",
        "--microbatch-size",
        str(micro_batch),
        "--recompute",
        recompute,
        "--schedule",
        schedule,
    ]
    if tp > 1:  # sequence parallelism, inside pipeline stages too, beside cp there as well
        args += ["--sequence-parallel", "on"]
    if virtual_stages > 1:
        args += ["--virtual-stages", str(virtual_stages)]
    if cuts:
        args += ["--stage-cuts", ",".join(map(str, cuts))]
    return (*args, "--json")


def loss_parallel_emitted(tp: int, pp: int, cp: int) -> bool:
    """Whether autoshard runs loss parallelism (``--loss-parallel on``: the cross-entropy on the output projection's
    vocabulary shards) on this mesh: with TP, with or without pipeline stages, beside context parallelism only
    inside them (``strategies.loss_parallel_refusal``). A run that had it is priced with it there."""
    return tp > 1 and (cp == 1 or pp > 1)


def torchtitan_cuts(layers: int, stages: int) -> tuple[int, ...]:
    """torchtitan's ``generate_split_points`` (9dec370): layers // stages each; the middle stages one more
    each while the remainder lasts (the first never), the last stage what is left."""
    base, extra = divmod(layers, stages)
    cuts, at = [], 0
    for i in range(stages - 1):
        if i > 0 and extra > 0:
            at, extra = at + base + 1, extra - 1
        else:
            at += base
        cuts.append(at)
    return tuple(cuts)


SHAPE = {  # benchmarks/llama3.py SHAPES (Dubey et al. 2024, Table 3)
    "llama3_8b": "Llama 3.1 8B: 32 layers, d 4096, 32 / 8 KV heads, FFN 14336, vocab 128256",
    "llama3_70b": "Llama 3.1 70B: 80 layers, d 8192, 64 / 8 KV heads, FFN 28672, vocab 128256",
    "llama3_405b": "Llama 3.1 405B: 126 layers, d 16384, 128 / 8 KV heads, FFN 53248, vocab 128256",
}
LAYERS = {"llama3_8b": 32, "llama3_70b": 80, "llama3_405b": 126}
SAC = "selective ('op': every other matmul output saved)"
EAGER_8B_REASON = "as run: eager bf16 FSDP2, torchtitan's 'op' selective AC as --recompute alternate"
ASYNC_TP_PP_REASON = (
    "async TP inside pipeline stages is not in autoshard's programs (there TP's collectives are traced custom ops, "
    "which inductor's micro-pipeline pass does not match; --async-tp on refuses --pp > 1): priced as run otherwise, "
    "each stage's blocks compiled beside TP with sequence and loss parallelism (--compile on), float8 tensorwise "
    "linears converted after the split (--float8 tensorwise), TP's collectives left exposed"
)
FLOAT8_8B_REASON = (
    "as run: float8 tensorwise (torchao, FSDP2 gathering float8 weights) with each block compiled (--compile on "
    "--float8 tensorwise), torchtitan's 'op' selective AC as --recompute alternate"
)
FLOAT8_CP1_REASON = "as run: float8 tensorwise with each block compiled, full AC, one rank per sequence"
FLOAT8_CP_REASON = (
    "as run: float8 tensorwise with each block compiled (the CP ring eager between its compiled graphs), full AC; "
    "head-tail chunks (torch's load-balanced causal ring, as torchtitan's), k and v all-gathered once"
)
FLOAT8_AO_REASON = (
    "as run: float8 {recipe} (torchao{gather}) with each block compiled, per-op SAC as --recompute alternate"
)
# float8 techniques autoshard emits (ir.decisions.float8_runs: any tp and pp; FSDP2's float8 all-gather outside
# pipeline stages, Decisions.float8_all_gather)
FLOAT8_EMITTED = (
    "float8 (tensorwise)",
    "float8 (rowwise)",
    "float8 (tensorwise + fp8 all-gather)",
    "float8 tensorwise",
    "float8 rowwise",
)
FLOAT8_ALL_GATHER = ("float8 all-gather",)
ASYNC_TP_CP_PP_REASON = (
    "async TP inside pipeline stages is not in autoshard's programs (see the cp 1 row): priced as run otherwise, "
    "each stage's blocks compiled (--compile on) with the CP ring eager between their graphs (head-tail chunks), "
    "TP with sequence and loss parallelism, float8 tensorwise linears converted after the split, TP's collectives "
    "left exposed"
)
ASYNC_TP_AS_RUN = {  # the async-TP benchmark's bf16 rows, without and with async TP
    False: "as run: FSDP2 x TP with sequence and loss parallelism, each block compiled (--compile on) beside "
    "torchtitan's AC (70B full, 8B 'op' selective as --recompute alternate)",
    True: "as run: the same with async TP (--async-tp on: each sequence-parallel collective overlapped with its "
    "matmul, cost.async_tp)",
}
COMPILED_8B_REASON = (
    "as run: bf16 FSDP2 with each block compiled (--compile on), torchtitan's 'op' selective AC as --recompute "
    "alternate"
)
FSDP = "FSDP2 (ZeRO-3)"


def _tt(
    name,
    source,
    factory,
    gpus,
    dp,
    tp,
    pp,
    cp,
    micro,
    global_batch,
    seq,
    recompute,
    schedule,
    techniques,
    tps,
    mem,
    status,
    reason="",
    *,
    hardware=GRAND_TETON_HW,
    cluster=GRAND_TETON,
    cuts=(),
    v=1,
    extra_needs=(),
    compiled=False,
    float8=None,
    async_tp=False,
) -> Run:
    needs = tuple(techniques) + tuple(extra_needs)
    priced = status != "not priced"
    # torchtitan's 'op' selective AC is autoshard's --recompute alternate (runtime.selective: the same policy)
    ar = "alternate" if recompute.startswith("selective") else "full"
    sched = schedule if pp > 1 else "none"
    args = (
        llama_args(factory, cluster, gpus, global_batch, seq, dp, tp, pp, cp, micro, ar, sched, cuts, v)
        if priced
        else ()
    )
    lp = "loss parallel" in techniques and loss_parallel_emitted(tp, pp, cp)
    args = _with_flags(args, "--loss-parallel", "on") if lp and args else args
    args = _with_compile(args) if compiled and args else args
    args = _with_flags(args, "--compile-loss", _compiled_loss(source, lp)) if compiled and args else args
    args = _with_flags(args, "--float8", float8) if float8 and args else args
    args = _with_flags(args, "--async-tp", "on") if async_tp and args else args
    emitted = (  # async TP SPMD only (ir.decisions.async_tp_refusal)
        ("FSDP2", "TP", "PP", "CP", "eager bf16", "torch.compile", *(("async TP",) if pp == 1 else ()))
        + FLOAT8_EMITTED
        + (FLOAT8_ALL_GATHER if pp == 1 else ())
        + (("loss parallel",) if lp else ())
    )
    missing = [t for t in needs if t not in emitted]
    emits = "yes" if not missing else "no: " + ", ".join(missing)
    return Run(
        name,
        source,
        SHAPE[factory],
        gpus,
        dp,
        tp,
        pp,
        cp,
        FSDP,
        micro,
        global_batch,
        seq,
        recompute,
        sched if pp > 1 else "none",
        hardware,
        needs,
        emits,
        status,
        reason,
        tokens_per_gpu_s=tps,
        memory_gib=mem,
        args=args,
    )


def _compiled_loss(source: str, loss_parallel: bool) -> str:
    """--compile-loss for a compiled row: on where its torchtitan compiled the loss (``COMPILED_LOSS_BY_SOURCE``),
    but beside loss parallelism, where autoshard runs the loss eager (``ir.decisions.compile_loss_refusal``; the
    async-TP benchmark's rows compiled it)."""
    compiled = [loss for prefix, loss in COMPILED_LOSS_BY_SOURCE.items() if source.startswith(prefix)]
    assert len(compiled) == 1, source
    return "on" if compiled[0] and not loss_parallel else "off"


def _with_compile(args: tuple[str, ...]) -> tuple[str, ...]:
    """``autoshard estimate`` arguments with ``--compile on`` before the closing ``--json``."""
    return _with_flags(args, "--compile", "on")


def _with_flags(args: tuple[str, ...], *flags: str) -> tuple[str, ...]:
    """``autoshard estimate`` arguments with ``flags`` before the closing ``--json``."""
    return (*args[:-1], *flags, args[-1])


def torchtitan_rows() -> list[Run]:
    rows = []
    # Tables 1 and 3: 8B, FSDP, local batch 2, selective AC ('op'), seq 8192 (train_configs/llama3_8b.toml)
    for table, gpus, figures in (
        ("Table 1", 8, ((5762, 82.4), (6667, 77.0), (8532, 76.8))),
        ("Table 3", 128, ((5605, 67.0), (6514, 62.0), (8380, 61.8))),
    ):
        (e_tps, e_mem), (c_tps, c_mem), (f_tps, f_mem) = figures
        common = (f"{TT_2412}, {table}", "llama3_8b", gpus, gpus, 1, 1, 1, 2, 2 * gpus, 8192, SAC, "none")
        rows += [
            _tt(f"tt-8b-{gpus}g-eager", *common, ("FSDP2", "eager bf16"), e_tps, e_mem, "as run", EAGER_8B_REASON),
            _tt(
                f"tt-8b-{gpus}g-compile",
                *common,
                ("FSDP2", "torch.compile"),
                c_tps,
                c_mem,
                "as run",
                COMPILED_8B_REASON,
                compiled=True,
            ),
            _tt(
                f"tt-8b-{gpus}g-fp8",
                *common,
                ("FSDP2", "torch.compile", "float8 (tensorwise)"),
                f_tps,
                f_mem,
                "as run",
                FLOAT8_8B_REASON,
                compiled=True,
                float8="tensorwise",
            ),
        ]
    # Table 2: 8B, FSDP + CP, compile + Float8, local batch 1, full AC
    for dp, cp, seq, tps, mem in (
        (8, 1, 32768, 3890, 83.9),
        (4, 2, 65536, 2540, 84.2),
        (2, 4, 131072, 1071, 84.0),
        (1, 8, 262144, 548, 84.5),
    ):
        rows.append(
            _tt(
                f"tt-8b-cp{cp}-{seq // 1024}k",
                f"{TT_2412}, Table 2",
                "llama3_8b",
                8,
                dp,
                1,
                1,
                cp,
                1,
                dp,
                seq,
                "full",
                "none",
                ("FSDP2", "CP", "torch.compile", "float8 (tensorwise)"),
                tps,
                mem,
                "as run",
                FLOAT8_CP1_REASON if cp == 1 else FLOAT8_CP_REASON,
                compiled=True,
                float8="tensorwise",
            )
        )
    # Table 4: 70B, FSDP 32 x TP 8, local batch 16, full AC, compile + Float8 (+ async TP)
    for async_tp, tps, mem in ((False, 829, 71.9), (True, 876, 67.6)):
        tech = ("FSDP2", "TP", "torch.compile", "float8 (tensorwise)", "loss parallel") + (("async TP",) * async_tp)
        rows.append(
            _tt(
                f"tt-70b-256g-fp8{'-asynctp' * async_tp}",
                f"{TT_2412}, Table 4",
                "llama3_70b",
                256,
                32,
                8,
                1,
                1,
                16,
                512,
                8192,
                "full",
                "none",
                tech,
                tps,
                mem,
                "as run",
                ASYNC_TP_AS_RUN[async_tp] + "; float8 tensorwise linears (torchao's float8 TP styles)",
                compiled=True,
                async_tp=async_tp,
                float8="tensorwise",
            )
        )
    # Table 5: 405B, FSDP 8 x TP 8 x PP 8, local batch 32 = 8 micro-batches of 4 (9dec370: microbatches default
    # to the pp degree), layers split by torchtitan's generate_split_points (1 stage per rank for 1F1B, 2 for
    # interleaved), full AC, compile + Float8 + async TP
    for sched, v, tps, mem in (("1f1b", 1, 100, 82.5), ("interleaved-1f1b", 2, 128, 72.7)):
        rows.append(
            _tt(
                f"tt-405b-512g-{sched}",
                f"{TT_2412}, Table 5",
                "llama3_405b",
                512,
                8,
                8,
                8,
                1,
                4,
                256,
                8192,
                "full",
                sched,
                ("FSDP2", "TP", "PP", "torch.compile", "float8 (tensorwise)", "async TP", "loss parallel"),
                tps,
                mem,
                "async TP",
                ASYNC_TP_PP_REASON,
                cuts=torchtitan_cuts(126, 8 * v),
                v=v,
                compiled=True,
                float8="tensorwise",
            )
        )
    # Table 6: 405B, TP 8 x PP 8 (1F1B) x FSDP x CP, local batch 8 = 8 micro-batches of 1, full AC
    for dp, cp, seq, tps, mem in (
        (8, 1, 32768, 76, 75.3),
        (4, 2, 65536, 47, 75.9),
        (2, 4, 131072, 31, 77.1),
        (1, 8, 262144, 16, 84.9),
    ):
        rows.append(
            _tt(
                f"tt-405b-cp{cp}-{seq // 1024}k",
                f"{TT_2412}, Table 6",
                "llama3_405b",
                512,
                dp,
                8,
                8,
                cp,
                1,
                8 * dp,
                seq,
                "full",
                "1f1b",
                ("FSDP2", "TP", "PP", "CP", "torch.compile", "float8 (tensorwise)", "async TP", "loss parallel"),
                tps,
                mem,
                "async TP",
                ASYNC_TP_PP_REASON if cp == 1 else ASYNC_TP_CP_PP_REASON,
                cuts=torchtitan_cuts(126, 8),
                compiled=True,
                float8="tensorwise",
            )
        )
    # async TP benchmark (June 2025): tokens/s per GPU, no memory published; compile + full AC (70B) / per-op SAC (8B)
    for model, gpus, dp, tp, local, ac, figures in (
        (
            "llama3_70b",
            256,
            32,
            8,
            16,
            "full",
            {"bf16": (597.3, 652.4), "float8 tensorwise": (809.8, 942.4), "float8 rowwise": (599.6, 624.8)},
        ),
        (
            "llama3_8b",
            64,
            8,
            8,
            12,
            SAC,
            {"bf16": (4378, 4809.4), "float8 tensorwise": (5078.1, 5570.1), "float8 rowwise": (3708.5, 3914.9)},
        ),
    ):
        size = model.split("_")[1]
        for quant, pair in figures.items():
            for async_tp, tps in zip((False, True), pair):
                tech = (
                    ("FSDP2", "TP", "torch.compile", "loss parallel")
                    + ((quant,) if quant != "bf16" else ())
                    + (("async TP",) * async_tp)
                )
                status = "as run"
                reason = ASYNC_TP_AS_RUN[async_tp] + (f"; float8 {quant.split()[1]} linears" if quant != "bf16" else "")
                q = {"bf16": "bf16", "float8 tensorwise": "fp8tw", "float8 rowwise": "fp8rw"}[quant]
                rows.append(
                    _tt(
                        f"tt-async-{size}-{gpus}g-{q}{'-asynctp' if async_tp else '-tp'}",
                        TT_ASYNC,
                        model,
                        gpus,
                        dp,
                        tp,
                        1,
                        1,
                        local,
                        dp * local,
                        8192,
                        ac,
                        "none",
                        tech,
                        tps,
                        None,
                        status,
                        reason,
                        compiled=True,
                        async_tp=async_tp,
                        float8={"float8 tensorwise": "tensorwise", "float8 rowwise": "rowwise"}.get(quant),
                    )
                )
    # H200 (Trainy on WhiteFiber, June 2025): 8B FSDP, local batch 2, compile + float8 with float8 all-gather
    for nodes, tps, mem in ((4, 10938, 47.96), (8, 10753, 46.97)):
        gpus = 8 * nodes
        rows.append(
            _tt(
                f"h200-8b-{gpus}g-fp8",
                TT_H200,
                "llama3_8b",
                gpus,
                gpus,
                1,
                1,
                1,
                2,
                2 * gpus,
                8192,
                SAC,
                "none",
                ("FSDP2", "torch.compile", "float8 (tensorwise)", "float8 all-gather"),
                tps,
                mem,
                "as run",
                FLOAT8_8B_REASON + "; H200 from its datasheet (benchmarks/clusters/h200_whitefiber.yaml)",
                hardware=H200_HW,
                cluster=H200,
                compiled=True,
                float8="tensorwise",
            )
        )
    return rows


def torchao_rows() -> list[Run]:
    """torchao's float8 training table: torchtitan Llama3-8b, FSDP2, batch 1, seq 8192, compile, per-op SAC."""
    rows = []
    for gpu, hw, cluster, table in (
        (
            "h100",
            H100_UNSTATED_HW,
            "dgx-h100",
            (("bf16", 6150, 47.65), ("fp8 tensorwise + fp8 all-gather", 7689.5, 47.77), ("fp8 rowwise", 6768, 47.79)),
        ),
        (
            "mi300x",
            MI300X_HW,
            None,
            (
                ("bf16", 5376.5, 39.09),
                ("fp8 tensorwise + fp8 all-gather", 6166.0, 39.07),
                ("fp8 rowwise_with_gw_hp", 6100.0, 39.32),
                ("fp8 rowwise", 5891.0, 39.32),
            ),
        ),
    ):
        for quant, tps, mem in table:
            q = quant.split(" +")[0].replace(" ", "-")
            fp8 = quant != "bf16"
            tech = ("FSDP2", "torch.compile") + ((f"float8 ({quant.removeprefix('fp8 ')})",) if fp8 else ())
            if cluster is None:
                status, reason = (
                    "not priced",
                    "AMD MI300X (ROCm): no cluster file here describes it" + ("; and float8" if fp8 else ""),
                )
            elif fp8:
                recipe = quant.split()[1]
                gather = ", FSDP2 gathering float8 weights" if "all-gather" in quant else ""
                status, reason = "as run", FLOAT8_AO_REASON.format(recipe=recipe, gather=gather)
            else:
                status, reason = "as run", COMPILED_8B_REASON
            rows.append(
                _tt(
                    f"ao-8b-{gpu}-{q}",
                    f"{TORCHAO} ({'NVIDIA H100' if gpu == 'h100' else 'AMD MI300x'})",
                    "llama3_8b",
                    8,
                    8,
                    1,
                    1,
                    1,
                    1,
                    8,
                    8192,
                    "selective (per-op SAC)",
                    "none",
                    tech,
                    tps,
                    mem,
                    status,
                    reason,
                    hardware=hw,
                    cluster=cluster or "-",
                    compiled=cluster is not None,
                    float8=quant.split()[1] if fp8 and cluster is not None else None,
                )
            )
    return rows


MEGATRON_SOURCES = {
    "numbers": "Narayanan et al. SC21, Table 1 (NUMBERS.md); configuration: NVIDIA/Megatron-LM examples/sc21/run_table_1.sh",
    "sc21": "Narayanan et al. SC21, Table 1; configuration: NVIDIA/Megatron-LM examples/sc21/run_table_1.sh",
    "k22": "Korthikanti et al. 2022 (arXiv 2205.05198), full recompute, as quoted by calculon-ai/calculon "
    "calculon/megatron/validation.py",
}


def megatron_run(row: MegatronRow) -> Run:
    """A ``benchmarks/bench_megatron.py`` row as a corpus row: its own ``estimate_args`` and published time."""
    return Run(
        f"megatron-{row.name}",
        MEGATRON_SOURCES[row.source],
        f"GPT ({row.factory}): {row.layers} layers, h {row.hidden}, vocab 51200",
        row.gpus,
        row.dp,
        row.tp,
        row.pp,
        1,
        "DDP (ZeRO-0)",
        row.micro_batch,
        row.global_batch,
        MEGATRON_SEQ,
        "full",
        row.schedule + (f" (v = {row.virtual_stages})" if row.virtual_stages > 1 else ""),
        SELENE_HW,
        ("Megatron-LM runtime: fp16 weights and gradients, fused kernels, attention scores through HBM",),
        "the layout yes (autoshard's eager bf16 program); Megatron-LM's runtime no",
        "as run",
        "priced with --runtime megatron-lm (the runtime that ran)",
        step_s=row.published_s,
        args=tuple(row.estimate_args()),
    )


def all_rows() -> tuple[Run, ...]:
    return (*torchtitan_rows(), *torchao_rows(), *(megatron_run(r) for r in MEGATRON_ROWS))


ROWS = all_rows()
BY_NAME = {r.name: r for r in ROWS}
HELD_OUT_ALWAYS = ("tt-8b-8g-eager", "tt-8b-128g-eager")
# The fitting set: the three Megatron-LM rows NUMBERS.md gave to calibrate the A100 preset (already used to
# build it) and the bf16 torch.compile runs. One constant is fitted on it (``fit_matmul_efficiency``): the Grand
# Teton cluster file's matmul efficiency, on GRAND_TETON_FIT. Everything else is held out.
FIT = (
    "megatron-1.7B",
    "megatron-18.4B",
    "megatron-145.6B",
    "tt-8b-8g-compile",
    "tt-8b-128g-compile",
    "ao-8b-h100-bf16",
    "tt-async-70b-256g-bf16-tp",
    "tt-async-8b-64g-bf16-tp",
)


GRAND_TETON_FIT = ("tt-8b-8g-compile", "tt-8b-128g-compile")  # the as-run fitting rows on the Grand Teton file
FIT_PROBES = (0.8, 0.5)  # two matmul efficiencies each fitting row is priced at


def fit_matmul_efficiency(rows: tuple[str, ...] = GRAND_TETON_FIT) -> tuple[float, dict[str, float]]:
    """The Grand Teton file's matmul efficiency η that the fitting rows' published steps imply, and each row's.

    A step priced at η is t(η) = a + b/η (matmuls and attention scale with 1/η; the memory-bound kernels,
    the host and exposed communication do not), so two prices at η₁, η₂ give a and b, and the row's
    η = b / (t_published − a). The file takes their mean, rounded to 3 digits."""
    import tempfile

    text = (ROOT / GRAND_TETON).read_text()
    implied = {}
    with tempfile.TemporaryDirectory() as folder:
        clusters = []
        for eta in FIT_PROBES:
            path = Path(folder) / f"eta{eta}.yaml"
            path.write_text(re.sub(r"(?m)^  matmul_efficiency: .*$", f"  matmul_efficiency: {eta}", text))
            clusters.append(str(path))
        for name in rows:
            run = BY_NAME[name]
            args = run.estimate_args()
            at = args.index("--cluster") + 1
            t1, t2 = (run_estimate([*args[:at], c, *args[at + 1 :]])[0]["predicted"]["step_time_s"] for c in clusters)
            b = (t2 - t1) / (1 / FIT_PROBES[1] - 1 / FIT_PROBES[0])
            a = t1 - b / FIT_PROBES[0]
            implied[name] = b / (run.published_step_s - a)
    return round(sum(implied.values()) / len(implied), 3), implied


def run_estimate(args: list[str]) -> tuple[dict, float]:
    """The plan JSON ``autoshard estimate`` prints for ``args``, and the command's wall time. A configuration that
    does not fit its devices exits 1 with its plan printed: kept, with ``fits`` false and the CLI's line."""
    start = time.perf_counter()
    proc = subprocess.run([*autoshard_command(), *args], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode == 1 and "does not fit" in proc.stderr and proc.stdout.strip():
        return json.loads(proc.stdout) | {"fits": False, "fit_note": proc.stderr.strip().splitlines()[-1]}, wall
    if proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(['autoshard', *args])}` exited {proc.returncode}: {proc.stderr.strip()}")
    return json.loads(proc.stdout) | {"fits": True}, wall


def inputs_key(command: str) -> str:
    """What a row's prediction depends on besides its command: sha256 of autoshard's source and of every file the
    command names (a model file, a cluster file, an ``hf:DIR``'s config.json), so ``--reuse`` keeps a prediction only
    where a fresh run would give the same."""
    from autoshard.passes.capturing.capture_cache import autoshard_source_hash

    h = hashlib.sha256(autoshard_source_hash().encode())
    for word in shlex.split(command)[1:]:
        path = ROOT / (word.removeprefix("hf:") + "/config.json" if word.startswith("hf:") else word.split(":")[0])
        if path.is_file():
            h.update(f"{word}\n".encode() + path.read_bytes())
    return h.hexdigest()


def result(run: Run, plan: dict | None, wall: float | None) -> dict:
    """The row's record, its prediction and errors (predicted / published − 1)."""
    out = {k: v for k, v in asdict(run).items() if k != "args"}
    out |= {
        "command": run.command_line(),
        "inputs": inputs_key(run.command_line()) if run.args else "",
        "published_step_s": run.published_step_s,
        "fit": run.name in FIT,
        "estimate_wall_s": wall,
    }
    if plan is None:
        return out
    p = plan["predicted"]
    step = p["step_time_s"]
    out |= {
        "predicted_step_s": step,
        "predicted_tokens_per_gpu_s": run.global_batch * run.seq / (run.gpus * step),
        "predicted_memory_gib": p["memory_peak_bytes_per_rank"] / 2**30,
        "predicted_parts_s": {k: p[k] for k in ("compute_s", "comm_exposed_s", "bubble_s")},
        "decisions": plan["decisions"],
        "fits": plan["fits"],
        "fit_note": plan.get("fit_note", ""),
        "step_error": step / run.published_step_s - 1,
    }
    return out


def fit_reserve(results: list[dict]) -> float:
    """max_reserved over the plan's peak: the mean of published / predicted memory over the fitting rows priced as
    run that publish memory (torchtitan logs ``max_reserved``, the caching allocator's reserve; a plan's peak is
    what is allocated, plus ``rank_memory.ALLOCATOR_SLACK``). Rounded to 3 digits; fitted on ``FIT`` rows only."""
    ratios = [
        r["memory_gib"] / r["predicted_memory_gib"]
        for r in results
        if r["fit"] and r["status"] == "as run" and r.get("memory_gib") and r.get("predicted_memory_gib")
    ]
    return round(sum(ratios) / len(ratios), 3) if ratios else 1.0


def with_reserve(results: list[dict], reserve: float) -> list[dict]:
    """Each row's predicted reserve (its peak × ``reserve``) and the memory error against the published reserve."""
    out = []
    for r in results:
        r = dict(r)
        if r.get("predicted_memory_gib") is not None:
            r["predicted_reserved_gib"] = r["predicted_memory_gib"] * reserve
            if r.get("memory_gib") is not None:
                r["memory_error"] = r["predicted_reserved_gib"] / r["memory_gib"] - 1
        out.append(r)
    return out


def summary(results: list[dict], status: str) -> dict:
    """Held-out (not ``FIT``) MAPE of step time and of peak memory over the rows of ``status``; the worst row."""
    rows = [r for r in results if r["status"] == status and not r["fit"] and "step_error" in r]
    if not rows:
        return {"rows": 0}
    mem = [r for r in rows if "memory_error" in r]
    worst = max(rows, key=lambda r: abs(r["step_error"]))
    out = {
        "rows": len(rows),
        "step_mape": sum(abs(r["step_error"]) for r in rows) / len(rows),
        "worst_step": {"name": worst["name"], "error": worst["step_error"]},
        "memory_rows": len(mem),
    }
    if mem:
        worst_mem = max(mem, key=lambda r: abs(r["memory_error"]))
        out |= {
            "memory_mape": sum(abs(r["memory_error"]) for r in mem) / len(mem),
            "worst_memory": {"name": worst_mem["name"], "error": worst_mem["memory_error"]},
        }
    return out


def _f(x, fmt):
    return "–" if x is None else format(x, fmt)


def markdown(results: list[dict]) -> str:
    lines = [
        "| row | status | GPUs | dp·tp·pp·cp | mb / global × seq | AC | published tok/s/GPU | step s | GiB "
        "| predicted tok/s/GPU | step s | GiB (peak) | GiB (reserve) | step error | memory error | fit |",
        "|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        tps = r["tokens_per_gpu_s"] or r["global_batch"] * r["seq"] / (r["gpus"] * r["published_step_s"])
        lines.append(
            " | ".join(
                [
                    f"| {r['name']}",
                    r["status"],
                    str(r["gpus"]),
                    f"{r['dp']}·{r['tp']}·{r['pp']}·{r['cp']}",
                    f"{r['micro_batch']} / {r['global_batch']} × {r['seq']}",
                    r["recompute"].split(" ")[0],
                    f"{tps:,.0f}",
                    f"{r['published_step_s']:.2f}",
                    _f(r["memory_gib"], ".1f"),
                    _f(r.get("predicted_tokens_per_gpu_s"), ",.0f"),
                    _f(r.get("predicted_step_s"), ".2f"),
                    _f(r.get("predicted_memory_gib"), ".1f"),
                    _f(r.get("predicted_reserved_gib"), ".1f"),
                    _f(r.get("step_error"), "+.1%"),
                    _f(r.get("memory_error"), "+.1%"),
                    "fit" if r["fit"] else "",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def summary_lines(sums: dict) -> list[str]:
    out = []
    for status, s in sums.items():
        if not s["rows"]:
            continue
        line = (
            f"{status} (held out, {s['rows']} rows): step-time MAPE {s['step_mape']:.1%}, worst "
            f"{s['worst_step']['name']} {s['worst_step']['error']:+.1%}"
        )
        if s.get("memory_rows"):
            line += (
                f"; reserved-memory MAPE {s['memory_mape']:.1%} over {s['memory_rows']} rows, worst "
                f"{s['worst_memory']['name']} {s['worst_memory']['error']:+.1%}"
            )
        out.append(line)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of markdown")
    parser.add_argument(
        "--no-float8-layouts",
        action="store_true",
        help="do not price the bf16 layouts of float8 runs (the 405B ones take a minute each)",
    )
    parser.add_argument("-o", "--output", type=Path, default=RESULTS, help="raw results (default: %(default)s)")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep the output file's predictions of rows whose command and inputs (autoshard's source, the files the "
        "command names) are unchanged (inputs_key); price the rest",
    )
    parser.add_argument(
        "--rows",
        nargs="+",
        metavar="NAME",
        help="price only these rows; keep every other row's prediction (and its inputs key) from the output file",
    )
    parser.add_argument(
        "--fit",
        action="store_true",
        help="print the Grand Teton file's matmul efficiency the fitting rows imply (fit_matmul_efficiency) and stop",
    )
    args = parser.parse_args(argv)
    if args.fit:
        eta, implied = fit_matmul_efficiency()
        print(json.dumps({"matmul_efficiency": eta, "implied_by_row": implied}, indent=2))
        return
    plans: dict[tuple[str, ...], tuple[dict, float]] = {}  # one estimate per distinct command
    kept: dict[str, str] = {}  # --rows: the inputs key of each row kept from the output file, by name
    if (args.reuse or args.rows) and args.output.exists():
        for old in json.loads(args.output.read_text())["rows"]:
            if args.rows and old["name"] not in args.rows:
                kept[old["name"]] = old.get("inputs", "")
            reused = args.reuse and old.get("inputs") == inputs_key(old.get("command") or "")
            if old.get("command") and "predicted_step_s" in old and (reused or old["name"] in kept):
                plan = {
                    "predicted": {
                        "step_time_s": old["predicted_step_s"],
                        "memory_peak_bytes_per_rank": old["predicted_memory_gib"] * 2**30,
                        **old["predicted_parts_s"],
                    },
                    "decisions": old["decisions"],
                    "fits": old["fits"],
                    "fit_note": old["fit_note"],
                }
                plans[tuple(shlex.split(old["command"])[1:])] = (plan, old["estimate_wall_s"])
    results = []
    for run in ROWS:
        plan = wall = None
        if run.args and not (args.no_float8_layouts and run.status == "float8"):
            if run.args not in plans:
                try:
                    plans[run.args] = run_estimate(run.estimate_args())
                except RuntimeError as e:  # recorded with the row; the benchmark exits 1 at the end
                    plans[run.args] = ({"error": str(e)}, None)
                print(
                    f"{run.name} ({_f(plans[run.args][1], '.1f')} s): {run.command_line()}", file=sys.stderr, flush=True
                )
            plan, wall = plans[run.args]
        if plan is not None and "error" in plan:
            results.append(result(run, None, None) | {"error": plan["error"]})
        else:
            results.append(result(run, plan, wall) | ({"inputs": kept[run.name]} if run.name in kept else {}))
    reserve = fit_reserve(results)
    results = with_reserve(results, reserve)
    sums = {status: summary(results, status) for status in ("as run", "async TP", "compile")}
    import torch

    doc = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "command": shlex.join(
            ["python", "benchmarks/bench_published.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "fit": list(FIT),
        "reserved_over_peak": reserve,
        "summary": sums,
        "rows": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(doc, indent=1) + "\n")
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(markdown(results))
        print()
        print(f"reserve: max_reserved / plan peak = {reserve} (fitted on the fitting rows that publish memory)")
        for line in summary_lines(sums):
            print(line)
    failed = [r for r in results if "error" in r]
    for r in failed:
        print(f"{r['name']}: {r['error']}", file=sys.stderr)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
