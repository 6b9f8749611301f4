"""The zero-bubble pipeline schedules train like one process (4 ranks).

torch's ``ScheduleInterleavedZeroBubble`` (interleaved-zb), ``ScheduleZBVZeroBubble`` (zbv) and
``ScheduleDualPipeV`` (dualpipev) split each stage's backward into the input's gradient and the
weights' (``stage_backward_input`` / ``stage_backward_weight``) and run on the traced stage modules
of ``pipeline()``; zbv and dualpipev place the stages in a V (rank r holds stages r and 3 − r at
pp = 2). Each plan is pinned to pp = 2 beside dp = 2 (FSDP2 on each stage module, ZeRO-0 and -1) or
tp = 2 (local shards whose collectives are custom ops), each schedule with and without full recompute
inside the stages (the weight pass's calls share one rerun of each block: ``GraphExecGroup``),
on the bundled GPT and on transformers' Llama with 4 layers (``build_4_layers``: two stages per
rank need 4 blocks; the 2-layer ``build`` is refused in one line; with 8 layers at pp = 4, the V over
4 ranks, dp = tp = 1), and on transformers' GPT-2, whose
tied embedding and head both sit on rank 0 in a V (their gradients are summed there, no peer to
wait for). The emitted programs run in
the session's 4-rank torchrun launch (``one_launch.Cases``), and each is judged against fp32 and
float64 one-process runs (``zoo._verdict``: ``verify.compare``). ZeRO-3 and selective recompute do not
train like one process with the split backward (wrong weights, or checkpoint errors) and are refused by
the planner (``strategies.split_backward_refusal``; ``tests/test_search_tp_pp.py``). Full recompute beside
tp = 2 trains like one process since the stages' passed-on inputs keep needing a gradient into the weight
pass (``pipeline_parallel._keep_passed_inputs_needing_grad``).
"""

from __future__ import annotations

import pytest

import autoshard
from autoshard.errors import AutoshardError
from e2e.one_launch import Cases, assert_trains_like_one_process, program_cases
from e2e.zoo import FAST_LINK, GLOBAL_BATCH

pytestmark = pytest.mark.e2e

GPT, LLAMA, LLAMA_2_LAYERS = (
    "examples/gpt.py:build",
    "tests/models/hf_llama.py:build_4_layers",
    "tests/models/hf_llama.py:build",
)
LLAMA_8 = "tests/models/hf_llama.py:build_8_layers"  # pp = 4 in a V: rank r holds stages r and 7 − r
GPT2_TIED = "tests/models/hf_gpt2.py:build_4_layers"  # embedding and head tied: both copies on rank 0 in a V
RANKS = 4
CASES = {  # name: (model, cluster, pins); each schedule meets dp = 2 and tp = 2, each model all three
    "gpt-dp2-pp2-zbv": (GPT, "local-cpu", dict(dp=2, tp=1, pp=2, zero=1, schedule="zbv", recompute="none")),
    "gpt-tp2-pp2-dualpipev-full": (GPT, FAST_LINK, dict(dp=1, tp=2, pp=2, schedule="dualpipev", recompute="full")),
    "gpt-dp2-pp2-interleaved-zb-full": (
        GPT,
        "local-cpu",
        dict(dp=2, tp=1, pp=2, zero=1, schedule="interleaved-zb", recompute="full"),
    ),
    "llama-dp2-pp2-dualpipev-full": (
        LLAMA,
        "local-cpu",
        dict(dp=2, tp=1, pp=2, zero=0, schedule="dualpipev", recompute="full"),
    ),
    "llama-tp2-pp2-zbv": (LLAMA, FAST_LINK, dict(dp=1, tp=2, pp=2, schedule="zbv", recompute="none")),
    "llama-tp2-pp2-zbv-full": (LLAMA, FAST_LINK, dict(dp=1, tp=2, pp=2, schedule="zbv", recompute="full")),
    "llama-dp2-pp2-interleaved-zb": (
        LLAMA,
        "local-cpu",
        dict(dp=2, tp=1, pp=2, zero=1, schedule="interleaved-zb", recompute="none"),
    ),
    "gpt2-tied-dp2-pp2-zbv-full": (
        GPT2_TIED,
        "local-cpu",
        dict(dp=2, tp=1, pp=2, zero=1, schedule="zbv", recompute="full"),
    ),
    "llama8-pp4-zbv-full": (LLAMA_8, "local-cpu", dict(dp=1, tp=1, pp=4, schedule="zbv", recompute="full")),
    "llama8-pp4-dualpipev": (LLAMA_8, "local-cpu", dict(dp=1, tp=1, pp=4, schedule="dualpipev", recompute="none")),
}


def test_two_layer_llama_is_refused_two_stages_per_rank():
    with pytest.raises(AutoshardError, match="--schedule zbv puts 2 stages on each of --pp 2 ranks: needs 4 blocks"):
        autoshard.plan(
            LLAMA_2_LAYERS,
            cluster="local-cpu",
            devices_per_node=RANKS,
            global_batch=GLOBAL_BATCH,
            dp=2,
            tp=1,
            pp=2,
            schedule="zbv",
        )


def _plan(name):
    model, cluster, pins = CASES[name]
    return autoshard.plan(model, cluster=cluster, devices_per_node=RANKS, global_batch=GLOBAL_BATCH, **pins)


LAUNCHES = Cases(
    dict.fromkeys(CASES, RANKS),
    *program_cases(_plan),
    case_of=lambda test, params: list(CASES) if test == "test_zero_bubble_schedules_train_like_one_process" else None,
)


def test_zero_bubble_schedules_train_like_one_process(in_repo, launches):
    runs = {}
    for name, (model, cluster, pins) in CASES.items():
        plan, folder, failure = launches.result(LAUNCHES, name)
        assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp, plan.schedule, plan.virtual_stages) == (
            pins["dp"],
            pins["tp"],
            pins["pp"],
            pins["schedule"],
            2,
        ), name
        if plan.mesh.tp > 1:
            assert plan.tensor_parallel, f"{name}: a tp plan shards something"
        text = (folder / "train.py").read_text()
        v_placed = plan.schedule in ("zbv", "dualpipev")
        assert ("placement=PLACEMENT" in text) == v_placed, f"{name}: the split names its placement"
        if v_placed:
            held = ", ".join(f"rank {r}: {r} and {2 * plan.mesh.pp - 1 - r}" for r in range(plan.mesh.pp))
            assert held in text and f"rank r keeps stages r and {2 * plan.mesh.pp - 1} - r" in text, name
        runs[name] = plan, folder, failure
    for name, (plan, folder, failure) in runs.items():
        assert_trains_like_one_process(name, CASES[name][0], plan, folder / "out", failure)
