"""A checkpoint saved under one plan resumes under another (DCP reshards by parameter name)."""

import shutil

import pytest
import torch

import autoshard
from autoshard.launch import run_torchrun, write_program
from autoshard.verify import WEIGHT_RTOL, weight_atol

pytestmark = pytest.mark.e2e

GPT, FAST = "examples/gpt.py:build", "tests/clusters/fast_link_cpu.yaml"
LR = 1e-3
CASES = {  # name: (cluster, ranks, pins saved under), (cluster, ranks, pins resumed under)
    "dp4-zero3-to-dp2-tp2": (("local-cpu", 4, dict(dp=4, zero=3)), (FAST, 4, dict(dp=2, tp=2, zero=3))),
    "pp2-1f1b-to-pp2-interleaved": (("local-cpu", 2, dict(pp=2, schedule="1f1b")),
                                    ("local-cpu", 2, dict(pp=2, schedule="interleaved-1f1b"))),
    "dp2-zero0-to-pp2": (("local-cpu", 2, dict(dp=2, zero=0)), ("local-cpu", 2, dict(pp=2, schedule="gpipe"))),
}


def program(tmp_path, name, cluster, ranks, pins):
    plan = autoshard.plan(GPT, cluster=cluster, devices_per_node=ranks, global_batch=8, **pins)
    return write_program(plan, tmp_path / f"{name}.py"), ranks


def train(prog, tmp_path, name, steps, ckpt):
    path, ranks = prog
    out = tmp_path / name
    proc = run_torchrun(path, ranks, ["--steps", str(steps), "--lr", str(LR), "--metrics-out", str(out),
                                      "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"], quiet=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return torch.load(out / "params.pt", weights_only=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpoint_resumes_under_another_plan(in_repo, tmp_path, case):
    saved_under, resumed_under = CASES[case]
    a, b = program(tmp_path, "a", *saved_under), program(tmp_path, "b", *resumed_under)
    after_two = train(a, tmp_path, "a2", 2, tmp_path / "ckpt")
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt_b")
    loaded = train(b, tmp_path, "b2", 2, tmp_path / "ckpt_b")  # resumes at step 2, runs nothing
    assert loaded.keys() == after_two.keys()
    for name, value in after_two.items():
        assert torch.equal(loaded[name], value), name  # the same parameters, whatever the layout
    # one more step under each plan: equal up to reduction order only if the optimizer state moved too
    next_a = train(a, tmp_path, "a3", 3, tmp_path / "ckpt")
    next_b = train(b, tmp_path, "b3", 3, tmp_path / "ckpt_b")
    for name, value in next_a.items():
        torch.testing.assert_close(next_b[name], value, rtol=WEIGHT_RTOL, atol=weight_atol(LR), msg=name)
