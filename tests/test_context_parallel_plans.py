"""Long sequences: the cp axis planned, priced, written and lowered; --seq-len; what-if with cp.

No processes: plans are made on captured graphs (meta tensors); the programs run in
tests/e2e/test_context_parallel.py.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest

from autoshard.cost.context_parallel import add_rings, attention_nodes, cp_equivalent, ring_cost, unit_ring_costs
from autoshard.cost.hardware import load_cluster
from autoshard.cost.pipeline_step import rank_loads
from autoshard.cost.step import price_parts
from autoshard.cost.tables import CAPTURED_ELEM_BYTES, CostTables, Runtime
from autoshard.cost.units import node_forward_s
from autoshard.errors import AutoshardError
from autoshard.ir.decisions import Decisions, Mesh
from autoshard.ir.plan import Plan
from autoshard.modelfile import load_model_file
from autoshard.passes.lowering.codegen import emit_program
from autoshard.passes.planning.context_parallel import cp_refusal
from autoshard.passes.planning.strategies import Pins, cp_choices
from autoshard.pipeline import PlanRequest, capture_graph, plan_graph
from autoshard.show import plan_figures

LLAMA3_8B = "benchmarks/llama3.py:llama3_8b"
LONG = 131072


@pytest.fixture(scope="module")
def llama_long(in_repo_module):
    """Llama-3-8B's shape captured at 128k tokens (its rotary angles computed for them)."""
    return capture_graph(LLAMA3_8B, seq_len=LONG)


@pytest.fixture(scope="module")
def gpt(in_repo_module):
    return capture_graph("examples/gpt.py:build")


def plan(captured, spec, cluster, global_batch, seq_len=None, **pins):
    model_file, graph = captured
    return plan_graph(PlanRequest(spec, cluster, global_batch, Pins(**pins), seq_len=seq_len), model_file, graph)


def test_at_128k_tokens_only_context_parallelism_fits_one_node_at_tp_2(llama_long):
    """At tp 2 (tp 8 with sequence parallelism fits alone, its attention on head shards), one node holds 128k
    tokens of Llama-3-8B only by cutting the sequence: cp 1 fits no plan, the search picks cp > 1."""
    cluster = load_cluster("dgx-h100", nodes=1)
    assert llama_long[1].tokens_per_sample == LONG
    with pytest.raises(AutoshardError, match="no plan fits"):
        plan(llama_long, LLAMA3_8B, cluster, 4, seq_len=LONG, cp=1, tp=2)
    chosen = plan(llama_long, LLAMA3_8B, cluster, 4, seq_len=LONG, tp=2)
    assert chosen.mesh.cp > 1 and chosen.mesh.world_size == 8
    assert chosen.predicted.memory_peak_bytes_per_rank <= cluster.device.memory_bytes
    assert chosen.model["seq_len"] == LONG
    doc = json.loads(chosen.to_json())
    assert doc["decisions"]["mesh"]["cp"] == chosen.mesh.cp and doc["review"]["symbolic"]["symbols"]["cp"] > 1
    assert Plan.from_json(chosen.to_json()).to_json() == chosen.to_json()


