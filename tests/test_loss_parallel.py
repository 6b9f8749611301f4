"""Loss parallelism (passes/layouts/loss.py): the output projection's logits left on vocabulary shards and the
cross-entropy computed on them. Where the proof accepts it, what the cost model prices for it, and that the search
picks it at a 128k vocabulary. No processes: tests/e2e/test_hf_folders.py trains it on gloo ranks."""

import io
from dataclasses import replace

import pytest
from rich.console import Console

from autoshard.cost.hardware import load_cluster
from autoshard.cost.tables import CostTables
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import TP_STYLES, Decisions, Mesh
from autoshard.passes.layouts.loss import LOSS_ALLREDUCES, output_projection
from autoshard.passes.planning.search import price_config
from autoshard.passes.planning.strategies import Pins, loss_parallel_refusal
from autoshard.passes.planning.tp_layout import hand_tp_layout
from autoshard.pipeline import PlanRequest, capture_graph, loss_parallel_left_off, plan_graph
from autoshard.show import decision_table

LLAMA_8B = "hf:examples/configs/llama-3.1-8b"  # meta-llama/Llama-3.1-8B's config.json: V = 128,256
SEQ_LEN = 4096


@pytest.fixture(scope="module")
def llama_8b(in_repo_module):
    return capture_graph(LLAMA_8B, seq_len=SEQ_LEN)


@pytest.fixture(scope="module")
def gpt(in_repo_module):
    return capture_graph("examples/gpt.py:build")


def test_the_proof_accepts_the_default_loss_and_refuses_a_model_files_own(llama_8b, gpt):
    """Llama's output is lm_head's logits, its loss transformers' default cross-entropy; the example GPT's
    ``loss_fn`` is its own (cross-entropy too, but not shown so), so it keeps its gathered output."""
    assert llama_8b[1].loss_parallel_proof == ""
    assert llama_8b[1].node(output_projection(llama_8b[1])[0]).module_path == "lm_head"
    assert "own loss_fn" in gpt[1].loss_parallel_proof
    assert loss_parallel_refusal(Mesh(tp=2, pp=2), "") == ""  # the last stage hands the loss its vocabulary shard
    assert loss_parallel_refusal(Mesh(tp=2, cp=2), "").startswith("context parallelism")
    assert loss_parallel_refusal(Mesh(tp=2, pp=2, cp=2), "") == ""  # a cp rank's tokens' loss, inside the stages


