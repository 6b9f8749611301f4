"""The Python API trains pipeline and context-parallel plans like one process.

``api_driver.py`` builds the GPT on every rank, applies each plan with ``autoshard.parallelize`` and trains it
with ``Parallelized.train_step`` in a loop of its own, judged against fp32 and float64 one-process runs
(``zoo._verdict``), dropout off:

    dp 2 x pp 2 (1F1B, ZeRO-1)   train_step slices each global batch over dp and runs the schedule
    dp 2 x cp 2 (ZeRO-3)         the ranks read their share with Parallelized.data_loader
                                 (train_step(..., local=True)), cut the tokens and run the ring

(dp 1 x cp 2 through the API is ``test_context_parallel.py``'s ``gpt-cp2-api``.) Both are jobs of the session's
4-rank torchrun launch (``one_launch.Cases``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import autoshard
from e2e.one_launch import Cases, assert_trains_like_one_process, attempt, job
from e2e.zoo import GLOBAL_BATCH, program_case

pytestmark = pytest.mark.e2e

GPT = "examples/gpt.py:build"
RANKS = 4
API_DRIVER = Path(__file__).with_name("api_driver.py")
CASES = {  # name: (pins, the driver's own flags)
    "gpt-dp2-pp2-api": (dict(dp=2, pp=2, tp=1, zero=1, schedule="1f1b", microbatch_size=2), []),
    "gpt-dp2-cp2-api": (dict(dp=2, cp=2, tp=1, pp=1, zero=3, microbatch_size=2), ["--data-loader"]),
}


def _prepare(names: list[str], ranks: int, folder: Path) -> dict:
    def one(name):
        pins, flags = CASES[name]
        plan = autoshard.plan(
            GPT, cluster="local-cpu", devices_per_node=ranks, global_batch=GLOBAL_BATCH, recompute="none", **pins
        )
        (folder / name).mkdir(parents=True, exist_ok=True)
        plan.save(folder / name / "plan.json")
        case = program_case(name, API_DRIVER, folder / name / "out")
        return [job(API_DRIVER, [folder / name / "plan.json", *case["args"], *flags], case["metrics_out"])], (
            plan,
            folder / name,
        )

    return {name: attempt(lambda: one(name)) for name in names}


# name -> (plan, its folder, its failure: "" when it ran to its end)
LAUNCHES = Cases(
    dict.fromkeys(CASES, RANKS),
    _prepare,
    finish=lambda name, state, failures: (*state, failures[0]),
    case_of=lambda test, params: params.get("case"),
)


@pytest.mark.parametrize("case", list(CASES))
def test_parallelized_train_step_trains_like_one_process(in_repo, launches, case):
    plan, folder, failure = launches.result(LAUNCHES, case)
    pins = CASES[case][0]
    assert (plan.mesh.dp, plan.mesh.pp, plan.mesh.cp) == (pins["dp"], pins.get("pp", 1), pins.get("cp", 1)), case
    assert plan.num_microbatches == 2, case
    assert_trains_like_one_process(case, GPT, plan, folder / "out", failure)
