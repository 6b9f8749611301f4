"""DCP checkpoints: a run stopped and resumed matches an uninterrupted run bit for bit."""

import functools
import json
import shutil

import pytest
import torch

import autoshard
from autoshard.launch import run_torchrun, write_program
from autoshard.runtime.checkpoint import latest

pytestmark = pytest.mark.e2e


def train_ranks(program, tmp_path, name, steps, *extra, ranks):
    out = tmp_path / name
    proc = run_torchrun(program, ranks, ["--steps", str(steps), "--metrics-out", str(out), *extra], quiet=True)
    assert proc.returncode == 0, proc.stdout[-2000:]
    return json.loads((out / "metrics.json").read_text())["losses"], torch.load(out / "params.pt", weights_only=True)


GPT, GPT2 = "examples/gpt.py:build", "tests/models/hf_gpt2.py:build"
CASES = {  # name: (model, cluster, ranks, pins)
    "zero0": (GPT, "local-cpu", 2, dict(zero=0)),
    "zero1": (GPT, "local-cpu", 2, dict(zero=1, dp=2)),
    "zero3": (GPT, "local-cpu", 2, dict(zero=3)),
    "gpt2-pp2-tied": (GPT2, "local-cpu", 2, dict(pp=2, schedule="1f1b")),
    "dp2-tp2-pp2-zero3": (GPT, "tests/clusters/fast_link_cpu.yaml", 8,
                          dict(dp=2, tp=2, pp=2, zero=3, schedule="1f1b")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_is_bit_exact(in_repo, tmp_path, case):
    model, cluster, ranks, pins = CASES[case]
    plan = autoshard.plan(model, cluster=cluster, devices_per_node=ranks, global_batch=8, **pins)
    assert all(getattr(plan.mesh, a) == pins.get(a, getattr(plan.mesh, a)) for a in ("dp", "tp", "pp"))
    program = write_program(plan, tmp_path / "train.py")
    train = functools.partial(train_ranks, ranks=ranks)
    # Two launches, not three: the uninterrupted run keeps its step-2 checkpoint, and a copy of it
    # alone is what the resumed run finds (as if the job had stopped after step 2).
    full_losses, full_params = train(program, tmp_path, "full", 4, "--checkpoint-dir", str(tmp_path / "ckpt"),
                                     "--checkpoint-every", "2")
    assert [p.name for p in sorted((tmp_path / "ckpt").glob("step-*"))] == ["step-00000002", "step-00000004"]
    shutil.copytree(tmp_path / "ckpt" / "step-00000002", tmp_path / "stopped" / "step-00000002")
    resumed_losses, resumed_params = train(program, tmp_path, "resumed", 4, "--checkpoint-dir",
                                           str(tmp_path / "stopped"), "--checkpoint-every", "2")
    assert resumed_losses == full_losses[2:]  # steps 3 and 4 only: it resumed, not restarted
    for name, value in full_params.items():
        assert torch.equal(resumed_params[name], value), name
    assert latest(tmp_path / "stopped").name == "step-00000004"


def test_partial_checkpoint_is_ignored(tmp_path):
    (tmp_path / "step-00000002").mkdir()
    (tmp_path / "step-00000002" / ".metadata").write_bytes(b"x")
    (tmp_path / ".step-00000004.partial").mkdir()  # a write that crashed
    (tmp_path / "step-00000006").mkdir()  # no .metadata: never finished
    assert latest(tmp_path).name == "step-00000002"
    assert latest(tmp_path / "missing") is None


def write_foreign_checkpoint(folder, step=2):
    """A complete DCP checkpoint of another model (one process, no process group)."""
    import torch.distributed.checkpoint as dcp

    other = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32))
    dcp.save({"model": other.state_dict(), "optim": {}, "steps_done": torch.tensor(step)},
             checkpoint_id=folder / f"step-{step:08d}")


def test_checkpoint_of_another_model_is_refused_in_one_line(in_repo, tmp_path, capfd):
    from autoshard.cli import main

    plan = autoshard.plan("tests/models/mlp.py:build", cluster="local-cpu", devices_per_node=2, global_batch=8, dp=2)
    plan.save(tmp_path / "plan.json")
    write_foreign_checkpoint(tmp_path / "ckpt")
    code = main(["run", str(tmp_path / "plan.json"), "--steps", "4", "--checkpoint-dir", str(tmp_path / "ckpt")])
    out, err = capfd.readouterr()
    assert code == 2, out[-2000:] + err[-2000:]
    ours = [line for line in (out + err).splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and "was written for another model: it has no '0.fc1.bias'" in ours[0], out + err
    assert "Traceback" not in out + err and "rank 0 failed" not in out + err
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".autoshard.lock", "step-00000002"]
