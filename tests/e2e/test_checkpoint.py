"""DCP checkpoints: a run stopped and resumed matches an uninterrupted run bit for bit."""

import json

import pytest
import torch

import autoshard
from autoshard.launch import run_torchrun, write_program
from autoshard.runtime.checkpoint import latest

pytestmark = pytest.mark.e2e


def train(program, tmp_path, name, steps, *extra):
    out = tmp_path / name
    proc = run_torchrun(program, 2, ["--steps", str(steps), "--metrics-out", str(out), *extra], quiet=True)
    assert proc.returncode == 0, proc.stdout[-2000:]
    return json.loads((out / "metrics.json").read_text())["losses"], torch.load(out / "params.pt", weights_only=True)


@pytest.mark.parametrize("zero", [0, 3])
def test_resume_is_bit_exact(in_repo, tmp_path, zero):
    plan = autoshard.plan("examples/gpt.py:build", cluster="local-cpu", devices_per_node=2, global_batch=8, zero=zero)
    program = write_program(plan, tmp_path / "train.py")
    full_losses, full_params = train(program, tmp_path, "full", 4)
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
    first_losses, _ = train(program, tmp_path, "first", 2, *ckpt)
    assert latest(tmp_path / "ckpt").name == "step-00000002"
    resumed_losses, resumed_params = train(program, tmp_path, "resumed", 4, *ckpt)
    assert first_losses + resumed_losses == full_losses
    for name, value in full_params.items():
        assert torch.equal(resumed_params[name], value), name
    assert latest(tmp_path / "ckpt").name == "step-00000004"


def test_partial_checkpoint_is_ignored(tmp_path):
    (tmp_path / "step-00000002").mkdir()
    (tmp_path / "step-00000002" / ".metadata").write_bytes(b"x")
    (tmp_path / ".step-00000004.partial").mkdir()  # a write that crashed
    (tmp_path / "step-00000006").mkdir()  # no .metadata: never finished
    assert latest(tmp_path).name == "step-00000002"
    assert latest(tmp_path / "missing") is None
