"""``autoshard verify``: the emitted program trains like one process.

The program runs on local CPU ranks (gloo, fp32) for a few steps; a single process trains the
same model from the same seed on the same global batches with the same optimizer, twice:
in fp32 (the reference) and in float64 (the same fp32 initial weights and data, cast). A plan in
another precision (``--precision``) is judged against a reference in that precision
(``train_reference``'s ``precision`` and ``gathers_params``; docs/verify.md, Precision): "fp32" below
is then that precision.

Both train with the program's recipe (``ir.recipe.Recipe``: ``autoshard verify --recipe FILE`` and its flags,
written into the program as its ``RECIPE``): the same optimizer over the same weight-decay groups (found by
module type on the one process's whole model), the same learning-rate schedule, and clipping by the whole
model's gradient norm (``runtime.recipe.clip_grad_norm``, which in one process is torch's ``clip_grad_norm_``).

Tolerance: each run is judged against the reference's own rounding noise. Only the order of
fp32 sums differs between one process and several, so a correct parallel run is off the
exact (float64) run by about as much as the one-process fp32 run is. For every tensor W of
the final state (weights and buffers) and every step's loss L::

    noise(W)  = max |W_ref32 − W_ref64|                     the reference's own rounding
    excess(W) = max |W_par − W_ref64| / (K·noise(W) + FLOOR_ULPS·ε₃₂·max |W_ref64|)
    excess(L) = |L_par − L_ref64| / (K·|L_ref32 − L_ref64| + FLOOR_ULPS·ε₃₂·|L_ref64|)

and the run passes when every excess is at most 1 (K = NOISE_FACTOR, or more for tensor parallelism in 16
bits: ``noise_factor``; ε₃₂ = 2⁻²³). Why per
tensor, in the max norm: rounding noise is not spread evenly over a tensor's elements;
an element whose true gradient is about zero (a key projection's bias under softmax, a conv
bias before BatchNorm) gets rounding noise n as its whole gradient, and AdamW moves it by
lr·n/(|n| + eps), up to a sizeable part of a step, in both fp32 runs, so the largest
deviations of the two fp32 runs are two draws of the same thing. Per element, an element
the fp32 reference happened to round like float64 would fail by chance. The floor (a few
fp32 spacings at the tensor's scale) covers tensors that fp32 holds exactly in one process.
Integer tensors (BatchNorm's ``num_batches_tracked``) must be equal.

Why K = 50: the largest deviation of one run is one draw, and when a single element carries
it (a gradient near AdamW's eps, amplified) two draws can differ several-fold. Measured, the
parallel run's deviation over the one-process run's, worst tensor of 11 runs of 3 steps (DP,
TP, PP, ZeRO-1 with micro-batches, ZeRO-3; the example GPT, BERT, nanoGPT with dropout, a
transformer with a key bias, a BatchNorm CNN): median 2.2x, largest 12.3x (one element of a
conv weight before BatchNorm, ZeRO-1, 4 micro-batches; 2.1x and 3.4x with seeds 1 and 2).
A bug is far outside: one layer's update off by 1% of an AdamW step shows as 735x the noise
of that layer's tensor (excess 15); off by a whole step, ~10⁵x. Tensor parallelism in a 16-bit precision
rounds partial sums one process never makes, so K grows with tp there (``noise_factor``: 100 at tp 2).

16-bit plans: the layout in fp32 first. A 16-bit plan's tolerance is its precision's noise, its spacing 2¹²
(fp16) to 2¹⁵ (bf16) times fp32's, so a bug in its layout hides in it: on the bf16 tp 2 GPT, one rank's linear
outputs 1 % off, its optimizer step 1 % longer, its loss gradient doubled all sat within 100x the bf16 noise.
So ``verify`` runs such a plan twice (``fp32_twin``: bf16 and fp16 autocast, bf16-pure): its fp32 twin, the same
plan at precision fp32 (the same mesh, sharding, recompute and micro-batches), judged first at fp32's
tolerance, where the same bugs are 5·10³ to 2·10⁶ times the noise (docs/verify.md, Injected bugs); then the
16-bit run at its own precision's tolerance (K·noise of the one-process run in that precision), which checks
that the program runs the precision as one process does (its casts, gathers and loss scaling). A layout that
fails in fp32 fails the plan, whatever the 16-bit run shows (``TWIN_FAILED``). A plan whose model is 16-bit
itself (``bf16-params``) has no fp32 run and is judged in its precision alone.

Random and stateful layers. Each rank of a parallel program draws its own random numbers, so
both sides run with every random op at one value (``runtime.randomness``, by op, not by name):
dropout of any form, stochastic depth's ``bernoulli`` or ``rand``, ``torch.rand`` masks, ``randn``
noise, ``randint`` and ``randperm`` picks each return their expectation (or, for integers and orders,
a fixed one), in the program (``--fixed-randomness``) and in both one-process runs, so the noise the
parallel run is judged against is rounding alone. Before anything runs, ``check_randomness`` refuses,
naming the op and its module, a random op of the captured graph that has no such value, and a
model whose two forwards of one batch still differ (randomness from outside torch: Python's
``random``, NumPy). The plan lists the model's random ops (``model.random_ops``), and ``verify``'s
notes repeat them. BatchNorm in the
emitted program takes its statistics over the data-parallel group (``runtime.model.
sync_batch_norm``); with several micro-batches its statistics are those of each micro-batch
(the dp ranks' slices of it), so the reference then accumulates gradients over the same
micro-batches.

On failure the report names the first step whose loss is off, the tensors most off (by
excess), and a likely cause when the plan or the model suggests one (a loss averaged over a
data-dependent count, a tensor-parallel module, BatchNorm).

``compare`` without the float64 run (``exact=None``; the tensor- and pipeline-parallel drivers'
tests) uses a fixed tolerance: |Δloss| ≤ 1e-6 + 1e-5·|loss|, |Δw| ≤ 0.02·lr + 1e-5·|w| (2% of
an AdamW step, the largest noise measured on the example GPT).
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from autoshard.errors import AutoshardError
from autoshard.ir.decisions import FLOAT8_OFF, precision_policy
from autoshard.ir.names import op_name
from autoshard.ir.plan import Plan, in_fp32, without_async_tp, without_float8
from autoshard.ir.recipe import Recipe
from autoshard.launch import check_runs_here, run_torchrun, write_program
from autoshard.modelfile import ModelFile
from autoshard.passes.lowering.lower import layout
from autoshard.reference import (  # verify.train_reference: where the tests fix its random ops
    Run,
    gathers_params,
    reference_microbatches,
    train_reference,
)
from autoshard.runtime.data import (
    DataSource,
    global_batch,
    is_stream,
    open_dataset,
    split_microbatches,
    take_shard,
)
from autoshard.runtime.model import build_model, has_batch_norm, load_model_file, zero_dropout_rates
from autoshard.runtime.randomness import fixable, fixed_randomness
from autoshard.runtime.report import read_weights

NOISE_FACTOR = 50  # K: how many times the one-process rounding noise a parallel run may show (module doc)


FLOOR_ULPS = 4  # fp32 spacings at a tensor's scale that always pass


FP32_EPS = torch.finfo(torch.float32).eps


LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6  # fixed tolerance, without a float64 run


WEIGHT_RTOL, WEIGHT_ATOL_PER_LR = 1e-5, 0.02


DEFAULT_LR = 1e-3


TOP_TENSORS = 3


def tolerance_text(noise_factor: float = NOISE_FACTOR) -> str:
    return (
        f"each loss and tensor within {noise_factor:g}x the one-process run's own rounding in the plan's "
        f"precision (its distance from a float64 run) + {FLOOR_ULPS} fp32 spacings"
    )


def noise_factor(plan: Plan) -> float:
    """K for ``plan`` (module doc): NOISE_FACTOR, times 1 + ⌈log₂ tp⌉ where tensor parallelism sums 16-bit
    partial results. A row-parallel output (and a column-parallel input gradient) is then tp partial dot
    products each rounded to 16 bits, summed and rounded again: up to 1 + ⌈log₂ tp⌉ roundings where one
    process's output has one, an error one process does not make and its noise cannot show. Measured, dp 1 x tp 2
    bf16 autocast on the example GPT, 3 steps, seeds 0, 1, 2: worst tensor 53.5x, 49.7x and 13.6x the one-process
    noise (an fp32 run's worst is 12.3x, module doc). A bug in the layout can hide within that (one rank's linear
    outputs 1 % off: 64x); the plan's fp32 twin catches it (``fp32_twin``, module doc)."""
    policy = precision_policy(plan.precision)
    sixteen_bit = policy.autocast_dtype or policy.cast_dtype or policy.name in ("bf16-params", "fp16-params")
    if plan.mesh.tp > 1 and plan.tensor_parallel and sixteen_bit:
        return NOISE_FACTOR * (1 + math.ceil(math.log2(plan.mesh.tp)))
    return NOISE_FACTOR


