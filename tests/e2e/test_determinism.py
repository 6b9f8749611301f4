"""Determinism: the same plan and seed give the same losses and parameters, bit for bit, run after run."""

import json

import pytest
import torch

import autoshard
from autoshard.launch import run_torchrun, write_program

pytestmark = pytest.mark.e2e

GPT = "examples/gpt.py:build"
CASES = {  # name: (ranks, pins)
    "dp2-zero3": (2, dict(dp=2, zero=3, microbatch_size=2)),
    "pp2-1f1b": (2, dict(pp=2, schedule="1f1b")),
}


def train(program, ranks, out, seed):
    proc = run_torchrun(program, ranks, ["--steps", "3", "--seed", str(seed), "--metrics-out", str(out)], quiet=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    losses = json.loads((out / "metrics.json").read_text())["losses"]
    return losses, torch.load(out / "params.pt", weights_only=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_plan_and_seed_give_identical_losses_and_parameters(in_repo, tmp_path, case):
    ranks, pins = CASES[case]
    plan = autoshard.plan(GPT, cluster="local-cpu", devices_per_node=ranks, global_batch=8, **pins)
    program = write_program(plan, tmp_path / "train.py")
    first_losses, first = train(program, ranks, tmp_path / "a", seed=0)
    again_losses, again = train(program, ranks, tmp_path / "b", seed=0)
    assert again_losses == first_losses  # exact float equality, every step
    assert first.keys() == again.keys()
    for name, value in first.items():
        assert torch.equal(again[name], value), name
    other_losses, _ = train(program, ranks, tmp_path / "c", seed=1)
    assert other_losses != first_losses  # the seed is really what fixes the data and the weights
