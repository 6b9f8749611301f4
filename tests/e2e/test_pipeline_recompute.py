"""Pipeline plans with recompute inside the stages train like one process (4 ranks).

Each plan is pinned to pp = 2 with recompute full or selective, beside dp = 2 (FSDP2 on each stage
module) or tp = 2 (local shards whose collectives are custom ops, repeated by full recompute), and tp = 2 with
sequence parallelism and each block compiled inside its full recompute (``runtime.compiled``). The
emitted programs run in the session's 4-rank torchrun launch (``one_launch.Cases``), and each is
judged against fp32 and float64 one-process runs (``zoo._verdict``: ``verify.compare``).
"""

from __future__ import annotations

import pytest

import autoshard
from e2e.one_launch import Cases, assert_trains_like_one_process, program_cases
from e2e.zoo import FAST_LINK, GLOBAL_BATCH

pytestmark = pytest.mark.e2e

GPT, LLAMA = "examples/gpt.py:build", "tests/models/hf_llama.py:build"
RANKS = 4
CASES = {  # name: (model, cluster, pins); each model meets both modes and both meshes
    "gpt-dp2-pp2-full": (GPT, "local-cpu", dict(dp=2, tp=1, pp=2, zero=1, schedule="1f1b", recompute="full")),
    "gpt-tp2-pp2-selective": (GPT, FAST_LINK, dict(dp=1, tp=2, pp=2, schedule="1f1b", recompute="selective")),
    "llama-dp2-pp2-selective": (
        LLAMA,
        "local-cpu",
        dict(dp=2, tp=1, pp=2, zero=3, schedule="gpipe", recompute="selective"),
    ),
    "llama-tp2-pp2-full": (LLAMA, FAST_LINK, dict(dp=1, tp=2, pp=2, schedule="gpipe", recompute="full")),
    # torchtitan's 405B layout in small: TP with sequence parallelism in stages, each block compiled inside its full
    # recompute, the traced TP collectives called from the compiled code
    "llama-tp2-pp2-sp-full-compiled": (
        LLAMA,
        FAST_LINK,
        dict(dp=1, tp=2, pp=2, schedule="1f1b", recompute="full", sequence_parallel=True, compile=True),
    ),
}


def _plan(name):
    model, cluster, pins = CASES[name]
    return autoshard.plan(model, cluster=cluster, devices_per_node=RANKS, global_batch=GLOBAL_BATCH, **pins)


LAUNCHES = Cases(dict.fromkeys(CASES, RANKS), *program_cases(_plan), case_of=lambda test, params: list(CASES))


def test_pipeline_recompute_trains_like_one_process(in_repo, launches):
    runs = {}
    for name, (model, cluster, pins) in CASES.items():
        plan, folder, failure = launches.result(LAUNCHES, name)
        assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp, plan.recompute) == (
            pins["dp"],
            pins["tp"],
            2,
            pins["recompute"],
        ), name
        if plan.mesh.tp > 1:
            assert plan.tensor_parallel, f"{name}: a tp plan shards something"
        program = folder / "train.py"
        assert "apply_ac" in program.read_text(), f"{name}: the program recomputes nothing"
        assert plan.decisions.compile == pins.get("compile", False) == ("apply_compile" in program.read_text()), name
        assert plan.sequence_parallel == pins.get("sequence_parallel", plan.sequence_parallel), name
        runs[name] = plan, folder, failure
    for name, (plan, folder, failure) in runs.items():
        assert_trains_like_one_process(name, CASES[name][0], plan, folder / "out", failure)
