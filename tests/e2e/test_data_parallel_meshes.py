"""ZeRO-0 and ZeRO-1 beside tensor and pipeline parallelism, HSDP and host offload train like one process.

The configurations practitioners run (``ir.decisions.DP_RUNTIMES``): plain data parallelism beside
TP (FSDP2's ``replicate``), Megatron's distributed optimizer beside TP and PP (ZeRO-1: FSDP2 with
gradients summed whole over the micro-batches), HSDP (FSDP2 sharding inside a node and
replicating across nodes), and ZeRO-3 with host offload (FSDP2's ``CPUOffloadPolicy``), each
planned with its decisions pinned, emitted, run on CPU ranks and judged against fp32 and float64 one-process runs (``zoo._verdict``). Every case runs two
micro-batches per step, so gradient accumulation without synchronisation is exercised. The
programs run in the session's one torchrun launch per world size (``one_launch.Cases``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import autoshard
from e2e.one_launch import Cases, assert_trains_like_one_process, program_cases
from e2e.zoo import FAST_LINK, GLOBAL_BATCH

pytestmark = pytest.mark.e2e

GPT, LLAMA = "examples/gpt.py:build", "tests/models/hf_llama.py:build"
MICROBATCHES = 2
# name: (model, cluster, nodes, devices per node, pins, the apply step that must appear)
CASES_4 = {
    "gpt-dp2-tp2-zero0": (GPT, FAST_LINK, 1, 4, dict(dp=2, tp=2, pp=1, zero=0), "apply_replicate("),
    "llama-dp2-tp2-zero0": (LLAMA, FAST_LINK, 1, 4, dict(dp=2, tp=2, pp=1, zero=0), "apply_replicate("),
    "gpt-dp2-tp2-zero1": (GPT, FAST_LINK, 1, 4, dict(dp=2, tp=2, pp=1, zero=1), "sync_every_microbatch=False"),
    "llama-dp2-pp2-zero1": (LLAMA, "local-cpu", 1, 4, dict(dp=2, tp=1, pp=2, zero=1, schedule="1f1b"), "apply_fsdp("),
    "gpt-dp2-pp2-zero0": (GPT, "local-cpu", 1, 4, dict(dp=2, tp=1, pp=2, zero=0, schedule="gpipe"), "apply_replicate("),
    "gpt-hsdp2x2-zero3": (GPT, "local-cpu", 2, 2, dict(dp=4, tp=1, pp=1, zero=3, dp_replicate=2), "replicas=2"),
    "llama-hsdp2x2-zero2": (LLAMA, "local-cpu", 2, 2, dict(dp=4, tp=1, pp=1, zero=2, dp_replicate=2), "replicas=2"),
    "gpt-dp4-zero3-offload": (GPT, "local-cpu", 1, 4, dict(dp=4, tp=1, pp=1, zero=3, offload="cpu"), "offload=True"),
}
CASES_8 = {
    "gpt-dp2-tp2-pp2-zero1": (GPT, FAST_LINK, 1, 8, dict(dp=2, tp=2, pp=2, zero=1, schedule="1f1b"), "apply_fsdp("),
    "llama-dp2-tp2-pp2-zero1": (
        LLAMA,
        FAST_LINK,
        1,
        8,
        dict(dp=2, tp=2, pp=2, zero=1, schedule="gpipe"),
        "apply_fsdp(",
    ),
    "llama-hsdp2x2-tp2-zero3": (LLAMA, FAST_LINK, 2, 4, dict(dp=4, tp=2, pp=1, zero=3, dp_replicate=2), "replicas=2"),
}


def _plan(model, cluster, nodes, per_node, pins):
    """The case's plan; with ``offload`` its host-offload twin: CPU ranks have no device memory to offload from,
    so the planner refuses offload on them, and the case runs the same ZeRO-3 plan with FSDP2's CPUOffloadPolicy
    on (``verify.offload_notes`` says what that proves)."""
    pins = dict(pins)
    offload = pins.pop("offload", "none")
    plan = _planned(model, cluster, nodes, per_node, pins)
    return replace(plan, decisions=replace(plan.decisions, offload=offload))


def _planned(model, cluster, nodes, per_node, pins):
    microbatch = GLOBAL_BATCH // (pins["dp"] * MICROBATCHES)
    return autoshard.plan(
        model,
        cluster=cluster,
        nodes=nodes,
        devices_per_node=per_node,
        global_batch=GLOBAL_BATCH,
        microbatch_size=microbatch,
        recompute="none",
        **pins,
    )


LAUNCHES = Cases(
    {**dict.fromkeys(CASES_4, 4), **dict.fromkeys(CASES_8, 8)},
    *program_cases(lambda name: _plan(*{**CASES_4, **CASES_8}[name][:5])),
    case_of=lambda test, params: list(CASES_8 if "8_ranks" in test else CASES_4),
)


def _run(cases: dict, launches) -> None:
    runs = {}
    for name, (model, cluster, nodes, per_node, pins, step) in cases.items():
        plan, folder, failure = launches.result(LAUNCHES, name)
        assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp, plan.zero_stage, plan.dp_replicate) == (
            pins["dp"],
            pins["tp"],
            pins["pp"],
            pins["zero"],
            pins.get("dp_replicate", 1),
        ), name
        assert plan.num_microbatches == MICROBATCHES, name
        if plan.mesh.tp > 1:
            assert plan.tensor_parallel, f"{name}: a tp plan shards something"
        program = folder / "train.py"
        assert step in program.read_text(), f"{name}: the program does not call {step}"
        runs[name] = plan, folder, failure
    for name, (plan, folder, failure) in runs.items():
        assert_trains_like_one_process(name, cases[name][0], plan, folder / "out", failure)


def test_zero0_zero1_beside_tp_and_pp_and_hsdp_train_like_one_process(in_repo, launches):
    _run(CASES_4, launches)


def test_zero1_with_tp_and_pp_and_hsdp_with_tp_on_8_ranks(in_repo, launches):
    _run(CASES_8, launches)
