"""A model whose ``forward`` reads its inputs in another order than it declares them trains in pipeline
stages like one process.

``tests/models/out_of_order_inputs.py``: ``forward(input_ids, pixel_values)`` runs its vision tower
(``pixel_values``) first, so the traced graph, and ``pipeline()``'s first stage, meet the inputs in the
other order. Planned at pp 2 (dp 1, tp 1) with 1F1B, GPipe and interleaved 1F1B (2 virtual stages),
emitted, run on 2 CPU ranks in the session's 2-rank torchrun launch (``one_launch.Cases``) and judged
against fp32 and float64 one-process runs (``zoo._verdict``).
"""

from __future__ import annotations

import pytest

import autoshard
from e2e.one_launch import Cases, assert_trains_like_one_process, program_cases
from e2e.zoo import GLOBAL_BATCH

pytestmark = pytest.mark.e2e

MODEL = "tests/models/out_of_order_inputs.py:build"
CASES = {
    "pp2-1f1b": dict(schedule="1f1b"),
    "pp2-gpipe": dict(schedule="gpipe"),
    "pp2-interleaved": dict(schedule="interleaved-1f1b", virtual_stages=2),
}


def _plan(name):
    return autoshard.plan(
        MODEL,
        cluster="local-cpu",
        global_batch=GLOBAL_BATCH,
        devices_per_node=2,
        pp=2,
        dp=1,
        tp=1,
        microbatch_size=2,
        **CASES[name],
    )


LAUNCHES = Cases(dict.fromkeys(CASES, 2), *program_cases(_plan), case_of=lambda test, params: list(CASES))


def test_inputs_read_out_of_declared_order_reach_the_first_stage_in_order(in_repo, launches):
    runs = {}
    for name, pins in CASES.items():
        plan, folder, failure = launches.result(LAUNCHES, name)
        assert (plan.mesh.pp, plan.schedule) == (2, pins["schedule"]), name
        runs[name] = plan, folder, failure
    for name, (plan, folder, failure) in runs.items():
        assert_trains_like_one_process(name, MODEL, plan, folder / "out", failure)
