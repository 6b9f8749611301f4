"""No pipeline stage begins where torch's split cannot begin one (passes.planning.stage_cuts.cut_refusals).

tests/models/looped_gpt.py runs its two blocks twice per forward (shared weights): a stage
beginning at h.1 would begin at each of its calls, so the planner never cuts there, and a
--pp that needs the cut is refused in one line naming the block and the reason.
tests/models/no_grad_gate.py computes a gate from its weights under ``torch.no_grad()`` inside
each block: every cut stays; tests/models/no_grad_frozen_middle.py runs two blocks in one region:
no stage begins inside it.
"""

import json

from autoshard.cli import main
from autoshard.passes.planning.stage_cuts import (
    PartitionProblem,
    best_cuts,
    cut_refusals,
    gradient_stopping_regions,
    max_stages,
)
from autoshard.pipeline import capture_graph

LOOPED = "tests/models/looped_gpt.py:build"
PLAN = ["plan", LOOPED, "--cluster", "local-cpu", "--devices-per-node", "2", "--global-batch", "8"]


def test_a_block_that_runs_twice_cannot_begin_a_stage(in_repo):
    _, graph = capture_graph(LOOPED, proofs=False)
    assert [b.path for b in graph.blocks] == ["h.0", "h.1"]
    refusals = cut_refusals(graph)
    assert list(refusals) == [1] and "h.1 runs 2 times per forward" in refusals[1]
    assert max_stages(graph) == 1


def test_blocks_that_run_once_in_order_can_all_begin_stages(in_repo):
    _, graph = capture_graph("examples/gpt.py:build", proofs=False)
    assert cut_refusals(graph) == {} and max_stages(graph) == len(graph.blocks) == 4


def test_the_partition_skips_forbidden_starts():
    equal = PartitionProblem(block_time_ps=(10, 10, 10, 10))
    assert best_cuts(equal, 2) == (2,)
    assert best_cuts(PartitionProblem(block_time_ps=(10, 10, 10, 10), forbidden_starts=frozenset({2})), 2) == (1,)
    assert best_cuts(PartitionProblem(block_time_ps=(10, 10, 10, 10), forbidden_starts=frozenset({1, 2, 3})), 2) is None


def test_a_pinned_pp_that_needs_the_cut_is_refused_in_one_line(in_repo, capsys):
    code = main([*PLAN, "--pp", "2"])
    out, err = capsys.readouterr()
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "--pp 2" in lines[0] and "h.1 runs 2 times per forward" in lines[0] and "pin --pp 1" in lines[0]


def test_the_planner_never_proposes_the_cut(in_repo, capsys):
    code = main([*PLAN, "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0
    assert plan["decisions"]["mesh"]["pp"] == 1 and plan["layout"]["split_points"] == []
    assert all(alt["mesh"]["pp"] == 1 for alt in plan["review"]["alternatives"])


def test_a_no_grad_region_inside_each_block_keeps_every_cut(in_repo):
    """The regions of tests/models/no_grad_gate.py read each block's weights and input, inside the block: the runtime
    inlines them (runtime.grad_regions) and each ends in its block, so every block may begin a stage (before, the
    model was kept in one stage; its pp 2 plan verifies: tests/e2e/test_verify.py)."""
    _, graph = capture_graph("tests/models/no_grad_gate.py:build", proofs=False)
    assert gradient_stopping_regions(graph) == ["0", "1", "2", "3"]
    assert cut_refusals(graph) == {} and max_stages(graph) == 4


def test_no_stage_begins_inside_a_no_grad_region_that_runs_blocks(in_repo, capsys):
    """tests/models/no_grad_frozen_middle.py runs blocks 1 and 2 in one no_grad region of its own forward: a stage
    beginning at block 2 would begin inside it (the stage before would end with gradients off), so that cut is
    refused; block 3 may begin a stage, and a --pp 3, which needs every cut, is refused in one line."""
    spec = "tests/models/no_grad_frozen_middle.py:build"
    _, graph = capture_graph(spec, proofs=False)
    assert gradient_stopping_regions(graph) == ["the model's forward"]
    refusals = cut_refusals(graph)
    assert [graph.blocks[k].path for k in refusals] == ["blocks.2"], refusals
    assert "no_grad() region in the model's forward runs blocks blocks.2 to blocks.2" in next(iter(refusals.values()))
    assert max_stages(graph) == len(graph.blocks) - 1
    code = main(["plan", spec, "--cluster", "local-cpu", "--devices-per-node", "3", "--global-batch", "6", "--pp", "3"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "a stage must not begin inside it" in err


def test_a_no_grad_region_on_buffers_only_keeps_every_cut(in_repo):
    _, graph = capture_graph("tests/models/hf_llama.py:build", proofs=False)  # the rotary tables, from inv_freq
    assert gradient_stopping_regions(graph) == [] and cut_refusals(graph) == {}
