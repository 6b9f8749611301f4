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
    assert report["predicted_peak_bytes"] == plan.predicted.memory.peak_bytes
    assert set(report["parts"]) == set(PARTS)
    assert report["peak_bytes"] == sum(measured for measured, _ in report["parts"].values())
    measured_optimizer, predicted_optimizer = report["parts"]["optimizer"]
    # AdamW's two fp32 moments of this rank's FSDP shard: the one part both sides count the same way
    assert measured_optimizer == pytest.approx(predicted_optimizer, rel=0.02)
    assert report["parts"]["activations"][0] > 0


@pytest.mark.parametrize("kind, why", [("tp_pp", "pipeline"), ("dp_zero0", "DDP"), ("dp_ep_zero3", "expert")])
def test_plans_it_cannot_run_are_refused_with_the_reason(kind, why):
    with pytest.raises(AutoshardError, match=why):
        dryrun(load_plan(GOLDEN / f"{kind}.plan.json"))


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(AutoshardError, match="--rank 9"):
        dryrun(load_plan(GOLDEN / "dp_zero3.plan.json"), ranks=[9])
