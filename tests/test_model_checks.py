"""Plan-time checks of the model itself: its prints stay off stdout, its output and targets are usable,
its parameters are priced by their dtype, and a plan names only modules the model has."""

import json
import os
import subprocess
import sys

import pytest

from autoshard.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MLP = """
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
"""


def model_file(
    tmp_path,
    name="m.py",
    top="",
    forward="pass",
    ret="x + self.fc2(torch.relu(self.fc1(x)))",
    net_forward="return self.blocks(x)",
    build="pass",
    dtype="",
    targets="torch.randn(batch_size, 16)",
):
    path = tmp_path / name
    path.write_text(
        MLP.format(
            top=top, forward=forward, ret=ret, net_forward=net_forward, build=build, dtype=dtype, targets=targets
        )
    )
    return f"{path}:build"


PLAN = ["--cluster", "local-cpu", "--devices-per-node", "2", "--global-batch", "4", "--no-cache"]


def test_json_stays_pure_when_the_model_prints(tmp_path, capfd):
    spec = model_file(
        tmp_path,
        top='print("hello from import")',
        build='print("hello from build")',
        forward='print("hello from forward")',
    )
    assert main(["plan", spec, *PLAN, "--json"]) == 0
    out, err = capfd.readouterr()
    plan = json.loads(out)  # nothing but the JSON
    assert plan["decisions"]["mesh"]
    for where in ("import", "build", "forward"):
        assert f"hello from {where}" in err


def test_json_stays_pure_from_the_forked_capture(tmp_path):
    """A fresh ``autoshard plan`` captures in a forked child (passes.capturing.front); its prints go to stderr too."""
    spec = model_file(
        tmp_path,
        top='import os; print("hello from import"); os.system("echo hello from a shell")',
        forward='print("hello from forward")',
    )
    env = {**os.environ, "AUTOSHARD_CAPTURE_AHEAD": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, "-m", "autoshard.cli", "plan", spec, *PLAN, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
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


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """A tensor-parallel and a pipeline plan of the example GPT, as JSON documents."""
    import autoshard

    folder = tmp_path_factory.mktemp("plans")
    out = {}
    for name, pins in (("tp", dict(tp=2)), ("pp", dict(pp=2))):
        plan = autoshard.plan(
            os.path.join(ROOT, "examples/gpt.py") + ":build",
            cluster="local-cpu",
            devices_per_node=2,
            global_batch=8,
            **pins,
        )
        plan.save(folder / f"{name}.json")
        out[name] = json.loads((folder / f"{name}.json").read_text())
    return out


def _rename_first_tp(doc):
    first = sorted(doc["layout"]["tensor_parallel"])[0]
    doc["layout"]["tensor_parallel"]["h.0.attn.nope"] = doc["layout"]["tensor_parallel"].pop(first)
    return "h.0.attn.nope", "tensor_parallel"


def _rename_stage_module(doc):
    doc["layout"]["stages"][1]["modules"][0] = "h.77"
    return "h.77", "stage 1"


def _rename_split_point(doc):
    doc["layout"]["split_points"][0] = "blocks.3"
    return "blocks.3", "split_points"


@pytest.mark.parametrize(
    "kind, edit", [("tp", _rename_first_tp), ("pp", _rename_stage_module), ("pp", _rename_split_point)]
)
def test_compile_refuses_a_plan_naming_a_module_the_model_lacks(plans, tmp_path, capfd, kind, edit):
    doc = json.loads(json.dumps(plans[kind]))
    name, where = edit(doc)
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    program = tmp_path / "train.py"
    code = main(["compile", str(tmp_path / "plan.json"), "-o", str(program)])
    out, err = capfd.readouterr()
    assert code == 2, out + err
    assert err.count("\n") == 1 and f"names module '{name}' in {where}" in err and "re-plan" in err, err
    assert not program.exists() and not program.with_suffix(".sbatch").exists()


def test_compile_accepts_the_untouched_plans(plans, tmp_path, capfd):
    for kind, doc in plans.items():
        (tmp_path / f"{kind}.json").write_text(json.dumps(doc))
        assert main(["compile", str(tmp_path / f"{kind}.json"), "-o", str(tmp_path / f"{kind}.py")]) == 0


@pytest.mark.parametrize(
    "dtype, short, nbytes", [("bfloat16", "bf16", 2), ("float16", "fp16", 2), ("float32", "fp32", 4)]
)
def test_parameters_are_priced_by_their_dtype(tmp_path, dtype, short, nbytes):
    import autoshard

    spec = model_file(
        tmp_path, dtype=f".to(torch.{dtype})", targets=f"torch.randn(batch_size, 16, dtype=torch.{dtype})"
    )
    spec_path = spec.rsplit(":", 1)[0]
    text = (
        open(spec_path)
        .read()
        .replace("x = torch.randn(batch_size, 16)", f"x = torch.randn(batch_size, 16, dtype=torch.{dtype})")
    )
    open(spec_path, "w").write(text)
    plan = autoshard.plan(spec, cluster="local-cpu", devices_per_node=1, global_batch=4, cache=False)
    params = plan.model["params"]
    memory = plan.predicted.memory
    assert memory.params_bytes == params * nbytes
    assert memory.grads_bytes == params * nbytes and memory.optimizer_bytes == params * 2 * nbytes
    assert plan.precision == ("fp32" if dtype == "float32" else f"{short}-params")


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(net_forward="self.blocks(x)"), "the model's forward returns None"),
        (
            dict(top="import numpy", targets="numpy.zeros((batch_size, 16), dtype='float32')"),
            "example_batch returns targets of type numpy.ndarray, not a torch tensor; every rank slices",
        ),
        (dict(targets="[0.0] * batch_size"), "targets of type list, not a torch tensor"),
    ],
)
def test_plan_refuses_a_model_that_cannot_train(tmp_path, capfd, edit, message):
    spec = model_file(tmp_path, **edit)
    out_file = tmp_path / "plan.json"
    code = main(["plan", spec, *PLAN, "-o", str(out_file)])
    out, err = capfd.readouterr()
    assert code == 2, out + err
    assert err.count("\n") == 1 and message in err and "fix: " in err and "Traceback" not in err, err
    assert not out_file.exists()
