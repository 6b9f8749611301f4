"""Context and sequence parallelism train the bundled GPT and transformers' Llama like one process.

Each case is planned with its degrees pinned (``autoshard.plan``), emitted, run on CPU ranks and
judged against fp32 and float64 one-process runs (``zoo._verdict``), dropout off:

    2 ranks    cp 2 (each rank 1/2 of every sequence, attention a ring, ZeRO over the dp x cp ranks), and with
               full or selective recompute (the recomputation inside the backward runs the ring too);
               tp 2 with sequence parallelism (the norms between the parallel linears on 1/2 of the
               tokens, reduce-scatter and all-gather for each all-reduce)
    4 ranks    cp 2 x dp 2 (ZeRO-3: FSDP2 over the 4 dp x cp ranks); cp 2 x tp 2 with sequence
               parallelism (the TP layout's collectives inside each cp rank); pp 2 x cp 2 (each stage's
               ring inside the 1F1B schedule, every stage boundary carrying a cp rank's tokens; the Llama's
               stages traced under the ring's attention key, which builds no mask)
    8 ranks    pp 2 x cp 2 x tp 2 with sequence and loss parallelism, ZeRO-1 (benchmarks/llama3.py's tiny Llama: a stage
               boundary carrying 1/tp of a cp rank's tokens, the loss on vocabulary shards of its logits)

Every case runs two micro-batches per step. The Python API takes the 2-rank cp plan of the GPT too:
``api_driver.py`` applies it with ``autoshard.parallelize`` and trains it in a loop of its own that reads
``autoshard.layout(plan)``, judged the same way. ``cp_driver.py`` runs too (the runtime's ring attention
under a hand-written training loop, cp 2 and dp 2 x cp 2: the kernel pair against one-process SDPA,
and both models against one process; ``test_context_parallel_runtime.py`` holds the one-process tests
of the same runtime). Every run is a job of the session's one torchrun launch per world size
(``one_launch.Cases``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.launch import write_program
from autoshard.runtime import load_model_file
from autoshard.verify import compare, train_reference
from e2e.one_launch import Cases, assert_trains_like_one_process, attempt, job, program_job
from e2e.zoo import FAST_LINK, GLOBAL_BATCH, program_case

pytestmark = pytest.mark.e2e

MODELS = {"gpt": "examples/gpt.py:build", "llama": "tests/models/hf_llama.py:build"}
SPECS = {**MODELS, "llama3-tiny": "benchmarks/llama3.py:llama3_tiny"}  # the default loss, attention without a mask
MICROBATCHES = 2
CASES_2 = {
    **{f"{m}-cp2": (m, dict(cp=2, dp=1, tp=1, zero=1)) for m in MODELS},
    **{f"{m}-tp2-sp": (m, dict(cp=1, dp=1, tp=2, zero=0, sequence_parallel=True)) for m in MODELS},
    # recompute inside the backward runs the ring too (runtime.selective.recompute_contexts)
    "gpt-cp2-full": ("gpt", dict(cp=2, dp=1, tp=1, zero=1, recompute="full")),
    "llama-cp2-selective": ("llama", dict(cp=2, dp=1, tp=1, zero=1, recompute="selective")),
}
CASES_4 = {
    **{f"{m}-cp2-dp2-zero3": (m, dict(cp=2, dp=2, tp=1, zero=3)) for m in MODELS},
    **{f"{m}-cp2-tp2-sp": (m, dict(cp=2, dp=1, tp=2, zero=0, sequence_parallel=True)) for m in MODELS},
}
# inside pipeline stages: the GPT, and transformers' Llama, whose stages are traced under the ring's attention key
# (no mask built: ``runtime.context_parallel.use_cp_attention``, before the split)
CASES_PP = {f"{m}-pp2-cp2-1f1b": (m, dict(cp=2, dp=1, tp=1, zero=0, pp=2, schedule="1f1b")) for m in MODELS}
# and with tp 2, sequence and loss parallelism on 8 ranks, ZeRO-1 (FSDP2 over the dp x cp ranks of each stage, whose
# parameters are TP's local shards: its checkpoint state a 2-D DTensor over dp_cp x tp, which init_weights loads
# through): a stage boundary carries 1/tp of a cp rank's tokens, and
# the last stage's loss reads its vocabulary shard of them; one sample per micro-batch, so a cp rank's rows of the
# loss number as its tokens (an arange of them inside the loss's backward must not be taken for positions)
LLAMA3_TINY = "llama3-tiny"
CASES_PP_8 = {
    "llama3-pp2-cp2-tp2-sp-lp": (
        LLAMA3_TINY,
        dict(cp=2, dp=1, tp=2, zero=1, pp=2, schedule="1f1b", sequence_parallel=True, loss_parallel=True),
    )
}
# api_driver.py: the Python API on a case of CASES_2's plan
API_CASES = {"gpt-cp2-api": "gpt-cp2"}
API_DRIVER = Path(__file__).with_name("api_driver.py")
# cp_driver.py: (dp, cp) meshes, every model of MODELS, 2 AdamW steps on a batch of 4
DRIVER = Path(__file__).with_name("cp_driver.py")
DRIVER_MESHES = {"cp2": (1, 2), "dp2-cp2": (2, 2)}
DRIVER_STEPS, DRIVER_BATCH, DRIVER_LR = 2, 4, 1e-3
TOL = 1e-5  # fp32: the ring merges partial softmaxes in another order than one kernel; ~1e-6 seen


def _plan(model: str, ranks: int, pins: dict):
    microbatch = GLOBAL_BATCH // (pins["dp"] * MICROBATCHES)
    cluster = FAST_LINK if pins["tp"] > 1 else "local-cpu"  # a link where TP pays, so the layout shards
    if model == LLAMA3_TINY:  # one sample of its 128 tokens per micro-batch (CASES_PP_8)
        pins = {"microbatch_size": 1, **pins}
        return autoshard.plan(
            SPECS[model], cluster=cluster, devices_per_node=ranks, global_batch=2, recompute="none", **pins
        )
    return autoshard.plan(
        MODELS[model],
        cluster=cluster,
        devices_per_node=ranks,
        global_batch=GLOBAL_BATCH,
        microbatch_size=microbatch,
        **{"recompute": "none", "pp": 1, **pins},
    )


def _driver_job(out: Path, dp: int, cp: int) -> dict:
    return job(
        DRIVER,
        [
            out,
            "--cp",
            cp,
            "--dp",
            dp,
            "--steps",
            DRIVER_STEPS,
            "--batch",
            DRIVER_BATCH,
            "--lr",
            repr(DRIVER_LR),
            "--check-op",
            *[arg for name, spec in MODELS.items() for arg in ("--model", f"{name}={spec}")],
        ],
        out,
    )


CASES = {**CASES_2, **CASES_4, **CASES_PP, **CASES_PP_8}


def _prepare(names, ranks, folder):
    """Each program case: (its job, (plan, folder)); each driver mesh: (its job, (None, folder))."""

    def one(name):
        if name in DRIVER_MESHES:
            return [_driver_job(folder / name, *DRIVER_MESHES[name])], (None, folder / name)
        if name in API_CASES:
            plan = _plan(CASES[API_CASES[name]][0], ranks, dict(CASES[API_CASES[name]][1]))
            (folder / name).mkdir(parents=True, exist_ok=True)
            (folder / name / "plan.json").write_text(plan.to_json())
            case = program_case(name, API_DRIVER, folder / name / "out")
            return [job(API_DRIVER, [folder / name / "plan.json", *case["args"]], case["metrics_out"])], (
                plan,
                folder / name,
            )
        plan = _plan(CASES[name][0], ranks, dict(CASES[name][1]))
        program = write_program(plan, folder / name / "train.py")
        return [program_job(program, folder / name / "out")], (plan, folder / name)

    return {name: attempt(lambda: one(name)) for name in names}


# name -> (plan or None for cp_driver, its folder, its failure: "" when it ran to its end)
LAUNCHES = Cases(
    {
        **dict.fromkeys(CASES_2, 2),
        **dict.fromkeys(CASES_4, 4),
        **dict.fromkeys(CASES_PP, 4),
        **dict.fromkeys(CASES_PP_8, 8),
        **dict.fromkeys(API_CASES, 2),
        **{name: dp * cp for name, (dp, cp) in DRIVER_MESHES.items()},
    },
    _prepare,
    finish=lambda name, state, failures: (*state, failures[0]),
    case_of=lambda test, params: {
        "test_sequences_split_over_two_ranks_train_like_one_process": list(CASES_2),
        "test_context_parallel_with_data_and_tensor_parallel_trains_like_one_process": list(CASES_4),
        "test_context_parallel_inside_pipeline_stages_trains_like_one_process": list(CASES_PP),
        "test_sequence_and_loss_parallel_beside_cp_inside_pipeline_stages_train_like_one_process": list(CASES_PP_8),
        "test_parallelize_applies_a_cp_plan_to_a_scripts_own_loop": list(API_CASES),
        "test_context_parallel_matches_one_process": [
            name for name, mesh in DRIVER_MESHES.items() if mesh == (params.get("dp"), params.get("cp"))
        ],
    }.get(test),
)


def _run(cases: dict, launches) -> None:
    runs = {}
    for name, (model, pins) in cases.items():
        plan, folder, failure = launches.result(LAUNCHES, name)
        assert (plan.mesh.cp, plan.mesh.dp, plan.mesh.tp) == (pins["cp"], pins["dp"], pins["tp"]), name
        assert (plan.mesh.pp, plan.schedule) == (pins.get("pp", 1), pins.get("schedule", "none")), name
        if pins["tp"] > 1:
            assert any(s != "replicate" for s in plan.tensor_parallel.values()), f"{name}: nothing sharded over tp"
        assert plan.sequence_parallel == pins.get("sequence_parallel", False), name
        program = (folder / "train.py").read_text()
        splits = 'SEQUENCE_AXIS = "cp"' in program and 'mesh["dp_cp"]' in program
        assert splits == (pins["cp"] > 1), f"{name}: the program does not split the sequence as planned"
        runs[name] = plan, folder, failure
    for name, (plan, folder, failure) in runs.items():
        assert_trains_like_one_process(name, SPECS[cases[name][0]], plan, folder / "out", failure)


def test_sequences_split_over_two_ranks_train_like_one_process(in_repo, launches):
    _run(CASES_2, launches)


def test_context_parallel_with_data_and_tensor_parallel_trains_like_one_process(in_repo, launches):
    _run(CASES_4, launches)


def test_context_parallel_inside_pipeline_stages_trains_like_one_process(in_repo, launches):
    _run(CASES_PP, launches)


def test_sequence_and_loss_parallel_beside_cp_inside_pipeline_stages_train_like_one_process(in_repo, launches):
    """pp 2 x cp 2 x tp 2 with sequence and loss parallelism: each stage is traced on a cp rank's half of the tokens,
    which the sequence ops split again over tp, so a stage boundary carries a quarter of every sample's tokens; the
    last stage's output projection returns its vocabulary shard of the cp rank's logits, the loss runs on it."""
    for name in CASES_PP_8:
        plan = launches.result(LAUNCHES, name)[0]
        assert plan.decisions.loss_parallel and plan.tensor_parallel["output"].startswith("colwise-loss-parallel")
    _run(CASES_PP_8, launches)


def test_parallelize_applies_a_cp_plan_to_a_scripts_own_loop(in_repo, launches):
    """``autoshard.parallelize`` builds the cp plan's mesh (dp x cp flattened) and applies its steps; the script's
    loop cuts the tokens and runs the ring from ``autoshard.layout(plan)``: it trains like one process."""
    for name, program_name in API_CASES.items():
        plan, folder, failure = launches.result(LAUNCHES, name)
        assert plan.mesh.cp == 2 and autoshard.layout(plan).sequence_axis == "cp", name
        assert_trains_like_one_process(name, MODELS[CASES[program_name][0]], plan, folder / "out", failure)


@pytest.fixture(scope="module")
def references(in_repo_module):
    return {
        name: train_reference(load_model_file(spec), DRIVER_BATCH, DRIVER_STEPS, 0, DRIVER_LR, fixed_randomness=True)
        for name, spec in MODELS.items()
    }


@pytest.mark.parametrize("dp,cp", [(1, 2), (2, 2)], ids=["cp2", "dp2-cp2"])
def test_context_parallel_matches_one_process(launches, references, dp, cp):
    """cp_driver.py: runtime.context_parallel's ring attention (gloo, CPU ranks) trains like one process."""
    _, out, failure = launches.result(LAUNCHES, {(1, 2): "cp2", (2, 2): "dp2-cp2"}[dp, cp])
    assert not failure, failure[-3000:]
    op = json.loads((out / "op_check.json").read_text())
    assert max(d for case in op.values() for d in case.values()) < TOL, op
    for name in MODELS:
        losses = json.loads((out / name / "losses.json").read_text())
        params = torch.load(out / name / "params.pt", weights_only=True)
        ref_losses, ref_params = references[name]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=TOL, atol=TOL)
        for key, ref in ref_params.items():
            torch.testing.assert_close(params[key], ref, rtol=TOL, atol=TOL, msg=f"{name} {key}")
        report = compare(DRIVER_STEPS, losses, ref_losses, params, ref_params, DRIVER_LR)
        assert report.ok, report.failure
