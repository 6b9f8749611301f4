"""A float8 plan (``--float8 tensorwise``, planned for H100s, beside tensor parallelism) verified on CPU ranks through
its twin: the same plan with float8 off, which ``autoshard verify`` says it runs (CPU ranks have no float8 matmuls),
with a note of what the twin leaves unproven beside TP (torchao's float8 styles and their float8 all-gathers)."""

import pytest

import autoshard
from autoshard.cli import main

pytestmark = pytest.mark.e2e


def test_a_float8_plan_verifies_through_its_twin_on_cpu_ranks(tmp_path, capsys):
    plan = autoshard.plan(
        "examples/gpt.py:build",
        cluster="dgx-h100",
        devices_per_node=2,
        global_batch=8,
        dp=1,
        tp=2,
        pp=1,
        zero=0,
        microbatch_size=4,
        recompute="none",
        float8="tensorwise",
    )
    assert plan.decisions.float8 == "tensorwise" and len(plan.float8_linears) == 24
    plan.save(tmp_path / "plan.json")
    assert main(["verify", str(tmp_path / "plan.json"), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "(float8 tensorwise through its twin with float8 off)" in out.splitlines()[0]
    assert "note: float8 tensorwise (24 linears) verified through its twin: the same plan with float8 off" in out
    assert "note: float8 beside TP: torchao's Float8ColwiseParallel / Float8RowwiseParallel" in out
    assert "OK: the parallel program trains like one process" in out
