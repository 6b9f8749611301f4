"""DCP checkpoints: a run stopped and resumed matches an uninterrupted run bit for bit.

Each case's runs are jobs of the session's one torchrun launch per world size (``one_launch.Cases``),
each a fresh program, model and optimizer, before every job that fixes randomness."""

import json
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.launch import write_program
from autoshard.runtime.checkpoint import latest
from autoshard.runtime.report import read_weights
from e2e.one_launch import Cases, attempt, job

pytestmark = pytest.mark.e2e

GPT, GPT2 = "examples/gpt.py:build", "tests/models/hf_gpt2.py:build"
CASES = {  # name: (model, cluster, ranks, pins)
    "zero0": (GPT, "local-cpu", 2, dict(zero=0)),
    "zero1": (GPT, "local-cpu", 2, dict(zero=1, dp=2)),
    "zero3": (GPT, "local-cpu", 2, dict(zero=3)),
    "gpt2-pp2-tied": (GPT2, "local-cpu", 2, dict(pp=2, schedule="1f1b")),
    "dp2-tp2-pp2-zero3": (GPT, "tests/clusters/fast_link_cpu.yaml", 8, dict(dp=2, tp=2, pp=2, zero=3, schedule="1f1b")),
    # Megatron's distributed optimizer (FSDP2, gradients whole until the last micro-batch) and FSDP2's
    # replicate (ZeRO-0) on DTensor parameters, TP-local stage shards, and HSDP
    "dp2-tp2-pp2-zero1": (GPT, "tests/clusters/fast_link_cpu.yaml", 8, dict(dp=2, tp=2, pp=2, zero=1, schedule="1f1b")),
    "dp2-tp2-zero0": (GPT, "tests/clusters/fast_link_cpu.yaml", 4, dict(dp=2, tp=2, zero=0)),
    "dp2-tp2-zero1": (GPT, "tests/clusters/fast_link_cpu.yaml", 4, dict(dp=2, tp=2, zero=1)),
    "dp4-hsdp2x2-zero3": (GPT, "tests/clusters/fast_link_cpu.yaml", 4, dict(dp=4, tp=1, zero=3, dp_replicate=2)),
}
NODES = {"dp4-hsdp2x2-zero3": 2}  # cases planned on several nodes (HSDP), their ranks split evenly


def stop_and_resume(case, root, ranks):
    """An uninterrupted run of 2 steps with checkpoints at steps 1 and 2, and a run of 2 steps that finds only
    a copy of the step-1 checkpoint (as if the job had stopped after step 1): two runs, not three, as the
    uninterrupted one keeps its step-1 checkpoint, in this order; state: (plan, the case's folder). One step
    before the checkpoint gives the optimizer a state (AdamW's moments and step count) to save and restore, one
    after it shows the resumed run continues from it: more steps prove nothing more."""
    model, cluster, _, pins = CASES[case]
    nodes = NODES.get(case, 1)
    plan = autoshard.plan(model, cluster=cluster, nodes=nodes, devices_per_node=ranks // nodes, global_batch=8, **pins)
    program = write_program(plan, root / case / "train.py")
    ckpt, stopped = root / case / "ckpt", root / case / "stopped"
    full = train(program, root / case / "full", "--steps", 2, "--checkpoint-dir", ckpt, "--checkpoint-every", 1)
    resumed = train(
        program,
        root / case / "resumed",
        "--steps",
        2,
        "--checkpoint-dir",
        stopped,
        "--checkpoint-every",
        1,
        copy=(ckpt / "step-00000001", stopped / "step-00000001"),
    )
    return [full, resumed], (plan, root / case)


def train(program, out, *args, copy=None):
    return job(program, [*args, "--metrics-out", out], out, copy=copy, draws=True)


# case -> (plan, its folder, each run's failure: "" when it ran to its end)
LAUNCHES = Cases(
    {case: c[2] for case, c in CASES.items()},
    prepare=lambda names, ranks, root: {case: attempt(lambda: stop_and_resume(case, root, ranks)) for case in names},
    finish=lambda case, state, failures: (*state, failures),
    case_of=lambda test, params: params.get("case"),
)


def metrics(out):
    return json.loads((out / "metrics.json").read_text())["losses"], read_weights(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_is_bit_exact(launches, case):
    _, _, _, pins = CASES[case]
    plan, folder, failures = launches.result(LAUNCHES, case)
    assert not any(failures), "\n".join(failures)[-4000:]  # both runs ran to their end
    assert all(getattr(plan.mesh, a) == pins.get(a, getattr(plan.mesh, a)) for a in ("dp", "tp", "pp"))
    full_losses, full_params = metrics(folder / "full")
    assert [p.name for p in sorted((folder / "ckpt").glob("step-*"))] == ["step-00000001", "step-00000002"]
    resumed_losses, resumed_params = metrics(folder / "resumed")
    assert resumed_losses == full_losses[1:]  # step 2 only: it resumed, not restarted
    for name, value in full_params.items():
        assert torch.equal(resumed_params[name], value), name
    assert latest(folder / "stopped").name == "step-00000002"
    shards = sorted((folder / "full" / "weights").glob("*.distcp"))  # the final weights: every rank its own part
    sizes = [shard.stat().st_size for shard in shards]
    assert 2 <= len(shards) <= plan.world_size and max(sizes) < (0.5 if plan.world_size >= 4 else 1.0) * sum(sizes)


def test_no_code_path_gathers_a_whole_model():
    """Final weights, checkpoints and metrics are written shard by shard (DCP); nothing in the package gathers
    tensors to one rank (the e2e cases above check the shards each rank wrote at 4 and 8 ranks)."""
    import autoshard as package

    gathers = ("gather_object(", "full_state_dict=True", ".full_tensor()", "all_gather_object(")
    scalar = "(gathers: scalar)"  # a line that makes one number whole (a gradient norm) says so
    found = [
        f"{path.name}: {line.strip()}"
        for path in Path(package.__file__).parent.rglob("*.py")
        for line in path.read_text().splitlines()
        if any(g in line for g in gathers) and scalar not in line
    ]
    assert not found, found


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
    dcp.save(
        {"model": other.state_dict(), "optim": {}, "steps_done": torch.tensor(step)},
        checkpoint_id=folder / f"step-{step:08d}",
    )


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
