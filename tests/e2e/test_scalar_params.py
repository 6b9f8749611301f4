"""0-d (scalar) parameters, as CLIP's ``logit_scale``, train like one process in every program kind.

FSDP2 cannot shard a 0-d parameter; the runtime keeps such parameters whole on every rank (left out
of ``fully_shard`` and ``replicate``) and averages their gradients over dp once per step: on the
last micro-batch's backward, or after the schedule on pipeline stages. ``tests/models/scalar_param.py``
has a scalar gate in each block and a scalar on the head's output; each case is planned with its
decisions pinned, emitted, run on CPU ranks and judged against fp32 and float64 one-process runs
(``zoo._verdict``), two micro-batches per step:

    2 ranks    dp 2 with ZeRO-0 (DDP), ZeRO-1 (DDP + ZeroRedundancyOptimizer), ZeRO-2 and ZeRO-3
               (FSDP2); pp 2 (1F1B); tp 2
    4 ranks    pp 2 x dp 2 with ZeRO-1 and ZeRO-0 (FSDP2 / replicate per stage); tp 2 x dp 2 with
               ZeRO-0 (replicate) and ZeRO-3; pp 2 x tp 2 (local shards inside the stages); HSDP
               2 x 2 with ZeRO-3

The programs run in the session's one torchrun launch per world size (``one_launch.Cases``).
"""

from __future__ import annotations

import pytest

import autoshard
from e2e.one_launch import Cases, assert_trains_like_one_process, program_cases
from e2e.zoo import FAST_LINK, GLOBAL_BATCH

pytestmark = pytest.mark.e2e

MODEL = "tests/models/scalar_param.py:build"
MICROBATCHES = 2
# name: (cluster, nodes, devices per node, pins)
CASES_2 = {
    "dp2-zero0": ("local-cpu", 1, 2, dict(dp=2, tp=1, pp=1, zero=0)),
    "dp2-zero1": ("local-cpu", 1, 2, dict(dp=2, tp=1, pp=1, zero=1)),
    "dp2-zero2": ("local-cpu", 1, 2, dict(dp=2, tp=1, pp=1, zero=2)),
    "dp2-zero3": ("local-cpu", 1, 2, dict(dp=2, tp=1, pp=1, zero=3)),
    "pp2": ("local-cpu", 1, 2, dict(dp=1, tp=1, pp=2, zero=0, schedule="1f1b")),
    "tp2": (FAST_LINK, 1, 2, dict(dp=1, tp=2, pp=1, zero=0)),
}
CASES_4 = {
    "pp2-dp2-zero1": ("local-cpu", 1, 4, dict(dp=2, tp=1, pp=2, zero=1, schedule="1f1b")),
    "pp2-dp2-zero0": ("local-cpu", 1, 4, dict(dp=2, tp=1, pp=2, zero=0, schedule="gpipe")),
    "tp2-dp2-zero0": (FAST_LINK, 1, 4, dict(dp=2, tp=2, pp=1, zero=0)),
    "tp2-dp2-zero3": (FAST_LINK, 1, 4, dict(dp=2, tp=2, pp=1, zero=3)),
    "pp2-tp2": (FAST_LINK, 1, 4, dict(dp=1, tp=2, pp=2, zero=0, schedule="1f1b")),
    "hsdp2x2-zero3": ("local-cpu", 2, 2, dict(dp=4, tp=1, pp=1, zero=3, dp_replicate=2)),
}


def _plan(cluster, nodes, per_node, pins):
    microbatch = GLOBAL_BATCH // (pins["dp"] * MICROBATCHES)
    return autoshard.plan(
        MODEL,
        cluster=cluster,
        nodes=nodes,
        devices_per_node=per_node,
        global_batch=GLOBAL_BATCH,
        microbatch_size=microbatch,
        recompute="none",
        **pins,
    )


LAUNCHES = Cases(
    {**dict.fromkeys(CASES_2, 2), **dict.fromkeys(CASES_4, 4)},
    *program_cases(lambda name: _plan(*{**CASES_2, **CASES_4}[name])),
    case_of=lambda test, params: list(CASES_2 if "two_ranks" in test else CASES_4),
)


def _run(cases: dict, launches) -> None:
    runs = {}
    for name, (cluster, nodes, per_node, pins) in cases.items():
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
            assert any(s != "replicate" for s in plan.tensor_parallel.values()), f"{name}: nothing sharded over tp"
        runs[name] = plan, folder, failure
    for name, (plan, folder, failure) in runs.items():
        assert_trains_like_one_process(name, MODEL, plan, folder / "out", failure)


def test_scalar_parameters_on_two_ranks_train_like_one_process(in_repo, launches):
    _run(CASES_2, launches)


def test_scalar_parameters_beside_pipeline_tensor_parallel_and_hsdp_train_like_one_process(in_repo, launches):
    _run(CASES_4, launches)
