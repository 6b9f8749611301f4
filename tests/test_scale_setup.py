"""A program for a plan whose model does not fit this machine gets through its setup on fake devices: Llama-3-70B
(282 GB of fp32 weights) under FSDP over 64 ranks, one rank of a fake 64-rank process group, holding 1/64 of the
model as fake tensors while the process's memory hardly grows (tests/scale/setup_on_fake_ranks.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "tests" / "scale" / "llama3_70b_fsdp64.plan.json"  # autoshard plan benchmarks/llama3.py:llama3_70b
# --cluster dgx-h100 --nodes 8 --dp 64 --zero 3 --tp 1 --pp 1 --global-batch 64


def test_a_70b_plan_sets_up_one_rank_of_64_without_making_the_model():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scale" / "setup_on_fake_ranks.py"), str(PLAN), "5"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    machine_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert report["world_size"] == 64
    assert report["whole_model_bytes"] > machine_bytes  # the model could never be built here
    assert report["all_dtensors"] and not report["any_meta"]  # every parameter is this rank's shard, made
    share = report["rank_param_bytes"] / report["whole_model_bytes"]
    assert 1 / 64 <= share < 1.02 / 64
    grown = report["max_rss_after_bytes"] - report["max_rss_before_bytes"]
    assert grown < 512 * 2**20, f"setup grew the process by {grown / 2**20:.0f} MiB"
    assert report["optimizer"] == "AdamW"