@dataclass(frozen=True)
class TensorExcess:
    name: str
    excess: float  # the difference over what rounding allows; > 1 fails
    max_diff: float


@dataclass(frozen=True)
class VerifyReport:
    steps: int
    parallel_losses: list[float]
    reference_losses: list[float]
    max_loss_diff: float
    max_param_diff: float
    worst_param: str
    failure: str  # "" when the run agrees
    first_diverging_step: int | None = None
    most_off: tuple[TensorExcess, ...] = ()
    notes: tuple[str, ...] = ()  # what verify changed or kept about the model
    grad_norms: tuple[float | None, ...] = ()  # the program's, each step's before clipping (None: no clipping)
    noise_factor: float = NOISE_FACTOR  # K the run was judged with (``noise_factor``)
    twin: VerifyReport | None = None  # a 16-bit plan's fp32 twin's (``fp32_twin``), judged first

    @property
    def ok(self) -> bool:
        return not self.failure


def verify(
    plan: Plan, steps: int = 5, seed: int = 0, recipe: Recipe | None = None, data: DataSource = DataSource()
) -> VerifyReport:
    """Run the plan's program (random ops fixed) and the fp32 and float64 references; compare (module doc).
    ``recipe``: what both train with (None: ``Recipe()``, the programs' default); ``data``: what both train on
    (``--data``; by default the model file's dataset, else example_batch draws)."""
    recipe = recipe or Recipe()
    plan, twin_notes = float8_twin(plan)
    plan, async_notes = async_tp_twin(plan)
    twin_notes += async_notes
    model_file, notes = prepare(plan, steps, seed, data)
    notes = twin_notes + offload_notes(plan) + compile_notes(plan) + notes
    twin = fp32_twin(plan)
    with tempfile.TemporaryDirectory(prefix="autoshard-verify-") as tmp:
        parallel = run_parallel(plan, Path(tmp) / "plan", steps, seed, recipe, data)
        layout_run = run_parallel(twin, Path(tmp) / "fp32-twin", steps, seed, recipe, data) if twin else None
    return judge(plan, model_file, parallel, steps, seed, recipe, notes, data, layout_run)