@pytest.mark.parametrize("balanced", [True, False], ids=["head-tail", "contiguous"])
def test_a_cp_rank_costs_its_data_parallel_share_plus_the_ring(llama_long, monkeypatch, balanced):
    """A cp rank's linear work is a dp rank's at b/cp; its causal attention the ring's lockstep share of the whole
    sequence's (``cost.context_parallel`` module doc): T/cp with head-tail chunks (128k tokens are a multiple of
    2cp), T·(2cp − 1)/cp² with contiguous ones (the layout where s is not), checked against the attention
    kernels' own times at the whole micro-batch."""
    _, graph = llama_long
    if not balanced:
        monkeypatch.setattr("autoshard.cost.context_parallel.cp_load_balanced", lambda tokens, cp: False)
    tables = CostTables(graph, load_cluster("dgx-h100", nodes=1))
    cp = 4
    config = Decisions(
        mesh=Mesh(dp=2, tp=1, pp=1, cp=cp), zero_stage=3, microbatch_size=1, num_microbatches=1, recompute="full"
    )
    parts, equivalent = price_parts(tables, config), price_parts(tables, cp_equivalent(config))
    assert parts.memory == equivalent.memory and parts.dp_comm_total_s == equivalent.dp_comm_total_s
    ring = ring_cost(tables, config)
    assert parts.forward_s == pytest.approx(equivalent.forward_s + ring.forward_extra_s)
    assert parts.cp_comm_s == ring.exposed_s >= 0
    whole = node_forward_s(
        graph,
        1,
        tables.cluster.device,
        tables.precision.activation_bytes,
        CAPTURED_ELEM_BYTES,
        tables.runtime.attention,
        tables.runtime.kernels,
    )
    attention_whole = sum(whole[i] for i, n in attention_nodes(graph))
    assert all(n.attrs.get("is_causal") for _, n in attention_nodes(graph))
    share = node_forward_s(
        graph,
        1 / cp,
        tables.cluster.device,
        tables.precision.activation_bytes,
        CAPTURED_ELEM_BYTES,
        tables.runtime.attention,
        tables.runtime.kernels,
    )
    attention_rank = sum(share[i] for i, n in attention_nodes(graph)) + ring.forward_extra_s
    lockstep = 1 / cp if balanced else (2 * cp - 1) / cp**2
    assert attention_rank == pytest.approx(attention_whole * lockstep, rel=1e-6)


def test_what_if_seq_len_and_cp_re_evaluate_with_the_ring(llama_long):
    chosen = plan(llama_long, LLAMA3_8B, load_cluster("dgx-h100", nodes=1), 4, seq_len=LONG, tp=2)
    cp, base = chosen.mesh.cp, plan_figures(chosen)
    assert base["step_time_s"] == pytest.approx(chosen.predicted.step_time_s, rel=1e-4)
    longer = plan_figures(chosen, {"s": 2 * LONG})
    assert longer["activations_bytes"] > 1.9 * base["activations_bytes"]
    assert longer["forward_s"] > 2 * base["forward_s"]  # the s² attention grows faster than the tokens
    wider = plan_figures(chosen, {"cp": 2 * cp})
    assert wider["activations_bytes"] == pytest.approx(base["activations_bytes"] / 2, rel=0.05)
    assert wider["forward_s"] < base["forward_s"]


def test_cp_is_refused_with_the_reason_where_the_ring_cannot_split_the_sequence(in_repo):
    _, tiny = capture_graph("tests/models/cp_cases.py:build_position_table")  # rotary angles sliced from a table
    assert "slices" in cp_refusal(tiny, 2) and "rows" in cp_refusal(tiny, 2)
    _, llama = capture_graph("benchmarks/llama3.py:llama3_tiny", seq_len=256)  # angles of arange(s)
    assert cp_refusal(llama, 2) is None and cp_refusal(llama, 8) is None
    assert "not a multiple of cp=3" in cp_refusal(llama, 3)
    _, gpt2 = capture_graph("tests/models/hf_gpt2.py:build_with_dropout")
    assert "drops out" in cp_refusal(gpt2, 2)
    _, mlp = capture_graph("tests/models/mlp.py:build")
    assert cp_refusal(mlp, 2) is not None


