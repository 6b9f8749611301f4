"""The cost tables' memos serve each point its own figures: a point priced after others on the tables a search
shares costs what it costs on fresh tables (``CostTables.point_key``). A memo keyed by fewer of a point's fields
than its figures are computed from hands one point another's (the search then disagrees with its own assembly)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autoshard.cost.hardware import load_cluster
from autoshard.cost.step import price_parts
from autoshard.cost.tables import CostTables
from autoshard.ir.decisions import Decisions, Mesh
from autoshard.passes.planning.tp_layout import hand_tp_layout
from autoshard.pipeline import capture_graph

CUTS = (2,)  # four blocks, two stages


@pytest.fixture(scope="module")
def llama(in_repo_module):
    return capture_graph("tests/models/hf_llama.py:build_4_layers")[1]


def points() -> list[Decisions]:
    """tp 2 × pp 2 (× cp 2) points that differ in one field each, the fields a memo key could leave out, and SPMD
    points beside them on the same tables."""
    base = Decisions(mesh=Mesh(dp=1, tp=2, pp=2), zero_stage=0, microbatch_size=2, num_microbatches=4, schedule="1f1b")
    variants = [
        dict(),
        dict(sequence_parallel=True),
        dict(loss_parallel=True),
        dict(sequence_parallel=True, loss_parallel=True),
        dict(compile=True),
        dict(recompute="full"),
        dict(recompute="full", schedule="zbv", virtual_stages=2),
        dict(zero_stage=3),
        dict(mesh=Mesh(dp=1, tp=2, pp=2, cp=2)),
        dict(mesh=Mesh(dp=1, tp=2, pp=2, cp=2), sequence_parallel=True),
        dict(mesh=Mesh(dp=1, tp=2, pp=2, cp=2), sequence_parallel=True, loss_parallel=True),
        dict(float8="tensorwise"),
        dict(float8="rowwise", sequence_parallel=True),
        dict(mesh=Mesh(dp=1, tp=2), schedule="none"),
        dict(mesh=Mesh(dp=1, tp=2), schedule="none", compile=True, compile_loss=True),
        dict(mesh=Mesh(dp=1, tp=2), schedule="none", compile=True, sequence_parallel=True, async_tp=True),
    ]
    return [replace(base, **v) for v in variants]


def priced(tables: CostTables, config: Decisions) -> float:
    hand_tp_layout(tables, config)
    if config.mesh.pp == 1:
        return price_parts(tables, config).step_time_s
    cuts = CUTS if config.virtual_stages == 1 else (1, 2, 3)
    return price_parts(tables, config, cuts).step_time_s


def test_a_point_costs_the_same_after_any_other_on_shared_tables(llama):
    cluster = load_cluster("dgx-h100", nodes=1)
    alone = [priced(CostTables(llama, cluster), c) for c in points()]
    for order in (points(), points()[::-1]):
        shared = CostTables(llama, cluster)
        after = {c: priced(shared, c) for c in order}
        assert [after[c] for c in points()] == pytest.approx(alone, rel=1e-12)
    assert len(set(alone)) > len(alone) // 2  # the fields change the price: the check can fail