def fp32_twin(plan: Plan) -> Plan | None:
    """The fp32 twin a 16-bit plan is verified through first (module doc, 16-bit plans): the same layout with
    precision fp32 (``ir.plan.in_fp32``); None for a plan in fp32, or whose model is 16-bit itself (``*-params``:
    its weights are built in that dtype, there is no fp32 run of it to compare with)."""
    policy = precision_policy(plan.precision)
    if not (policy.autocast_dtype or policy.cast_dtype):
        return None
    return in_fp32(plan)


def float8_twin(plan: Plan) -> tuple[Plan, tuple[str, ...]]:
    """What CPU ranks verify of a float8 plan: its twin, the same plan with float8 off (CPUs have no float8
    matmuls), and the note that says so; any other plan as it is. The twin checks the layout (mesh, sharding,
    recompute, micro-batches) the float8 program runs; float8's own numerics (torchao's scaled casts) are
    checked on a GPU against the same twin (benchmarks/gpu_session.sh)."""
    recipe = plan.decisions.float8
    if recipe == FLOAT8_OFF:
        return plan, ()
    twin = without_float8(plan)
    note = (
        f"float8 {recipe} ({len(plan.float8_linears)} linears) verified through its twin: the same plan with float8 "
        f"off ({plan.precision}), since CPU ranks have no float8 matmuls; the float8 program itself runs on GPUs "
        "(benchmarks/gpu_session.sh compares it with this twin)"
    )
    return twin, (note, *_float8_layout_notes(plan))


