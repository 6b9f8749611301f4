"""A pipeline boundary is priced as torch's stage sends it (``cost.pipeline_step.boundary_round_trip_s``): the
residual stream forward and its gradient back, and beside it the tables the blocks share (a causal mask, rotary cos
and sin, a learned table), forward whole and back only where they carry a gradient. The stage posts a boundary's
tensors as one batch of P2P ops, so the tables add their bytes and no latency of their own."""

from __future__ import annotations

import pytest

from autoshard.cost import comm
from autoshard.cost.hardware import load_cluster
from autoshard.cost.memory import shared_value_sizes
from autoshard.cost.pipeline_step import boundary_round_trip_s, boundary_transfer_s, pp_link, rank_loads
from autoshard.cost.tables import CostTables
from autoshard.cost.tp_units import pipeline_units
from autoshard.ir.decisions import Decisions, Mesh
from autoshard.pipeline import capture_graph

PP2 = Decisions(mesh=Mesh(dp=1, tp=1, pp=2), zero_stage=0, microbatch_size=2, num_microbatches=4, schedule="1f1b")
RESIDUAL_BYTES = 4096


def tables_of(spec: str) -> CostTables:
    return CostTables(capture_graph(spec, use_cache=True)[1], load_cluster("local-cpu", devices_per_node=2))


def tables_extra_s(tables: CostTables) -> float:
    """What the shared tables add to a boundary's round trip over the residual's two transfers."""
    return boundary_round_trip_s(tables, PP2, RESIDUAL_BYTES) - 2 * boundary_transfer_s(tables, PP2, RESIDUAL_BYTES)


def bytes_s(tables: CostTables, size_bytes: float) -> float:
    """S/B on the pp link's p2p fit, from its bandwidth."""
    return size_bytes / (pp_link(tables.cluster, PP2.mesh).for_collective("p2p").bandwidth_gbps * 1e9)


def test_a_model_passing_only_its_residual_pays_two_transfers(in_repo):
    tables = tables_of("examples/gpt.py:build")
    assert shared_value_sizes(tables.graph) == ()
    assert tables_extra_s(tables) == 0.0


def test_a_llama_boundary_carries_its_mask_and_rotary_tables_forward_in_the_residual_s_batch(in_repo):
    tables = tables_of("tests/models/hf_llama.py:build_4_layers")
    sizes = shared_value_sizes(tables.graph)
    assert len(sizes) == 3 and not any(grad for _, grad in sizes)  # mask, cos, sin: made from no parameter
    scale = PP2.microbatch_size / tables.graph.batch_size
    assert tables_extra_s(tables) == pytest.approx(bytes_s(tables, sum(s for s, _ in sizes) * scale), rel=1e-9)
    assert 0 < tables_extra_s(tables) < comm.p2p_s(0, pp_link(tables.cluster, PP2.mesh))  # bytes, no latency
    residual = pipeline_units(tables, PP2)[0].boundary_bytes[2]  # the cut before block 2: the second stage's input
    assert rank_loads(tables, PP2, (2,))[1].p2p_s == pytest.approx(
        boundary_round_trip_s(tables, PP2, residual), rel=1e-9
    )


def test_a_table_made_from_a_parameter_sends_its_gradient_back(in_repo):
    tables = tables_of("tests/models/shared_table.py:build")
    sizes = shared_value_sizes(tables.graph)
    assert len(sizes) == 1 and sizes[0][1]  # the learned table, with its gradient
    scale = PP2.microbatch_size / tables.graph.batch_size
    assert tables_extra_s(tables) == pytest.approx(bytes_s(tables, 2 * sizes[0][0] * scale), rel=1e-9)
