"""autoshard dryrun: one rank's setup and two steps on fake tensors over a fake process group, its peak memory by
part beside the plan's prediction; plans it cannot run are refused in one line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from autoshard.dryrun import PARTS, dryrun, summary_lines
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


def test_expert_parallelism_runs_on_the_balanced_split_holding_its_expert_shards(in_repo):
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "models"))
    import hf_mixtral

    plan = load_plan(GOLDEN / "dp_ep_zero3.plan.json")
    [report] = dryrun(plan)  # rank 0 holds experts 0 and 1 of each layer's 4
    assert any("balanced" in line for line in summary_lines(plan, [report]))
    dp, ep = plan.mesh.dp, plan.ep
    with torch.device("meta"):
        params = dict(hf_mixtral.build().named_parameters())

    def first_chunk(shape, ways: int) -> int:  # FSDP2's shard on dp rank 0
        return math.ceil(shape[0] / ways) * math.prod(shape[1:])

    elements = sum(first_chunk((p.shape[0] // ep, *p.shape[1:]), dp // ep)
                   if any(name.startswith(e + ".") for e in plan.experts) else first_chunk(p.shape, dp)
                   for name, p in params.items())
    assert report.parts["optimizer"][0] == 8 * elements + 4 * len(params)


def test_plan_dryrun_prints_the_chosen_plans_dry_run(pipeline_plan, tmp_path):
    out = subprocess.run([sys.executable, "-m", "autoshard", "plan", "examples/gpt.py:build", "--cluster",
                          "tests/clusters/fast_link_cpu.yaml", "--devices-per-node", "2", "--global-batch", "4",
                          "--tp", "1", "--pp", "1", "--zero", "0", "-o", str(tmp_path / "plan.json"), "--dryrun"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert load_plan(tmp_path / "plan.json").decisions.dp_runtime.wrapper == "DistributedDataParallel"
    report = out.stdout[out.stdout.index("dry run: dp=2"):]
    assert "rank 0: peak" in report and "optimizer" in report


def test_bad_input_is_one_line():
    out = subprocess.run([sys.executable, "-m", "autoshard", "dryrun", "no-such-plan.json"], capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 2 and out.stderr.startswith("error: ") and len(out.stderr.splitlines()) == 1, out.stderr


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(AutoshardError, match="--rank 9"):
        dryrun(load_plan(GOLDEN / "dp_zero3.plan.json"), ranks=[9])