def _float8_layout_notes(plan: Plan) -> tuple[str, ...]:
    """What the twin leaves unproven beside TP or pipeline stages: the float8 styles' casts and float8 collectives
    (gloo moves no float8 bytes), and each stage's float8 matmuls, checked in one process with torchao's emulated
    matmul (tests/test_float8.py) rather than on these ranks."""
    notes = []
    if plan.mesh.tp > 1 and plan.mesh.pp == 1 and plan.decisions.float8 == "tensorwise":
        notes.append(
            "float8 beside TP: torchao's Float8ColwiseParallel / Float8RowwiseParallel and their float8 all-gathers "
            "are not run on CPU ranks (gloo has no float8 collectives); one process checks them emulated"
        )
    if plan.mesh.pp > 1:
        notes.append(
            "float8 beside pipeline stages: each stage's linear ops made float8 matmuls after the split are not run "
            "on CPU ranks; one process checks them emulated against torchao's Float8Linear"
        )
    return tuple(notes)


def async_tp_twin(plan: Plan) -> tuple[Plan, tuple[str, ...]]:
    """What CPU ranks verify of an async-TP plan: its twin with async TP off (``ir.plan.without_async_tp``: gloo
    has no symmetric memory, and inductor's micro-pipeline pass fuses only CUDA collectives), and the note that
    says what that leaves unproven; any other plan as it is. The twin runs the same compiled blocks and TP
    layout; the program's async-TP lines are checked as text (tests/test_async_tp.py)."""
    if not plan.decisions.async_tp:
        return plan, ()
    note = (
        "async TP verified through its twin: the same plan with async TP off, since CPU ranks (gloo) have no "
        "symmetric memory; inductor's fused all-gather-matmul and matmul-reduce-scatter kernels run on CUDA ranks "
        "only and are not proven here"
    )
    return without_async_tp(plan), (note,)


def offload_notes(plan: Plan) -> tuple[str, ...]:
    """What CPU ranks prove of a host-offload plan: the program itself runs (FSDP2 with ``CPUOffloadPolicy``, its
    shards made in host memory, the optimizer stepping them there), but with the host as the device its copies
    between the two move nothing and its shards are not pinned (pinning needs an accelerator)."""
    if not plan.decisions.offloaded:
        return ()
    return (
        "host offload verified as the program runs it on CPU ranks (FSDP2's CPUOffloadPolicy, shards and "
        "optimizer state on the host); there the host is the device, so the host-device copies and pinned "
        "memory of a GPU run are not exercised",
    )


def compile_notes(plan: Plan) -> tuple[str, ...]:
    """What CPU ranks prove of compiled blocks (``runtime.compiled``): dynamo's graphs, their breaks (the cp ring's,
    eager between them) and the recompute around or inside them, as the program runs them; inductor's kernels are
    its CPU ones, not the Triton kernels a GPU run compiles."""
    if not plan.decisions.compile:
        return ()
    return (
        "compiled blocks verified with inductor's CPU kernels (dynamo's graphs, the recompute and, beside cp, the "
        "ring eager between graphs, as a GPU run has them); the Triton kernels a GPU run compiles are not exercised",
    )


def prepare(plan: Plan, steps: int, seed: int, data: DataSource = DataSource()) -> tuple[ModelFile, tuple[str, ...]]:
    """What ``verify`` checks before it launches anything: the steps, that the plan runs here, the model file
    (its hash), the model's randomness, the dataset's samples (``runtime.data.open_dataset``); the model file
    and the notes for the report."""
    if steps < 1:
        raise AutoshardError(f"--steps {steps} must be at least 1")
    check_runs_here(plan)
    model_file = load_model_file(
        plan.model["spec"], expected_hash=plan.model["hash"], seq_len=plan.model.get("seq_len")
    )
    check_randomness(plan, model_file, seed)
    dataset = open_dataset(model_file, data, layout(plan).tokens_per_sample)
    notes = run_notes(model_file, plan)
    if dataset is not None:
        size = "a stream" if is_stream(dataset) else f"{len(dataset)} samples"
        notes += (
            f"both train on {data.name(model_file)} ({size}), in the order the program's "
            f"{plan.mesh.dp} data-parallel rank(s) read it",
        )
    return model_file, notes


