"""Every DP/ZeRO configuration the planner can emit trains like one process (gloo, CPU ranks)."""

import pytest

import autoshard
from autoshard.verify import verify

pytestmark = pytest.mark.e2e

MODELS = {
    "gpt": "examples/gpt.py:build",
    "llama": "tests/models/hf_llama.py:build",
}


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_verify_dp_and_zero(in_repo, model, zero, ranks):
    plan = autoshard.plan(MODELS[model], cluster="local-cpu", devices_per_node=ranks, global_batch=8,
                          dp=ranks, tp=1, pp=1, zero=zero, microbatch_size=1 if zero % 2 else None,
                          recompute={0: "none", 1: "full", 2: "selective", 3: "full"}[zero])
    assert plan.mesh.dp == ranks and plan.zero_stage == zero
    report = verify(plan, steps=3)
    assert report.ok, report.failure
    assert len(report.parallel_losses) == 3
    assert report.parallel_losses[-1] < report.parallel_losses[0]  # it trains


def test_verify_eight_ranks_zero3(in_repo):
    plan = autoshard.plan(MODELS["gpt"], cluster="local-cpu", devices_per_node=8, global_batch=16, zero=3)
    assert plan.mesh.dp == 8
    report = verify(plan, steps=2)
    assert report.ok, report.failure


def test_verify_mixed_recompute_chosen_under_memory_pressure(in_repo):
    """With device memory between what full recompute and no recompute need, the planner recomputes
    some blocks only (passes.recompute); that program trains like one process too."""
    from dataclasses import replace

    from autoshard.cost.hardware import load_cluster

    cluster = load_cluster("local-cpu", devices_per_node=2)
    pins = dict(dp=2, zero=0, microbatch_size=4)
    need = {mode: autoshard.plan(MODELS["gpt"], cluster=cluster, global_batch=8, recompute=mode, **pins)
            .predicted.memory_peak_bytes_per_rank for mode in ("none", "full")}
    tight = replace(cluster, device=replace(cluster.device, memory_bytes=(need["none"] + need["full"]) // 2))
    plan = autoshard.plan(MODELS["gpt"], cluster=tight, global_batch=8, **pins)
    assert plan.recompute == "mixed" and len(set(plan.recompute_blocks.values())) > 1  # blocks differ
    assert plan.predicted.memory_peak_bytes_per_rank <= tight.device.memory_bytes
    report = verify(plan, steps=3)
    assert report.ok, report.failure
