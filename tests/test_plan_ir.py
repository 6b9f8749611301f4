"""Plan JSON: round trip byte for byte, and clear errors for corrupted or foreign files."""

import json

import pytest

from autoshard.cost.hardware import PRESETS
from autoshard.errors import AutoshardError
from autoshard.ir.plan import Memory, Mesh, Plan, Predicted, Stage, load_plan
from autoshard.passes.codegen import blocks_expression

REQUIRED_KEYS = ["version", "model", "cluster", "global_batch", "mesh", "zero_stage", "microbatch_size",
                 "num_microbatches", "schedule", "recompute", "stages", "tensor_parallel", "predicted", "alternatives"]


CLUSTER = PRESETS["dgx-h100"].to_dict()  # a loaded plan's cluster is checked like a cluster file


def make_plan(**overrides):
    memory = Memory.from_parts(0.05, params_bytes=100, grads_bytes=100, optimizer_bytes=200, activations_bytes=50,
                               transient_bytes=0)
    predicted = Predicted(step_time_s=0.1234567891, compute_s=0.1, comm_exposed_s=0.0234567891, bubble_s=0.0,
                          memory_peak_bytes_per_rank=memory.peak_bytes, memory=memory, tokens_per_s=1000.0,
                          samples_per_s=10.0, mfu=0.5)
    fields = dict(model={"spec": "m.py:build", "hash": "abc", "params": 10, "layers": 2}, cluster=CLUSTER,
                  global_batch=8, mesh=Mesh(dp=2), zero_stage=1, microbatch_size=2, num_microbatches=2,
                  schedule="none", recompute="none", stages=(Stage(0, ("a",), (0, 1)),), tensor_parallel={},
                  predicted=predicted)
    return Plan(**{**fields, **overrides})


def test_round_trip_is_byte_identical(tmp_path):
    plan = make_plan()
    plan.save(tmp_path / "p.json")
    again = load_plan(tmp_path / "p.json")
    assert again.to_json() == plan.to_json()
    assert list(json.loads(plan.to_json()))[: len(REQUIRED_KEYS)] == REQUIRED_KEYS


def test_floats_rounded_for_stable_bytes():
    assert json.loads(make_plan().to_json())["predicted"]["step_time_s"] == 0.123457


def test_batch_arithmetic_checked():
    with pytest.raises(AutoshardError, match="not the global batch 8"):
        make_plan(num_microbatches=3)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "a plan is a JSON object"),
    ('{"version": 99}', "plan version 99"),
    ('{"version": 1, "model": {}}', "plan field 'model.spec' is missing"),
])
def test_bad_plan_files(tmp_path, text, message):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(AutoshardError, match=message):
        load_plan(path)


def test_tampered_zero_stage_rejected(tmp_path):
    data = json.loads(make_plan().to_json())
    data["zero_stage"] = 7
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(AutoshardError, match="'zero_stage' must be one of 0, 1, 2, 3, got 7"):
        load_plan(path)


def test_blocks_expression_compresses_numbered_runs():
    assert blocks_expression(("h.0", "h.1", "h.2")) == '[f"h.{i}" for i in range(3)]'
    assert blocks_expression(("a", "b.1")) == "['a', 'b.1']"
    assert eval(blocks_expression(tuple(f"model.layers.{i}" for i in range(5)))) == [f"model.layers.{i}" for i in range(5)]
