"""autoshard dryrun: one rank's setup and two steps on fake tensors over a fake process group, its peak memory by
part beside the plan's prediction; plans it cannot run are refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoshard.dryrun import PARTS, dryrun
from autoshard.errors import AutoshardError
from autoshard.ir.plan import load_plan

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"


def test_dryrun_json_gives_each_rank_its_measured_and_predicted_parts():
    out = subprocess.run([sys.executable, "-m", "autoshard", "dryrun", str(GOLDEN / "hsdp_zero3.plan.json"),
                          "--rank", "3", "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = json.loads(out.stdout)["ranks"]
    assert [r["rank"] for r in ranks] == [3]
    report = ranks[0]
    plan = load_plan(GOLDEN / "hsdp_zero3.plan.json")
    # the predicted parts' sum: the plan's peak adds the allocator's slack, which the tracker cannot see
    assert report["predicted_peak_bytes"] == sum(predicted for _, predicted in report["parts"].values())
    assert report["predicted_peak_bytes"] < plan.predicted.memory.peak_bytes
    assert set(report["parts"]) == set(PARTS)
    assert report["peak_bytes"] == sum(measured for measured, _ in report["parts"].values())
    measured_optimizer, predicted_optimizer = report["parts"]["optimizer"]
    # AdamW's two fp32 moments of this rank's FSDP shard: the one part both sides count the same way
    assert measured_optimizer == pytest.approx(predicted_optimizer, rel=0.02)
    assert report["parts"]["activations"][0] > 0


def test_plans_it_cannot_run_are_refused_with_the_reason():
    with pytest.raises(AutoshardError, match="expert"):
        dryrun(load_plan(GOLDEN / "dp_ep_zero3.plan.json"))


def _held(plan, names: tuple[str, ...] | None = None) -> tuple[int, int]:
    """(elements, tensors) of examples/gpt.py's parameters under ``names`` (all without), built on meta."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import gpt

    with torch.device("meta"):
        params = dict(gpt.build().named_parameters())
    held = [p for name, p in params.items() if names is None or any(name.startswith(m + ".") for m in names)]
    return sum(p.numel() for p in held), len(held)


def _assert_holds(report, elements: int, tensors: int) -> None:
    """fp32 weights, and AdamW's two fp32 moments and 4-byte step count per parameter tensor."""
    assert report.parts["weights"][0] == 4 * elements
    assert report.parts["optimizer"][0] == 8 * elements + 4 * tensors


@pytest.fixture(scope="module")
def pipeline_plan(in_repo_module):
    from autoshard.api import estimate

    return estimate("examples/gpt.py:build", cluster=str(ROOT / "tests" / "clusters" / "fast_link_cpu.yaml"),
                    devices_per_node=2, global_batch=4, dp=1, tp=1, pp=2, zero=0, microbatch_size=1,
                    recompute="none", schedule="1f1b")


def test_a_pipeline_runs_its_first_and_last_stage_holding_their_stages_weights(pipeline_plan):
    reports = dryrun(pipeline_plan)
    assert [r.rank for r in reports] == [0, 1]  # the first stage's rank and the last's, by default
    for report, stage in zip(reports, pipeline_plan.stages):
        assert stage.ranks == (report.rank,)
        _assert_holds(report, *_held(pipeline_plan, stage.modules))
        assert report.parts["activations"][0] > 0


def test_ddp_runs_holding_the_whole_model_and_its_gradient_buckets(in_repo):
    plan = load_plan(GOLDEN / "dp_zero0.plan.json")
    [report] = dryrun(plan, ranks=[2])
    elements, tensors = _held(plan)
    _assert_holds(report, elements, tensors)
    assert report.parts["grads"][0] == 4 * elements  # the buckets, every gradient a view of one


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(AutoshardError, match="--rank 9"):
        dryrun(load_plan(GOLDEN / "dp_zero3.plan.json"), ranks=[9])
