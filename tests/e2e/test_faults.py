"""Faults under ``autoshard run``: a killed rank, a kill during a checkpoint write, a hung rank (``runtime.faults``)."""

import json
import time
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.cli import main
from autoshard.runtime.checkpoint import latest
from autoshard.runtime.faults import INJECT_ENV
from autoshard.runtime.report import read_weights

pytestmark = pytest.mark.e2e

STEPS = 6  # the restarted attempt runs 2 steps after a kill at step 4, 4 after a kill writing checkpoint 4
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    plan = autoshard.plan(
        str(ROOT / "examples/gpt.py") + ":build", cluster="local-cpu", devices_per_node=2, global_batch=8, dp=2, zero=3
    )
    path = tmp_path_factory.mktemp("faults") / "plan.json"
    plan.save(path)
    return path


def run(plan_file, out, *extra):
    return main(["run", str(plan_file), "--steps", str(STEPS), "--metrics-out", str(out), *extra])


def params(out):
    return read_weights(out)


@pytest.fixture(scope="module")
def no_fault(plan_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    assert run(plan_file, out) == 0
    return params(out)


@pytest.mark.parametrize("fault, resumed_from", [("kill:1:4", 4), ("kill-in-checkpoint:0:4", 2)])
def test_job_survives_a_dead_rank_with_the_same_parameters(
    in_repo, plan_file, no_fault, tmp_path, monkeypatch, capfd, fault, resumed_from
):
    """SIGKILL one rank mid-run (or while it writes checkpoint 4): torchrun restarts the job, it resumes
    from the newest complete checkpoint and ends with the parameters of a run without the fault."""
    monkeypatch.setenv(INJECT_ENV, fault)
    ckpt = tmp_path / "ckpt"
    code = run(
        plan_file,
        tmp_path / "out",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "2",
        "--max-restarts",
        "1",
        "--timeout-s",
        "60",
    )
    captured = capfd.readouterr()
    assert code == 0, captured.out[-3000:] + captured.err[-3000:]
    assert f"fault injected: {fault.split(':')[0]}" in captured.err
    # the restarted attempt says where it resumes from, in one line; the surviving rank may say the restart
    # is coming (when it sees the broken collective before torchrun stops it), and then in one line too
    assert f"restart 1 of 1: every rank resumes from checkpoint step-{resumed_from:08d}" in captured.err, captured.err[
        -3000:
    ]
    survivor = [line for line in captured.err.splitlines() if "another rank ended during a collective" in line]
    assert all("restart 1 of 1" in line for line in survivor), survivor
    assert "Traceback" not in captured.err and "Connection reset" not in captured.err, captured.err[-3000:]
    losses = json.loads((tmp_path / "out" / "metrics.json").read_text())["losses"]
    assert len(losses) == STEPS - resumed_from  # the restarted attempt began at the last complete checkpoint
    got = params(tmp_path / "out")
    for name, value in no_fault.items():
        assert torch.equal(got[name], value), name
    assert latest(ckpt).name == f"step-{STEPS:08d}"
    assert not list(ckpt.glob(".*.partial"))


def test_hung_rank_fails_the_job_within_the_timeout_naming_it(in_repo, plan_file, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(INJECT_ENV, "hang:1:3")
    timeout_s = 10
    start = time.monotonic()
    code = run(plan_file, tmp_path / "out", "--timeout-s", str(timeout_s))
    elapsed_s = time.monotonic() - start
    captured = capfd.readouterr()
    assert code != 0
    assert "rank(s) 1 never joined it" in captured.err, captured.err[-3000:]
    assert elapsed_s < timeout_s + 60


def test_restarts_need_a_checkpoint_dir(in_repo, plan_file, capsys):
    assert main(["run", str(plan_file), "--max-restarts", "2"]) == 2
    assert "without --checkpoint-dir" in capsys.readouterr().err
