"""Layers an autograd Function runs again in its own backward (Reformer's reversible layers): what capture records
(``graph.hidden_backward``), and ZeRO-3 refused where FSDP2 would hand that backward sharded parameters.

No processes: plans on captured graphs. The programs run in tests/e2e/test_verify.py (ZeRO-2 of the same model)."""

from __future__ import annotations

import pytest

import autoshard
from autoshard.errors import AutoshardError
from autoshard.ir.graph import hidden_backward_units
from autoshard.ir.pins import Pins
from autoshard.passes.planning.space import candidate_configs
from autoshard.pipeline import capture_graph

STACK = "tests/models/rerun_in_backward.py:build"  # the blocks inside one Function, its backward past the blocks
PER_BLOCK = "tests/models/rerun_in_backward.py:build_per_block"  # each block calls one around its own layer


@pytest.fixture(scope="module")
def graphs(in_repo_module):
    return {spec: capture_graph(spec)[1] for spec in (STACK, PER_BLOCK)}


def test_capture_records_the_modules_an_autograd_function_runs(graphs):
    stack, per_block = graphs[STACK], graphs[PER_BLOCK]
    assert {"blocks.0", "blocks.0.layer", "blocks.0.layer.mix"} <= set(stack.hidden_backward)
    assert hidden_backward_units(stack)  # FSDP units (blocks, the root's parameters) inside the Function
    # a block that calls the Function around its layer is itself outside it: FSDP2 hooks its outputs
    assert "blocks.0.layer" in per_block.hidden_backward and "blocks.0" not in per_block.hidden_backward
    assert hidden_backward_units(per_block) == ()
    assert capture_graph("examples/gpt.py:build")[1].hidden_backward == ()


def test_zero3_is_refused_in_one_line_and_left_out_of_the_search(graphs):
    """ZeRO-3 would shard each unit's parameters after forward and the Function's backward would meet the shards
    ("got mixed torch.Tensor and DTensor" on every rank); ZeRO-2 keeps them gathered, and the search offers it."""
    with pytest.raises(AutoshardError, match=r"--zero 3 shards each unit's parameters .* pin --zero 2"):
        autoshard.plan(STACK, cluster="local-cpu", devices_per_node=2, global_batch=8, dp=2, zero=3)
    from autoshard.cost.hardware import load_cluster

    cluster = load_cluster("local-cpu", devices_per_node=2)
    stages = {c.zero_stage for c in candidate_configs(graphs[STACK], cluster, 8, Pins(dp=2))}
    assert 3 not in stages and 2 in stages
    assert 3 in {c.zero_stage for c in candidate_configs(graphs[PER_BLOCK], cluster, 8, Pins(dp=2))}