def test_pinned_cp_is_checked_against_the_model_and_the_other_pins(gpt):
    cluster = load_cluster("local-cpu", devices_per_node=4)
    with pytest.raises(AutoshardError, match=r"--cp 3: the sequence length 64 is not a multiple of cp=3; pin --cp in"):
        plan(gpt, "examples/gpt.py:build", load_cluster("local-cpu", devices_per_node=3), 6, cp=3)
    masked = copy.deepcopy(gpt[1])  # attention called with a mask, as transformers' traced graphs call it
    for _, node in attention_nodes(masked):
        node.attrs.pop("attn_mask")
    masked.cp_proofs.pop("pipeline", None)  # and no proof that a cp pipeline's trace takes none
    with pytest.raises(AutoshardError, match="--cp 2 with pipeline stages: attention .* explicit mask .*; pin --pp 1"):
        plan((gpt[0], masked), "examples/gpt.py:build", cluster, 8, cp=2, pp=2)
    assert cp_choices(masked, 4, 2, Pins()) == [1] and cp_choices(masked, 4, 1, Pins(cp=2)) == [2]
    dense = plan(gpt, "examples/gpt.py:build", load_cluster("local-cpu"), 8, dp=2)
    assert "cp" not in json.loads(dense.to_json())["decisions"]["mesh"]
    assert "cp" not in dense.symbolic["symbols"]


def test_a_cp_program_splits_the_mesh_and_the_tokens(gpt):
    chosen = plan(gpt, "examples/gpt.py:build", load_cluster("local-cpu", devices_per_node=4), 8, cp=2, dp=2, zero=3)
    assert (chosen.mesh.dp, chosen.mesh.cp) == (2, 2)
    program = emit_program(chosen)
    assert 'MESH = {"pp": 1, "dp": 2, "cp": 2, "tp": 1}' in program and 'FLATTEN = {"dp_cp": ("dp", "cp")}' in program
    assert 'SEQUENCE_AXIS = "cp"' in program and 'LOSS_AXIS = "dp_cp"' in program
    assert 'apply_fsdp(model, mesh["dp_cp"]' in program
    # the step function cuts each micro-batch's tokens along SEQUENCE_AXIS (runtime.train_step.forward_backward)
    assert "SEQUENCE_AXIS, TOKENS_PER_SAMPLE, PRECISION, scaler)" in program.split("runtime.forward_backward(")[1]
    compile(program, "train.py", "exec")


def test_the_search_offers_cp_inside_pipeline_stages(llama_long):
    """At 128k tokens on two nodes with pp pinned to 2 and tp to 1, each stage's ranks split the sequence: the search
    offers cp inside the stages (pp 2 x cp 8 is the plan). Unpinned, tp 8 with sequence parallelism fits the stages
    and is faster; the assembly's pricing again agrees with the search's either way."""
    assert cp_choices(llama_long[1], 4, 2, Pins()) == [1, 2, 4]
    cluster = load_cluster("dgx-h100", nodes=2)
    chosen = plan(llama_long, LLAMA3_8B, cluster, 2, seq_len=LONG, pp=2, tp=1, microbatch_size=1)
    assert chosen.mesh.pp == 2 and chosen.mesh.cp > 1
    assert chosen.predicted.memory_peak_bytes_per_rank <= cluster.device.memory_bytes
    assert chosen.model["seq_len"] == LONG and Plan.from_json(chosen.to_json()).to_json() == chosen.to_json()


