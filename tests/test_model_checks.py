"""Plan-time checks of the model itself: its prints stay off stdout, its output and targets are usable,
its parameters are priced by their dtype, and a plan names only modules the model has."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from autoshard.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MLP = '''
import torch
import torch.nn as nn

{top}

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        {forward}
        return {ret}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(4)))

    def forward(self, x):
        {net_forward}


def build():
    {build}
    return Net(){dtype}


def example_batch(batch_size):
    x = torch.randn(batch_size, 16)
    return (x,), {targets}
'''


def model_file(tmp_path, name="m.py", top="", forward="pass", ret="x + self.fc2(torch.relu(self.fc1(x)))",
               net_forward="return self.blocks(x)", build="pass", dtype="", targets="torch.randn(batch_size, 16)"):
    path = tmp_path / name
    path.write_text(MLP.format(top=top, forward=forward, ret=ret, net_forward=net_forward, build=build, dtype=dtype,
                               targets=targets))
    return f"{path}:build"


PLAN = ["--cluster", "local-cpu", "--devices-per-node", "2", "--global-batch", "4", "--no-cache"]


def test_json_stays_pure_when_the_model_prints(tmp_path, capfd):
    spec = model_file(tmp_path, top='print("hello from import")', build='print("hello from build")',
                      forward='print("hello from forward")')
    assert main(["plan", spec, *PLAN, "--json"]) == 0
    out, err = capfd.readouterr()
    plan = json.loads(out)  # nothing but the JSON
    assert plan["mesh"]
    for where in ("import", "build", "forward"):
        assert f"hello from {where}" in err


def test_json_stays_pure_from_the_forked_capture(tmp_path):
    """A fresh ``autoshard plan`` captures in a forked child (passes.front); its prints go to stderr too."""
    spec = model_file(tmp_path, top='import os; print("hello from import"); os.system("echo hello from a shell")',
                      forward='print("hello from forward")')
    env = {**os.environ, "AUTOSHARD_CAPTURE_AHEAD": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "autoshard.cli", "plan", spec, *PLAN, "--json"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    json.loads(proc.stdout)
    assert "hello from import" in proc.stderr and "hello from a shell" in proc.stderr
    assert "hello from forward" in proc.stderr


def test_checkpoint_of_another_model_names_the_first_difference(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from autoshard.errors import AutoshardError
    from autoshard.runtime.checkpoint import check_same_model

    saved = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    dcp.save({"model": saved.state_dict(), "optim": {}, "steps_done": torch.tensor(2)}, checkpoint_id=tmp_path)
    check_same_model(tmp_path, saved.state_dict())  # the same model: no complaint
    wider = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 4)).state_dict()
    with pytest.raises(AutoshardError, match=r"'0.weight' is \[8, 4\] there and \[16, 4\] here \(2 more differ\)"):
        check_same_model(tmp_path, wider)
    deeper = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4), torch.nn.Linear(4, 4)).state_dict()
    with pytest.raises(AutoshardError, match=r"it has no '2.bias' \(1 more missing\)"):
        check_same_model(tmp_path, deeper)
    first = {k: v for k, v in saved.state_dict().items() if k.startswith("0.")}
    with pytest.raises(AutoshardError, match=r"it has '1.bias', which this model lacks"):
        check_same_model(tmp_path, first)
    check_same_model(tmp_path, first, this_rank_has_all=False)  # a pipeline rank holds its stages only