def reference_data(plan: Plan, model_file: ModelFile, data: DataSource) -> dict:
    """``train_reference``'s data arguments: a dataset's source, tokens per sample and dp (its order depends on
    dp), or nothing for example_batch draws (whose order does not)."""
    if not (data.path or model_file.has_dataset):
        return {}
    return {"data": data, "tokens_per_sample": layout(plan).tokens_per_sample, "dp": plan.mesh.dp}


def judge(
    plan: Plan,
    model_file: ModelFile,
    parallel: Run | str,
    steps: int,
    seed: int,
    recipe: Recipe,
    notes: tuple[str, ...] = (),
    data: DataSource = DataSource(),
    layout_run: Run | str | None = None,
) -> VerifyReport:
    """The parallel run (or why it failed) against the fp32 and float64 one-process runs with ``recipe`` (the
    program's), with a likely cause. ``layout_run``: the run of the plan's fp32 twin (``fp32_twin``), judged first
    at fp32's tolerance; a layout that fails there fails the plan (module doc, 16-bit plans)."""
    if layout_run is not None:
        twin = judge(in_fp32(plan), model_file, layout_run, steps, seed, recipe, (), data)
        if not twin.ok:
            return _with(twin, notes=notes, failure=f"{TWIN_FAILED}\n{twin.failure}", twin=twin)
        return _with(
            judge(plan, model_file, parallel, steps, seed, recipe, notes + (twin_note(plan, twin),), data), twin=twin
        )
    if isinstance(parallel, str):
        return VerifyReport(steps, [], [], math.nan, math.nan, "", parallel, notes=notes)
    microbatches = reference_microbatches(model_file, plan)
    source = reference_data(plan, model_file, data)
    ref32 = train_reference(
        model_file,
        plan.global_batch,
        steps,
        seed,
        recipe.lr,
        fixed_randomness=True,
        microbatches=microbatches,
        recipe=recipe,
        precision=plan.precision,
        gathers_params=gathers_params(plan),
        **source,
    )
    ref64 = train_reference(
        model_file,
        plan.global_batch,
        steps,
        seed,
        recipe.lr,
        fixed_randomness=True,
        microbatches=microbatches,
        dtype=torch.float64,
        recipe=recipe,
        **source,
    )
    report = compare(
        steps,
        parallel.losses,
        ref32.losses,
        parallel.params,
        ref32.params,
        recipe.lr,
        exact=ref64,
        noise_factor=noise_factor(plan),
    )
    report = _with(report, grad_norms=parallel.grad_norms)
    if report.ok:
        return _with(report, notes=notes)
    cause = likely_cause(report, plan, model_file, seed)
    return _with(report, notes=notes, failure=report.failure + (f"\nlikely cause: {cause}" if cause else ""))


TWIN_FAILED = (
    "the plan's layout does not train like one process in fp32 (its fp32 twin: the same plan at --precision fp32, "
    "judged at fp32's tolerance)"
)


def twin_note(plan: Plan, twin: VerifyReport) -> str:
    """The note that a 16-bit plan's layout passed in fp32, with its worst tensor."""
    worst = twin.most_off[0] if twin.most_off else None
    at = f"; most off: {worst.name} at {_times(worst.excess, twin.noise_factor)} fp32's noise" if worst else ""
    return (
        f"the layout verified first in fp32 (the same plan at --precision fp32, within {NOISE_FACTOR}x the "
        f"one-process fp32 noise{at}); the {plan.precision} run then within its own precision's tolerance"
    )


def _with(report: VerifyReport, **changes) -> VerifyReport:
    return replace(report, **changes)