def test_a_pipeline_prices_each_stages_ring_with_its_own_attentions(gpt, monkeypatch):
    """pp 2 x cp 2: each pp rank is its data-parallel equivalent's (dp·cp ranks at b/cp) plus the ring of the
    attentions in its own stage; the step charges the slowest rank's, not the whole model's ring
    (``cost.pipeline_step`` "CP × PP"). Contiguous chunks, whose causal imbalance is a ring cost to place."""
    monkeypatch.setattr("autoshard.cost.context_parallel.cp_load_balanced", lambda tokens, cp: False)
    graph = gpt[1]
    tables = CostTables(graph, load_cluster("local-cpu", devices_per_node=4))
    config = Decisions(
        mesh=Mesh(dp=1, tp=1, pp=2, cp=2), zero_stage=0, microbatch_size=2, num_microbatches=4, schedule="1f1b"
    )
    cuts, m = (2,), 4
    rings, equivalent = unit_ring_costs(tables, config), cp_equivalent(config)
    plain, ringed = rank_loads(tables, equivalent, cuts), rank_loads(tables, equivalent, cuts, rings)
    halves = [add_rings(rings[: cuts[0] + 1]), add_rings(rings[cuts[0] + 1 :])]  # units: prefix, blocks, suffix
    assert add_rings(rings) == ring_cost(tables, config) and all(h.forward_extra_s > 0 for h in halves)
    for load, base, ring in zip(ringed, plain, halves):
        assert load.forward_s == pytest.approx(base.forward_s + ring.forward_extra_s)
        assert load.backward_s == pytest.approx(base.backward_s + ring.backward_extra_s)
        assert load.cp_comm_s == pytest.approx(ring.exposed_s)
    parts = price_parts(tables, config, cuts)
    slowest = max(ringed, key=lambda r: r.time_s)
    assert parts.forward_s == pytest.approx(m * slowest.forward_s)
    assert parts.cp_comm_s == pytest.approx(m * slowest.cp_comm_s)
    whole_ring = price_parts(tables, equivalent, cuts).forward_s + m * ring_cost(tables, config).forward_extra_s
    assert parts.forward_s < whole_ring  # one stage's ring per slot, not every stage's


def test_megatron_lm_pipeline_memory_holds_the_ring_s_backward(gpt):
    """Priced for Megatron-LM (``Runtime.named("megatron-lm")``), a pipeline rank's activations are its in-flight
    micro-batches plus a block's workspace or, with a cp ring, the ring attention's backward where larger, as
    autoshard's own stages count it (``RingCost.backward_bytes``): without it a cp plan read the ring's buffers in
    one runtime's memory and not the other's."""
    graph = gpt[1]
    cluster = load_cluster("local-cpu", devices_per_node=4)
    tables = CostTables(graph, cluster, Runtime.named("megatron-lm", cluster))
    config = Decisions(
        mesh=Mesh(dp=1, tp=1, pp=2, cp=2), zero_stage=0, microbatch_size=2, num_microbatches=4, schedule="1f1b"
    )
    cuts, equivalent, big = (2,), cp_equivalent(config), 2**30  # a ring's backward past any block's workspace
    rings = tuple(replace(r, backward_bytes=big) for r in unit_ring_costs(tables, config))
    plain, ringed = rank_loads(tables, equivalent, cuts), rank_loads(tables, equivalent, cuts, rings)
    for base, load in zip(plain, ringed):
        assert base.memory.activations_bytes < big <= load.memory.activations_bytes
        # the in-flight micro-batches kept, the ring in the workspace's place (the larger of the two), not beside it
        assert load.memory.activations_bytes <= base.memory.activations_bytes + big


def test_a_pipeline_cp_program_cuts_the_tokens_in_its_split(gpt):
    chosen = plan(gpt, "examples/gpt.py:build", load_cluster("local-cpu", devices_per_node=4), 8, cp=2, pp=2, dp=1)
    assert (chosen.mesh.pp, chosen.mesh.cp, chosen.mesh.dp) == (2, 2, 1)
    program = emit_program(chosen)
    assert 'MESH = {"pp": 2, "dp": 1, "cp": 2, "tp": 1}' in program and 'SEQUENCE_AXIS = "cp"' in program
    assert "sequence_axis=SEQUENCE_AXIS, tokens_per_sample=TOKENS_PER_SAMPLE" in program
    assert 'mesh["dp_cp"]' in program.split("split_pipeline(")[1]  # the stages' dp wrapper over dp x cp
    compile(program, "train.py", "exec")


