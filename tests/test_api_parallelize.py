"""``autoshard.parallelize`` and ``Parallelized.train_step`` refuse what they cannot train, in one line, before any
process group or collective: another model than the plan's, a process not launched at the plan's size, a batch
that is not the plan's global batch (or this rank's share of it), another loss for a pipeline's schedule, and
the old ``model, optimizer, mesh = parallelize(...)`` unpacking. The training itself is tests/e2e/
(test_api_plans.py, test_context_parallel.py, test_pretrained.py, test_api_example.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import autoshard
from autoshard.errors import AutoshardError
from autoshard.ir.recipe import Recipe
from autoshard.modelfile import load_model_file
from autoshard.passes.lowering.lower import layout
from autoshard.runtime.parallelized import Parallelized

GOLDEN = "tests/golden/{}.plan.json"


@pytest.fixture
def gpt(in_repo):
    sys.path.insert(0, str(in_repo / "examples"))
    try:
        import gpt

        torch.manual_seed(0)
        yield gpt
    finally:
        sys.path.remove(str(in_repo / "examples"))


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and "fix" in message, message
    return message


def test_a_model_that_is_not_the_plans_is_refused(in_repo):
    mlp = load_model_file("tests/models/mlp.py:build").build("cpu")
    with pytest.raises(AutoshardError) as exc:
        autoshard.parallelize(mlp, GOLDEN.format("dp_zero3"))
    assert "not the one the plan was made for (examples/gpt.py:build)" in one_line(exc)
    assert "parameters" in str(exc.value)


def test_something_else_than_a_module_is_refused(in_repo):
    with pytest.raises(AutoshardError) as exc:
        autoshard.parallelize("examples/gpt.py:build", GOLDEN.format("dp_zero3"))
    assert "takes a torch.nn.Module, not a str" in one_line(exc)


def test_a_process_not_launched_at_the_plans_size_is_refused(gpt, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(AutoshardError) as exc:  # the model is the plan's: the size is what is wrong
        autoshard.parallelize(gpt.build(), GOLDEN.format("tp_pp"))
    assert "for 8 ranks, and this process is one of 1" in one_line(exc)
    assert "torchrun --nproc-per-node 8" in str(exc.value)


class OneAxis:
    def __init__(self, size: int):
        self._size = size

    def __getitem__(self, axis: str):
        return self

    def size(self) -> int:
        return self._size


def parallelized(plan_name: str, schedule=None) -> Parallelized:
    """A ``Parallelized`` whose step never gets past its checks (no process group, model or optimizer; a pipeline's
    stand-in stages hold the first stage, so the rank reads batches)."""
    plan = autoshard.load_plan(GOLDEN.format(plan_name))
    stages = None if schedule is None else types.SimpleNamespace(reads=True)
    return Parallelized(
        plan,
        layout(plan),
        OneAxis(plan.mesh.dp),
        torch.device("cpu"),
        model=stages,
        optimizer=None,
        recipe=Recipe(),
        loss_fn=torch.nn.functional.cross_entropy,
        schedule=schedule,
    )


def test_train_step_takes_the_global_batch(in_repo):
    p = parallelized("dp_zero3")  # global batch 8 over dp 2
    tokens = torch.zeros(4, 16, dtype=torch.long)
    with pytest.raises(AutoshardError) as exc:
        p.train_step((tokens,), tokens)
    assert "the plan's global batch of 8 samples, got a batch of 4" in one_line(exc)
    assert "local=True" in str(exc.value)
    with pytest.raises(AutoshardError) as exc:
        p.train_step(torch.zeros(8, 16, dtype=torch.long), tokens)  # inputs and targets disagree
    assert "got a batch of 4 and 8" in one_line(exc)


def test_train_step_local_takes_this_ranks_share(in_repo):
    p = parallelized("dp_zero3")
    tokens = torch.zeros(8, 16, dtype=torch.long)
    with pytest.raises(AutoshardError) as exc:
        p.train_step(tokens, tokens, local=True)
    assert "this rank's share of 4 samples (global batch 8 / dp 2), got a batch of 8" in one_line(exc)


def test_train_step_takes_tensors(in_repo):
    with pytest.raises(AutoshardError) as exc:
        parallelized("dp_zero3").train_step([[1, 2]], torch.zeros(8))
    assert "got list, Tensor" in one_line(exc)


def test_a_pipelines_loss_is_the_one_its_schedule_was_built_with(in_repo):
    p = parallelized("tp_pp", schedule=object())
    tokens = torch.zeros(16, 8, dtype=torch.long)
    with pytest.raises(AutoshardError) as exc:
        p.train_step(tokens, tokens, loss_fn=torch.nn.functional.mse_loss)
    assert "pass loss_fn to autoshard.parallelize" in one_line(exc)


def test_unpacking_it_as_the_old_tuple_says_what_it_is_now(in_repo):
    with pytest.raises(AutoshardError) as exc:
        model, optimizer, mesh = parallelized("dp_zero3")
    assert "p.model, p.optimizer, p.mesh" in one_line(exc)


def test_a_middle_pipeline_rank_refuses_with_the_others_and_reads_nothing(in_repo, monkeypatch):
    """A rank holding neither the first nor the last stage: a bad call is refused there too (not left waiting in
    the schedule for ranks that refused), data_loader gives it ((), None), and train_step runs its stages on
    nothing."""
    plan = autoshard.load_plan(GOLDEN.format("tp_pp"))
    mesh = OneAxis(plan.mesh.dp)
    mesh.get_local_rank = lambda axis: 0
    middle = Parallelized(
        plan,
        layout(plan),
        mesh,
        torch.device("cpu"),
        model=types.SimpleNamespace(reads=False),
        optimizer=None,
        recipe=Recipe(),
        loss_fn=torch.nn.functional.cross_entropy,
        schedule=object(),
        model_file=lambda: load_model_file("examples/gpt.py:build"),
    )
    assert not middle.reads
    tokens = torch.zeros(4, 8, dtype=torch.long)
    with pytest.raises(AutoshardError) as exc:
        middle.train_step(tokens, tokens)
    assert "the plan's global batch of 16 samples, got a batch of 4" in one_line(exc)
    with pytest.raises(AutoshardError):
        middle.train_step(
            torch.zeros(16, 8, dtype=torch.long), tokens[:1].expand(16, 8), loss_fn=torch.nn.functional.mse_loss
        )
    ran = []
    monkeypatch.setattr(middle, "_pipeline_step", lambda inputs, targets: ran.append((inputs, targets)) or 1.5)
    batches = middle.data_loader(workers=0)
    assert batches.take(3) == ((), None)
    assert middle.train_step(*batches.take(3), local=True) == 1.5 and ran == [((), None)]
