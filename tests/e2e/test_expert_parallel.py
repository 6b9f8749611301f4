"""Expert parallelism trains transformers' mixture-of-experts models like one process.

Mixtral, OLMoE and Qwen2-MoE (4 experts, top-2; Qwen2-MoE with a shared expert), each planned with
``--ep 2`` pinned, emitted, run on CPU ranks and judged against fp32 and float64 one-process runs
(``zoo._verdict``; the experts come back whole, gathered over their ep ranks):

    2 ranks    dp 2 = ep 2, ZeRO-3 (each expert unit its own FSDP2 unit on one rank), ZeRO-0
               (FSDP2's replicate) and ZeRO-1 (gradients summed whole over two micro-batches)
    4 ranks    dp 4, ep 2, ZeRO-3: each expert unit sharded over the dp / ep = 2 ranks holding it;
               pp 2 x dp 2 = ep 2 (1F1B), the experts sharded before the split, the dispatch one
               traced op
    8 ranks    pp 2 x dp 4, ep 2 (Mixtral): each stage's expert shards averaged over their 2 replicas
               after the schedule

Every case runs two micro-batches per step. The programs run in the session's one torchrun launch per
world size (``one_launch.Cases``).
"""

from __future__ import annotations

import pytest

import autoshard
from e2e.one_launch import Cases, assert_trains_like_one_process, program_cases
from e2e.zoo import GLOBAL_BATCH

pytestmark = pytest.mark.e2e

MODELS = {
    "mixtral": "tests/models/hf_mixtral.py:build",
    "olmoe": "tests/models/hf_olmoe.py:build",
    "qwen2-moe": "tests/models/hf_causal_zoo.py:build_qwen2_moe",
}
MICROBATCHES = 2
# name: (model, pins)
CASES_2 = {
    **{f"{m}-ep2-zero3": (m, dict(dp=2, ep=2, zero=3)) for m in MODELS},
    "qwen2-moe-ep2-zero0": ("qwen2-moe", dict(dp=2, ep=2, zero=0)),
    "mixtral-ep2-zero1": ("mixtral", dict(dp=2, ep=2, zero=1)),
}
CASES_4 = {
    **{f"{m}-dp4-ep2-zero3": (m, dict(dp=4, ep=2, zero=3)) for m in MODELS},
    **{f"{m}-pp2-ep2": (m, dict(dp=2, ep=2, pp=2, zero=1, schedule="1f1b")) for m in MODELS},
}

CASES_8 = {"mixtral-pp2-dp4-ep2": ("mixtral", dict(dp=4, ep=2, pp=2, zero=1, schedule="1f1b"))}


def _plan(model: str, ranks: int, pins: dict):
    microbatch = GLOBAL_BATCH // (pins["dp"] * MICROBATCHES)
    return autoshard.plan(
        MODELS[model],
        cluster="local-cpu",
        devices_per_node=ranks,
        global_batch=GLOBAL_BATCH,
        microbatch_size=microbatch,
        recompute="none",
        tp=1,
        pp=pins.pop("pp", 1),
        **pins,
    )


ALL_CASES = {**CASES_2, **CASES_4, **CASES_8}
RANKS = {**dict.fromkeys(CASES_2, 2), **dict.fromkeys(CASES_4, 4), **dict.fromkeys(CASES_8, 8)}
LAUNCHES = Cases(
    RANKS,
    *program_cases(lambda name: _plan(ALL_CASES[name][0], RANKS[name], dict(ALL_CASES[name][1]))),
    case_of=lambda test, params: list(
        CASES_2 if "two_ranks" in test else CASES_4 if "sharded_replicas" in test else CASES_8
    ),
)


def _run(cases: dict, launches) -> None:
    runs = {}
    for name, (model, pins) in cases.items():
        plan, folder, failure = launches.result(LAUNCHES, name)
        assert (plan.ep, plan.mesh.dp, plan.zero_stage) == (2, pins["dp"], pins["zero"]), name
        assert plan.experts == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"), name
        program = (folder / "train.py").read_text()
        assert "apply_ep(" in program and "ep=EP" in program, f"{name}: the program does not shard the experts"
        runs[name] = plan, folder, failure
    for name, (plan, folder, failure) in runs.items():
        assert_trains_like_one_process(name, MODELS[cases[name][0]], plan, folder / "out", failure)


def test_experts_split_over_two_ranks_train_like_one_process(in_repo, launches):
    _run(CASES_2, launches)


def test_experts_with_sharded_replicas_and_in_pipeline_stages_train_like_one_process(in_repo, launches):
    _run(CASES_4, launches)


def test_expert_replicas_in_pipeline_stages_train_like_one_process(in_repo, launches):
    _run(CASES_8, launches)