def test_seq_len_is_handed_to_example_batch_and_recorded(in_repo, tmp_path):
    model_file = load_model_file("examples/gpt.py:build", seq_len=32)
    inputs, targets = model_file.example_batch(2)
    assert inputs[0].shape == (2, 32) and targets.shape == (2, 32)
    path = tmp_path / "fixed.py"
    path.write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(4, 4)\n\n"
        "def example_batch(batch_size):\n    return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)\n"
    )
    with pytest.raises(AutoshardError, match="example_batch takes no seq_len"):
        load_model_file(f"{path}:build", seq_len=8).example_batch(2)
    with pytest.raises(AutoshardError, match="--seq-len 0 must be a positive integer"):
        load_model_file("examples/gpt.py:build", seq_len=0)
    captured = capture_graph("examples/gpt.py:build", seq_len=32)
    chosen = plan(captured, "examples/gpt.py:build", load_cluster("local-cpu"), 8, seq_len=32, dp=2)
    assert captured[1].tokens_per_sample == 32 and chosen.model["seq_len"] == 32
    assert "SEQ_LEN = 32" in emit_program(chosen) and "seq_len=SEQ_LEN" in emit_program(chosen)


def test_head_tail_chunks_where_the_tokens_allow_them(gpt, in_repo):
    """s a multiple of 2cp: each cp rank holds a head-tail pair of chunks and the causal ring is even (no extra
    attention priced); otherwise contiguous chunks and the last rank's extra blocks. The program says which."""
    cluster = load_cluster("local-cpu", devices_per_node=2)
    short = capture_graph("examples/gpt.py:build", seq_len=18)  # 18 = 2·9: cp 2 splits it, 2cp = 4 does not
    for captured, seq_len, chunks in ((gpt, None, "head-tail pairs of chunks"), (short, 18, "contiguous chunks")):
        chosen = plan(captured, "examples/gpt.py:build", cluster, 4, seq_len=seq_len, cp=2, dp=1)
        program = emit_program(chosen)
        assert f"over its 2 ranks ({chunks})" in program and "model = use_cp_attention(model)" in program
        extra = ring_cost(CostTables(captured[1], cluster), chosen.decisions).forward_extra_s
        assert (extra == 0) == (chunks.startswith("head-tail")), (seq_len, extra)


def test_the_ring_exposes_only_what_its_blocks_cannot_hide(llama_long):
    """torch's ring (``cost.context_parallel`` "Ring exchange"): k and v all-gathered once behind the local block,
    dk and dv passed on behind each later block, the last pass after the loop. At 128k tokens on NVLink every block
    is long enough to hide its exchange: what is left exposed is that last pass of each attention's fp32 gradient
    accumulators, in the backward alone; on a link 1000x slower the gathers show too, and more with more ranks."""
    from dataclasses import replace as swap

    from autoshard.cost.comm import p2p_s
    from autoshard.cost.context_parallel import RING_GRAD_BYTES, _kv_chunk_bytes, cp_link

    _, graph = llama_long
    cluster = load_cluster("dgx-h100", nodes=1)
    tables = CostTables(graph, cluster)
    config = Decisions(mesh=Mesh(dp=1, tp=1, pp=1, cp=4), zero_stage=3, microbatch_size=1, num_microbatches=1)
    link, elem = cp_link(cluster, config.mesh), tables.precision.activation_bytes
    last_passes = sum(
        p2p_s(_kv_chunk_bytes(node, 1 / 4, graph.batch_size, elem) * RING_GRAD_BYTES / elem, link)
        for _, node in attention_nodes(graph)
    )
    ring = ring_cost(tables, config)
    assert ring.exposed_s == pytest.approx(last_passes, rel=1e-9)
    slow_link = swap(cluster.intra_node, bandwidth_gbps=cluster.intra_node.bandwidth_gbps / 1000, collectives=())
    slow = CostTables(graph, swap(cluster, intra_node=slow_link))
    exposed = [ring_cost(slow, swap(config, mesh=Mesh(cp=cp))).exposed_s for cp in (2, 4, 8)]
    assert exposed[0] > 10 * ring.exposed_s and exposed[0] < exposed[1] < exposed[2]