def run_notes(model_file: ModelFile, plan: Plan) -> tuple[str, ...]:
    """What verify changed or kept about the model, for its output."""
    model = model_file.build("meta")
    notes = [random_ops_note(plan.model.get("random_ops"))]
    if has_batch_norm(model):
        notes.append(
            f"BatchNorm statistics over the {plan.mesh.dp} data-parallel rank(s) (SyncBatchNorm)"
            + (
                f"; per micro-batch of {plan.mesh.dp * plan.microbatch_size} samples, in the reference too"
                if plan.num_microbatches > 1
                else ""
            )
        )
    return tuple(notes)


def random_ops_note(random_ops: dict[str, list[str]] | None) -> str:
    """Which random ops run at their expectation in both runs (the plan's ``model.random_ops``)."""
    if random_ops is None:  # plans list random ops only where the model has some (older plans list none at all)
        return (
            "the plan lists no random op (the captured model draws none); any would run at its expectation in both runs"
        )
    if not random_ops:
        return "the captured model has no random op (every random op would run at its expectation in both runs)"
    where = "; ".join(f"{op} in {', '.join(modules)}" for op, modules in sorted(random_ops.items()))
    return f"random ops at their expectation in both runs, as every rank would draw its own: {where}"


def check_randomness(plan: Plan, model_file: ModelFile, seed: int) -> None:
    """Refuse, naming the op and its module, a random op with no shared value (``runtime.randomness``), and a
    model whose two forwards of one batch differ with every torch random op fixed."""
    for op, modules in sorted((plan.model.get("random_ops") or {}).items()):
        if not fixable(op_name(op)):
            raise AutoshardError(
                f"verify cannot give the random op {op} (in {modules[0]}) a value every rank and "
                f"the one-process run share, so it cannot compare them; remove it from the model "
                f"or set its rate to 0 for verification"
            )
    if not forward_is_deterministic(model_file, plan.global_batch, seed):
        raise AutoshardError(
            "two forwards of one batch differ with every torch random op fixed: the model draws "
            "randomness verify cannot see (Python's random, NumPy, a generator outside torch) or "
            "keeps state between calls; make forward a function of its inputs and weights to verify it"
        )


def run_parallel(
    plan: Plan, workdir: Path, steps: int, seed: int, recipe: Recipe, data: DataSource = DataSource()
) -> Run | str:
    """Losses and final weights of the emitted program (random ops fixed; ``recipe`` its ``RECIPE``), or the reason
    it failed."""
    program = write_program(plan, workdir / "train.py", recipe=recipe)
    out = workdir / "metrics"
    proc = run_torchrun(program, plan.world_size, program_args(steps, seed, recipe.lr, out, data), quiet=True)
    if proc.returncode != 0:
        why = proc.crash or _error_line(proc.stdout)
        return f"the emitted program failed (exit {proc.returncode}):\n{why}"
    return read_run(out)


def program_args(steps: int, seed: int, lr: float, out: Path, data: DataSource = DataSource()) -> list[str]:
    """The emitted program's command line as verify runs it: random ops fixed, metrics into ``out``, ``data``'s
    flags, a dataset read in the training process (no DataLoader workers)."""
    return [
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--lr",
        repr(lr),
        "--metrics-out",
        str(out),
        "--fixed-randomness",
        *data.program_args(),
        "--data-workers",
        "0",
    ]


def read_run(out: Path) -> Run:
    """The losses and final weights a program wrote with ``--metrics-out out``."""
    metrics = json.loads((out / "metrics.json").read_text())
    return Run(metrics["losses"], read_weights(out), tuple(metrics.get("grad_norms", ())))


