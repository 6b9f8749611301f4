"""--recompute alternate: torchtitan's op-level selective policy, emitted and priced beside autoshard's selective."""

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

import autoshard
from autoshard.cost.hardware import load_cluster
from autoshard.cost.memory import _selective_kept, alternate_recomputed, block_saved_bytes, block_workspace_bytes
from autoshard.cost.saved import MATMUL_OPS
from autoshard.cost.tables import CostTables
from autoshard.cost.tp import recompute_tp_comm
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import Decisions, Mesh
from autoshard.ir.names import op_name
from autoshard.ir.pins import Pins
from autoshard.ir.plan import Plan
from autoshard.passes.planning import pin_checks
from autoshard.passes.planning.tp_layout import hand_tp_layout
from autoshard.pipeline import capture_graph
from autoshard.runtime.selective import _alternate_policy, _selective_policy, recompute_contexts

LLAMA = "tests/models/hf_llama.py:build"
MM, ADDMM, BMM = torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default
SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class Ctx:
    def __init__(self, is_recompute):
        self.is_recompute = is_recompute


def test_the_policy_keeps_attention_and_every_other_weight_matmul_counted_apart_in_forward_and_recompute():
    counts = {"forward": 0, "recompute": 0}
    ops = [MM, ADDMM, SDPA, MM, BMM, MM, torch.ops.aten.gelu.default, ADDMM]
    forward = [_alternate_policy(counts, Ctx(False), op) for op in ops]
    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert forward == [save, again, save, save, again, again, again, save]
    assert [_alternate_policy(counts, Ctx(True), op) for op in ops] == forward  # the recompute makes the same choices
    assert recompute_contexts("alternate")[0] is not recompute_contexts("alternate")[0]  # each region counts from one


@pytest.fixture(scope="module")
def llama():
    return capture_graph(LLAMA, use_cache=True, proofs=False)[1]


def test_alternate_keeps_between_full_and_selective_and_recomputes_every_other_weight_matmul(llama):
    for block in llama.blocks:
        weights = [
            n for n in block.node_names if op_name(llama.node(n).target) in MATMUL_OPS and llama.node(n).param_inputs
        ]
        assert len(weights) >= 7  # q, k, v, o, gate, up, down
        assert set(weights[1::2]) <= alternate_recomputed(llama, block)
        assert not set(weights[0::2]) & alternate_recomputed(llama, block)
        saved = {mode: block_saved_bytes(llama, block, mode) for mode in ("full", "alternate", "selective", "none")}
        assert saved["full"] < saved["alternate"] < saved["selective"] <= saved["none"]
        work = {mode: block_workspace_bytes(llama, block, mode) for mode in ("selective", "alternate", "full")}
        assert work["selective"] < work["alternate"] <= work["full"]


def test_alternate_recomputes_more_than_selective_and_less_than_full(llama):
    tables = CostTables(llama, load_cluster("dgx-h100"))
    rerun = {mode: sum(tables.units(4, mode).recompute_s) for mode in ("selective", "alternate", "full")}
    assert rerun["selective"] < rerun["alternate"] < rerun["full"]


def test_alternate_is_pinned_not_searched_and_refused_with_pipeline_stages():
    cluster = load_cluster("local-cpu", devices_per_node=4)
    with pytest.raises(AutoshardError, match="--recompute alternate with pipeline stages is not emitted yet"):
        pin_checks.check_pins(Pins(recompute="alternate", pp=2), cluster, 8)
    plan = autoshard.plan("examples/gpt.py:build", devices_per_node=2, global_batch=8, dp=2, recompute="alternate")
    assert plan.recompute == "alternate" and plan.mesh.pp == 1
    assert Plan.from_json(plan.to_json()).recompute == "alternate"
    searched = autoshard.plan("examples/gpt.py:build", devices_per_node=2, global_batch=8, dp=2)
    assert all(a.recompute != "alternate" for a in searched.review.alternatives)


def test_alternate_keeps_the_reduce_scatters_and_reruns_the_other_tp_collectives_as_torchtitan():
    """torchtitan's save list holds reduce_scatter_tensor and no other collective: alternate keeps it (and the
    stages' sp_scatter) and reruns all-gathers and all-reduces in backward; selective keeps every collective."""
    counts, forward = {"forward": 0, "recompute": 0}, Ctx(False)
    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    c10d, local = torch.ops._c10d_functional, torch.ops.autoshard
    kept = [c10d.reduce_scatter_tensor.default, local.sp_scatter.default]
    rerun = [c10d.all_gather_into_tensor.default, c10d.all_reduce.default, local.sp_gather.default]
    rerun += [local.tp_reduce.default, local.tp_gather.default]
    assert [_alternate_policy(counts, forward, op) for op in kept] == [save] * 2
    assert [_alternate_policy(counts, forward, op) for op in rerun] == [again] * 5
    assert all(_selective_policy(forward, op) == save for op in kept + rerun)


@pytest.fixture(scope="module")
def proven_llama(in_repo_module):
    return capture_graph(LLAMA)[1]  # with the TP proofs, which let the layout shard


def test_alternate_under_sequence_parallelism_keeps_no_gathered_input_whole_and_repeats_the_all_gathers(proven_llama):
    """With sequence parallelism a column-parallel linear reads its input all-gathered over tp: selective keeps the
    gathered tokens whole (b·s·h per region), alternate reruns the all-gather in backward and keeps none of them, and
    pays the two forward all-gathers of the eight collectives per block again (T_tp × 1.25; × 1.5 without sequence
    parallelism, whose forward all-reduces it reruns, as full recompute does)."""
    tables = CostTables(proven_llama, load_cluster("tests/clusters/fast_link_cpu.yaml", devices_per_node=2))
    config = Decisions(Mesh(tp=2), 0, 2, 1, recompute="alternate", sequence_parallel=True)
    assert hand_tp_layout(tables, config).sequence_parallel
    share = tables.rank_share(config)
    for block in proven_llama.blocks:
        selective = _selective_kept(proven_llama, block, 1.0, share)
        alternate = _selective_kept(
            proven_llama, block, 1.0, share, alternate_recomputed(proven_llama, block), scatters_only=True
        )
        gathered = sum(b for k, b in selective.items() if k.endswith(":gathered"))
        assert gathered > 0 and not any(k.endswith(":gathered") for k in alternate)
        assert block_saved_bytes(proven_llama, block, "alternate", share=share) < block_saved_bytes(
            proven_llama, block, "selective", share=share
        )
    assert recompute_tp_comm("alternate", True) == 1.25 and recompute_tp_comm("alternate", False) == 1.5
    assert recompute_tp_comm("selective", True) == 1.0 and recompute_tp_comm("full", True) == 1.5
