"""Context and sequence parallelism train the bundled GPT and transformers' Llama like one process.

Each case is planned with its degrees pinned (``autoshard.plan``), emitted, run on CPU ranks and
judged against fp32 and float64 one-process runs (``zoo._verdict``), dropout off:

    2 ranks    cp 2 (each rank 1/2 of every sequence, attention a ring, ZeRO over the dp x cp ranks);
               tp 2 with sequence parallelism (the norms between the parallel linears on 1/2 of the
               tokens, reduce-scatter and all-gather for each all-reduce)
    4 ranks    cp 2 x dp 2 (ZeRO-3: FSDP2 over the 4 dp x cp ranks); cp 2 x tp 2 with sequence
               parallelism (the TP layout's collectives inside each cp rank)

Every case runs two micro-batches per step. One torchrun launch per world size (``zoo_driver.py``).
"""

from __future__ import annotations

import pytest

import autoshard
from autoshard.launch import write_program
from e2e.zoo import FAST_LINK, GLOBAL_BATCH, run_and_judge

pytestmark = pytest.mark.e2e

MODELS = {"gpt": "examples/gpt.py:build", "llama": "tests/models/hf_llama.py:build"}
MICROBATCHES = 2
CASES_2 = {
    **{f"{m}-cp2": (m, dict(cp=2, dp=1, tp=1, zero=1)) for m in MODELS},
    **{f"{m}-tp2-sp": (m, dict(cp=1, dp=1, tp=2, zero=0, sequence_parallel=True)) for m in MODELS},
}
CASES_4 = {
    **{f"{m}-cp2-dp2-zero3": (m, dict(cp=2, dp=2, tp=1, zero=3)) for m in MODELS},
    **{f"{m}-cp2-tp2-sp": (m, dict(cp=2, dp=1, tp=2, zero=0, sequence_parallel=True)) for m in MODELS},
}


def _plan(model: str, ranks: int, pins: dict):
    microbatch = GLOBAL_BATCH // (pins["dp"] * MICROBATCHES)
    cluster = FAST_LINK if pins["tp"] > 1 else "local-cpu"  # a link where TP pays, so the layout shards
    return autoshard.plan(MODELS[model], cluster=cluster, devices_per_node=ranks, global_batch=GLOBAL_BATCH,
                          microbatch_size=microbatch, recompute="none", pp=1, **pins)


def _run(cases: dict, ranks: int, tmp_path) -> None:
    plans = {}
    for name, (model, pins) in cases.items():
        plan = _plan(model, ranks, dict(pins))
        assert (plan.mesh.cp, plan.mesh.dp, plan.mesh.tp) == (pins["cp"], pins["dp"], pins["tp"]), name
        if pins["tp"] > 1:
            assert any(s != "replicate" for s in plan.tensor_parallel.values()), f"{name}: nothing sharded over tp"
        assert plan.sequence_parallel == pins.get("sequence_parallel", False), name
        program = write_program(plan, tmp_path / name / "train.py").read_text()
        splits = "runtime.context_parallel(mesh[\"cp\"]" in program and 'mesh["dp_cp"]' in program
        assert splits == (pins["cp"] > 1), f"{name}: the program does not split the sequence as planned"
        plans[name] = plan
    run_and_judge(plans, {n: MODELS[c[0]] for n, c in cases.items()}, ranks, tmp_path)


def test_sequences_split_over_two_ranks_train_like_one_process(in_repo, tmp_path):
    _run(CASES_2, 2, tmp_path)


def test_context_parallel_with_data_and_tensor_parallel_trains_like_one_process(in_repo, tmp_path):
    _run(CASES_4, 4, tmp_path)
