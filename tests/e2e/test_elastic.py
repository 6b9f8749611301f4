"""Elastic runs (``autoshard run --elastic``, ``autoshard.elastic``): a 4-rank job that loses 2 ranks re-plans
for the 2 left and goes on from its newest checkpoint, training as a 2-rank run resumed from that checkpoint."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.cli import main
from autoshard.elastic import elastic_paths
from autoshard.ir.plan import load_plan
from autoshard.runtime.faults import INJECT_ENV
from autoshard.runtime.report import read_weights
from autoshard.verify import LOSS_ATOL, LOSS_RTOL

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5  # steps 0 to 4; a checkpoint after 2 steps, ranks 2 and 3 killed after step 3: 2 ranks run steps 2 to 4


def run(plan_file, out, ckpt, *extra):
    return main(
        [
            "run",
            str(plan_file),
            "--steps",
            str(STEPS),
            "--metrics-out",
            str(out),
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "2",
            "--timeout-s",
            "60",
            *extra,
        ]
    )


def losses(out):
    return json.loads((out / "metrics.json").read_text())["losses"]


def test_a_job_that_loses_two_of_four_ranks_goes_on_with_two(in_repo, tmp_path, monkeypatch, capfd):
    """Ranks 2 and 3 are killed together after step 3 (as a node's ranks are when it goes away): the job re-plans
    for 2 ranks at the same global batch, resumes from the checkpoint after 2 steps and ends as the re-planned plan run on a
    copy of that checkpoint does: the same losses and parameters, bit for bit (one program, one checkpoint, one
    data position: nothing differs between the two runs, not even the order of a reduction)."""
    plan = autoshard.plan(
        str(ROOT / "examples/gpt.py") + ":build", cluster="local-cpu", devices_per_node=4, global_batch=8, dp=4, zero=3
    )
    plan_file = tmp_path / "plan.json"
    plan.save(plan_file)
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv(INJECT_ENV, "kill:2,3:3")
    log = tmp_path / "steps.jsonl"
    code = run(plan_file, tmp_path / "out", ckpt, "--elastic", "2:4", "--log-jsonl", str(log))
    monkeypatch.delenv(INJECT_ENV)
    captured = capfd.readouterr()
    assert code == 0, captured.out[-3000:] + captured.err[-3000:]
    assert "fault injected: kill on rank 2 at step 3" in captured.err
    assert "fault injected: kill on rank 3 at step 3" in captured.err
    assert "elastic: relaunch 1 of 3: lost rank(s) 2, 3; re-planned for 2 ranks" in captured.err, captured.err[-3000:]
    assert "resumed from checkpoint" in captured.out and "step-00000002" in captured.out, captured.out[-3000:]
    replanned_file, _ = elastic_paths(ckpt, 2)
    replanned = load_plan(replanned_file)
    assert (replanned.world_size, replanned.global_batch) == (2, plan.global_batch)
    assert len(losses(tmp_path / "out")) == STEPS - 2  # steps 2 to 4, none skipped or repeated
    # steps 2 and 3 ran on 4 ranks before the loss and again on 2 after it: the same weights (the checkpoint's,
    # resharded) on the same samples (the data position is the step's), so the same losses up to the order of
    # fp32 reductions (verify's loss tolerance)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 2, 3, 4]
    for four, two in zip(records[2:4], records[4:6]):
        assert abs(two["loss"] - four["loss"]) <= LOSS_ATOL + LOSS_RTOL * abs(four["loss"]), (four, two)

    # the uninterrupted 2-rank run of the re-planned plan from the same checkpoint
    shutil.copytree(ckpt / "step-00000002", tmp_path / "ckpt_ref" / "step-00000002")
    code = run(replanned_file, tmp_path / "ref", tmp_path / "ckpt_ref", "--program", str(tmp_path / "ref.py"))
    captured = capfd.readouterr()
    assert code == 0, captured.out[-3000:] + captured.err[-3000:]
    assert losses(tmp_path / "out") == losses(tmp_path / "ref")
    got, want = read_weights(tmp_path / "out"), read_weights(tmp_path / "ref")
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