def test_a_transformers_model_gets_cp_inside_stages_by_tracing_under_the_rings_attention(in_repo):
    """transformers' Llama builds its causal mask whenever torch.export traces it under "sdpa", so the captured graph's
    attention takes a mask; traced under the ring's attention key, as a cp pipeline's split traces it, none does
    (the cp proof's step 6), and cp inside its pipeline stages is planned. (A graph whose masks that proof did not
    clear stays refused: ``test_pinned_cp_is_checked_against_the_model_and_the_other_pins``.)"""
    from autoshard.passes.planning.context_parallel import pipeline_cp_refusal

    spec = "tests/models/hf_llama.py:build"
    captured = capture_graph(spec)
    chosen = plan(captured, spec, load_cluster("local-cpu", devices_per_node=4), 8, cp=2, pp=2, dp=1, tp=1)
    graph = captured[1]
    assert any(n.attrs.get("attn_mask", "a tensor") is not None for _, n in attention_nodes(graph))
    assert graph.cp_proofs.get("pipeline") == "" and pipeline_cp_refusal(graph) is None
    assert (chosen.mesh.pp, chosen.mesh.cp) == (2, 2)
    assert "model = use_cp_attention(model)" in emit_program(chosen).split("split_pipeline(")[0]


def test_what_if_expressions_keep_the_plans_chunk_layout():
    """The s² work per cp rank in the plan's expressions (``cost.symbolic``): 1/cp where the plan's chunks are
    head-tail (s a multiple of 2cp), (2cp − 1)/cp² on contiguous chunks of causal attention, as the ring is priced."""
    from autoshard.cost.symbolic import CP, PlanPoint, Shares, _ring_work

    shares = Shares(0.2, 0.2, 0.0, 0.0, 0.0, 0.1, 0.1, causal=True)

    def point(s, cp):
        return PlanPoint({"B": 8, "s": s, "dp": 1, "tp": 1, "pp": 1, "b": 1, "v": 1, "cp": cp}, 0, "none", "none")

    assert _ring_work(point(64, 2), shares) == 1 / CP
    assert _ring_work(point(18, 2), shares) == (2 * CP - 1) / CP**2
    assert _ring_work(point(18, 2), replace(shares, causal=False)) == 1 / CP


def test_per_block_recompute_beside_cp_fits_with_the_rings_buffers(in_repo):
    """The per-block recompute modes (``passes.planning.recompute``) are chosen against the memory the step prices,
    ring buffers included: at capacities between full recompute's peak and none's, each mix chosen fits. Before,
    the choice left the ring out and every mix was priced over the capacity it was chosen for (Llama-3.1-8B's
    config at 8k tokens over cp 4, 120 capacities between the two peaks: 83 of 83 mixes, by up to 1.7 GiB)."""
    from autoshard.cost.rank_memory import ALLOCATOR_SLACK
    from autoshard.passes.planning.recompute import choose_recompute
    from autoshard.passes.planning.search import price_config

    _, graph = capture_graph(LLAMA3_8B, seq_len=8192)  # where the ring's buffers outgrow the attention's own
    dgx = load_cluster("dgx-a100-80gb", nodes=1)
    base = Decisions(Mesh(2, 1, 1, 4), 3, 1, 1)
    peak = {
        r: price_config(graph, dgx, replace(base, recompute=r), 2).predicted.memory_peak_bytes_per_rank
        for r in ("full", "none")
    }
    mixes = 0
    for share in (0.2, 0.5, 0.8):
        need = peak["full"] + share * (peak["none"] - peak["full"])
        cluster = replace(dgx, device=replace(dgx.device, memory_bytes=int(need * (1 + ALLOCATOR_SLACK))))
        chosen = choose_recompute(CostTables(graph, cluster), base)
        if chosen is not None:
            mixes += 1
            priced = price_config(graph, cluster, chosen, 2)
            assert priced.fits, (share, chosen.recompute_blocks, priced.predicted.memory_peak_bytes_per_rank, need)
    assert mixes >= 2