def _error_line(output: str) -> str:
    """The last line that names an error (torchrun ends with banners that do not)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or line.startswith("error:")]
    return (errors or lines or ["no output"])[-1][:400]


def weight_atol(lr: float) -> float:
    return WEIGHT_ATOL_PER_LR * lr


def compare(
    steps: int,
    par_losses: list[float],
    ref_losses: list[float],
    par_params: dict,
    ref_params: dict,
    lr: float = DEFAULT_LR,
    exact: Run | None = None,
    noise_factor: float = NOISE_FACTOR,
) -> VerifyReport:
    """Judge the parallel run against the reference; ``exact`` is the float64 run, ``noise_factor`` K (module
    doc)."""
    exact_losses = exact.losses if exact else None
    loss_excess = [
        _loss_excess(a, b, exact_losses[i] if exact_losses else None, noise_factor)
        for i, (a, b) in enumerate(zip(par_losses, ref_losses))
    ]
    tensors = sorted(
        (
            _tensor_excess(name, par_params[name], ref, exact.params[name] if exact else None, lr, noise_factor)
            for name, ref in ref_params.items()
            if name in par_params
        ),
        key=lambda t: -t.excess,
    )
    first = next((i for i, e in enumerate(loss_excess) if e > 1), None)
    failure = _failure(steps, par_losses, ref_losses, par_params, ref_params, first, tensors, noise_factor)
    worst = tensors[0] if tensors else TensorExcess("", 0.0, 0.0)
    return VerifyReport(
        steps,
        par_losses,
        ref_losses,
        max((abs(a - b) for a, b in zip(par_losses, ref_losses)), default=0.0),
        max((t.max_diff for t in tensors), default=0.0),
        worst.name,
        failure,
        first,
        tuple(tensors[:TOP_TENSORS]),
        noise_factor=noise_factor,
    )


def _loss_excess(par: float, ref32: float, ref64: float | None, noise_factor: float = NOISE_FACTOR) -> float:
    if ref64 is None:
        return abs(par - ref32) / (LOSS_ATOL + LOSS_RTOL * abs(ref32))
    return _ratio(abs(par - ref64), noise_factor * abs(ref32 - ref64) + FLOOR_ULPS * FP32_EPS * abs(ref64))


def _tensor_excess(
    name: str,
    par: torch.Tensor,
    ref32: torch.Tensor,
    ref64: torch.Tensor | None,
    lr: float,
    noise_factor: float = NOISE_FACTOR,
) -> TensorExcess:
    if ref32.numel() == 0:
        return TensorExcess(name, 0.0, 0.0)
    if not ref32.is_floating_point():
        equal = torch.equal(par.to(ref32.dtype), ref32)
        return TensorExcess(name, 0.0 if equal else math.inf, 0.0 if equal else math.inf)
    par, ref32 = par.double(), ref32.double()
    if ref64 is None:
        bound = weight_atol(lr) + WEIGHT_RTOL * ref32.abs()
        diff = (par - ref32).abs()
        return TensorExcess(name, (diff / bound).max().item(), diff.max().item())
    ref64 = ref64.double()
    diff = (par - ref64).abs().max().item()
    noise = (ref32 - ref64).abs().max().item()
    bound = noise_factor * noise + FLOOR_ULPS * FP32_EPS * ref64.abs().max().item()
    return TensorExcess(name, _ratio(diff, bound), (par - ref32).abs().max().item())


def _ratio(diff: float, bound: float) -> float:
    if diff == 0:
        return 0.0
    return diff / bound if bound > 0 else math.inf


def _failure(
    steps, par_losses, ref_losses, par_params, ref_params, first, tensors, noise_factor: float = NOISE_FACTOR
) -> str:
    if len(par_losses) != len(ref_losses):
        return f"the program logged {len(par_losses)} losses for {steps} steps"
    missing = sorted(set(ref_params) - set(par_params))
    if missing:
        return f"the program's final weights lack {missing[0]} (and {len(missing) - 1} more)"
    off = [t for t in tensors if t.excess > 1]
    if first is None and not off:
        return ""
    if first is None:
        where = "losses agree at every step; the final weights do not"
    else:
        where = (
            f"losses first differ at step {first}: {par_losses[first]:.8g} parallel vs "
            f"{ref_losses[first]:.8g} one process"
        )
    shown = (off or tensors)[:TOP_TENSORS]
    top = ", ".join(
        f"{t.name} ({_times(t.excess, noise_factor)} the rounding noise, |diff| up to {t.max_diff:.3g})" for t in shown
    )
    return f"{where}\ntensors most off: {top}"


def _times(excess: float, noise_factor: float = NOISE_FACTOR) -> str:
    return "inf x" if math.isinf(excess) else f"{excess * noise_factor:.3g}x"


def likely_cause(report: VerifyReport, plan: Plan, model_file: ModelFile, seed: int) -> str:
    """What in the plan or the model most likely explains a failed comparison, or ""."""
    if report.first_diverging_step == 0 and _loss_is_mean_of_shard_means(report, plan, model_file, seed):
        return (
            "the loss is not a mean over equal shares: each rank averages its own micro-batch over a count "
            "that depends on the data (ignore_index, padding, masks), and the mean of those means is not the "
            "global batch's loss; make loss_fn a sum over the batch divided by a fixed count"
        )
    names = [t.name for t in report.most_off if t.excess > 1] or [t.name for t in report.most_off]
    for name in names:
        module = _tensor_parallel_module(name, plan)
        if module:
            return (
                f"{module} is tensor parallel in this plan ({plan.tensor_parallel[module]}): its sharding "
                f"(the layout of its weight, input or output) does not compute what the module does"
            )
    model = model_file.build("meta")
    bn = {path for path, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    if any(name.rsplit(".", 1)[0] in bn for name in names):
        return (
            "BatchNorm: its statistics in the program are not those of one process over the same samples"
            + (" (pipeline stages normalise each micro-batch alone)" if plan.mesh.pp > 1 else "")
            + (
                f" (recompute {plan.recompute} runs a block's forward again in backward, and a BatchNorm "
                f"there updates its running statistics twice)"
                if plan.recompute != "none"
                else ""
            )
        )
    return ""


def _loss_is_mean_of_shard_means(report: VerifyReport, plan: Plan, model_file: ModelFile, seed: int) -> bool:
    """The program's first loss is (much closer to) the mean of its micro-batches' mean losses."""
    dp, count = plan.mesh.dp, plan.num_microbatches
    if dp * count == 1:
        return False
    model = build_model(model_file, seed)
    zero_dropout_rates(model)
    inputs, targets = global_batch(model_file, plan.global_batch, seed, 0)
    with fixed_randomness(), torch.no_grad():
        losses = [
            model_file.loss(model(*x), y).item()
            for r in range(dp)
            for x, y in split_microbatches(*take_shard((inputs, targets), r, dp, torch.device("cpu")), count)
        ]
    par, ref = report.parallel_losses[0], report.reference_losses[0]
    return abs(par - sum(losses) / len(losses)) < abs(par - ref) / 10


def _tensor_parallel_module(name: str, plan: Plan) -> str:
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:end])
        if module in plan.tensor_parallel:
            return module
    return ""


def forward_is_deterministic(model_file: ModelFile, batch_size: int, seed: int) -> bool:
    """Two forwards of the same batch, every random op fixed (``runtime.randomness``), give the same output."""
    model = build_model(model_file, seed)
    zero_dropout_rates(model)
    inputs, _ = global_batch(model_file, batch_size, seed, 0)
    with fixed_randomness(), torch.no_grad():
        first, second = model(*inputs), model(*inputs)
    leaves = lambda out: [t for t in torch.utils._pytree.tree_leaves(out) if torch.is_tensor(t)]  # noqa: E731
    return all(torch.equal(a, b) for a, b in zip(leaves(first), leaves(second)))


def summary_lines(report: VerifyReport) -> list[str]:
    """The per-step losses, the largest differences and the tolerance, for the CLI."""
    lines = [f"note: {note}" for note in report.notes]
    lines += [
        f"step {step}: loss {a:.8f} parallel, {b:.8f} one process"
        for step, (a, b) in enumerate(zip(report.parallel_losses, report.reference_losses))
    ]
    if report.parallel_losses:
        worst = report.most_off[0] if report.most_off else None
        lines.append(
            f"largest difference: loss {report.max_loss_diff:.3g}, weights {report.max_param_diff:.3g}"
            + (
                f"; most off for its rounding noise: {worst.name} ({_times(worst.excess, report.noise_factor)} that noise)"
                if worst
                else ""
            )
        )
        lines.append(f"tolerance: {tolerance_text(report.noise_factor)}")
    return lines
