"""Determinism: the same plan and seed give the same losses and parameters, bit for bit, run after run."""

import json

import pytest
import torch

import autoshard
from autoshard.launch import write_program
from autoshard.runtime.report import read_weights
from e2e.ckpt_driver import ROOT, job, run_jobs

pytestmark = pytest.mark.e2e

GPT = "examples/gpt.py:build"
CASES = {  # name: (ranks, pins)
    "dp2-zero3": (2, dict(dp=2, zero=3, microbatch_size=2)),
    "pp2-1f1b": (2, dict(pp=2, schedule="1f1b")),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per case, runs "a" and "c" (seed 0 and 1) in one launch and run "b" (seed 0 again) in another: the
    two seed-0 runs of a case are each their launch's job at the same place, in processes of their own."""
    root = tmp_path_factory.mktemp("determinism")
    first, again = [], []
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        for case in sorted(CASES):
            ranks, pins = CASES[case]
            assert ranks == 2
            plan = autoshard.plan(GPT, cluster="local-cpu", devices_per_node=ranks, global_batch=8, **pins)
            program = write_program(plan, root / case / "train.py")
            first.append(train(program, root / case / "a", seed=0))
            again.append(train(program, root / case / "b", seed=0))
        first += [train(j["program"], root / case / "c", seed=1) for case, j in zip(sorted(CASES), first)]
        run_jobs(2, first, root)
        run_jobs(2, again, root)
    return root


def train(program, out, seed):
    return job(program, "--steps", 3, "--seed", seed, "--metrics-out", out)


def metrics(out):
    losses = json.loads((out / "metrics.json").read_text())["losses"]
    return losses, read_weights(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_plan_and_seed_give_identical_losses_and_parameters(runs, case):
    first_losses, first = metrics(runs / case / "a")
    again_losses, again = metrics(runs / case / "b")
    assert again_losses == first_losses  # exact float equality, every step
    assert first.keys() == again.keys()
    for name, value in first.items():
        assert torch.equal(again[name], value), name
    other_losses, _ = metrics(runs / case / "c")
    assert other_losses != first_losses  # the seed is really what fixes the data and the weights