def _priced(graph, tp: int, loss_parallel: bool):
    cluster = load_cluster("dgx-h100", nodes=1)
    config = Decisions(Mesh(dp=8 // tp, tp=tp), 0, 1, 1, precision="bf16-autocast", loss_parallel=loss_parallel)
    tables = CostTables(graph, cluster)
    return tables, config, price_config(graph, cluster, config, 8 // tp, tables)


def test_loss_parallelism_keeps_a_vocabulary_shard_of_the_logits(llama_8b):
    """At tp 8 and one sample of 4,096 tokens: bf16 logits of 4096 x 128256 (1.0 GB) gathered whole on every rank,
    the fp32 loss's log-softmax (2.1 GB) kept and its two fp32 gradients (4.2 GB) in backward; with loss parallelism
    1/8 of the log-softmax and three fp32 tensors of 1/8 in backward. Its
    collectives: 3 all-reduces of 4,096 fp32 numbers in place of the all-gather of the logits."""
    graph = llama_8b[1]
    tp = 8
    gathered_tables, gathered, whole = _priced(graph, tp, False)
    sharded_tables, sharded, split = _priced(graph, tp, True)
    assert TP_STYLES[hand_tp_layout(gathered_tables, gathered).styles["lm_head"]].output == "replicated"
    assert hand_tp_layout(sharded_tables, sharded).styles["lm_head"].startswith("colwise-loss-parallel")
    logits = SEQ_LEN * 128256
    saved = gathered_tables.activation_units(gathered).saved_bytes[-1]
    saved_split = sharded_tables.activation_units(sharded).saved_bytes[-1]
    assert saved - saved_split == pytest.approx((1 - 1 / tp) * 4 * logits, rel=1e-3)  # the fp32 log-softmax kept
    peak_saved = whole.predicted.memory_peak_bytes_per_rank - split.predicted.memory_peak_bytes_per_rank
    # and the loss backward's two fp32 gradients, in place of its three fp32 tensors of a shard
    assert peak_saved >= ((1 - 1 / tp) * 4 + 8 - 12 / tp) * logits * 0.999
    assert sharded_tables.layout_cost(sharded).comm_s < gathered_tables.layout_cost(gathered).comm_s
    assert split.predicted.step_time_s < whole.predicted.step_time_s
    assert LOSS_ALLREDUCES == 3


def test_the_search_picks_it_at_a_128k_vocabulary(llama_8b):
    model_file, graph = llama_8b
    request = PlanRequest(LLAMA_8B, load_cluster("dgx-h100", nodes=1), 8, Pins(tp=8), seq_len=SEQ_LEN)
    plan = plan_graph(request, model_file, graph)
    assert plan.decisions.loss_parallel and plan.tensor_parallel["lm_head"].startswith("colwise-loss-parallel")
    assert "loss parallelism" in plan.review.tensor_parallel_reasons["lm_head"]
    shown = io.StringIO()
    Console(file=shown, width=400).print(decision_table(plan))
    assert "loss parallel with tp=8: lm_head's logits on 1/8 of the vocabulary" in shown.getvalue()


def test_a_pin_the_model_cannot_run_is_one_line_and_a_gathered_head_says_why(gpt):
    model_file, graph = gpt
    request = PlanRequest("examples/gpt.py:build", load_cluster("local-cpu", devices_per_node=4), 8)
    plan = plan_graph(replace(request, pins=Pins(tp=2)), model_file, graph)
    assert plan.tensor_parallel["lm_head"].startswith("colwise-gather")
    assert "no loss parallelism: the model file's own loss_fn" in plan.review.tensor_parallel_reasons["lm_head"]
    with pytest.raises(AutoshardError, match="--loss-parallel on: the model file's own loss_fn"):
        plan_graph(replace(request, pins=Pins(tp=2, loss_parallel="on")), model_file, graph)
    with pytest.raises(AutoshardError, match="--loss-parallel on: context parallelism"):
        plan_graph(replace(request, pins=Pins(tp=2, cp=2, pp=1, loss_parallel="on")), model_file, graph)


def test_loss_parallel_beside_cp_with_pp_unpinned_plans_pipeline_stages_where_the_devices_allow(llama_8b):
    """Beside cp the loss runs on vocabulary shards inside pipeline stages only: with pp unpinned the search keeps
    the meshes with stages (it was refused at the pins, as if pp were 1), and where the devices leave none it says
    why in one line."""
    model_file, graph = llama_8b
    pins = Pins(tp=2, cp=2, loss_parallel="on")
    request = PlanRequest(LLAMA_8B, load_cluster("dgx-h100", devices_per_node=8), 8, seq_len=SEQ_LEN, pins=pins)
    plan = plan_graph(request, model_file, graph)
    assert plan.loss_parallel and (plan.mesh.tp, plan.mesh.cp) == (2, 2) and plan.mesh.pp >= 2
    with pytest.raises(AutoshardError, match=r"--loss-parallel on: context parallelism.*\(mesh dp=1 tp=2 pp=1 cp=2\)"):
        plan_graph(replace(request, cluster=load_cluster("dgx-h100", devices_per_node=4)), model_file, graph)


@pytest.mark.parametrize(
    ("pins", "estimated", "why"),
    [
        (Pins(tp=2, loss_parallel="off"), False, "pinned --loss-parallel off"),
        (Pins(tp=2, loss_parallel="off"), True, "pinned --loss-parallel off"),
        (Pins(tp=2), True, "estimate prices it off unless pinned (--loss-parallel on)"),
        (Pins(tp=2), False, ""),  # the search chose: the price says why
        (Pins(tp=2, loss_parallel="on"), True, ""),
    ],
)
def test_gathered_logits_say_whether_a_pin_or_the_price_left_loss_parallelism_off(pins, estimated, why):
    """``estimate`` prices loss parallelism off unless pinned on; its plan's reason says so rather than that the
    gathered logits priced faster (which only a search that priced both can say)."""
    assert loss_parallel_left_off(pins, estimated) == why
