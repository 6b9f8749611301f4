"""passes/planning/search is exact: the plan it returns costs what brute-force enumeration of the same space finds."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoshard.cost.hardware import load_cluster
from autoshard.cost.tables import CostTables
from autoshard.passes.planning.search import _rank, price_config, price_with_mixed, search
from autoshard.passes.planning.space import candidate_configs
from autoshard.passes.planning.strategies import Pins
from autoshard.pipeline import capture_graph

ROOT = Path(__file__).resolve().parent.parent
FAST = str(ROOT / "tests/clusters/fast_link_cpu.yaml")
SHARED = str(ROOT / "tests/clusters/cpu4_shared_cores.yaml")  # pipelines priced with shared cores
CASES = [  # model, cluster, nodes, devices per node, global batch
    ("examples/gpt.py:build", "local-cpu", 1, 4, 16),
    ("examples/gpt.py:build", FAST, 1, 8, 32),
    ("examples/gpt.py:build", SHARED, 1, 4, 8),
    ("tests/models/hf_llama.py:build_4_layers", FAST, 1, 4, 16),
    ("tests/models/wide_gpt.py:build", "dgx-a100-80gb", 2, 8, 64),
    ("tests/models/wide_gpt.py:build", "dgx-h100", 4, 8, 128),
]


@pytest.fixture(scope="module")
def graphs():
    return {}


@pytest.mark.parametrize("model, cluster_name, nodes, per_node, batch", CASES)
def test_search_equals_brute_force(graphs, model, cluster_name, nodes, per_node, batch):
    if model not in graphs:
        graphs[model] = capture_graph(str(ROOT / model))[1]
    graph = graphs[model]
    cluster = load_cluster(cluster_name, nodes=nodes, devices_per_node=per_node)
    configs = candidate_configs(graph, cluster, batch, Pins())
    tables = CostTables(graph, cluster)
    every = [p for c in configs for p in price_with_mixed(graph, cluster, c, batch, tables)]
    brute = min((p for p in every if p.fits), key=_rank)
    found = search(graph, cluster, configs, batch).best
    assert found.config == brute.config
    assert found.predicted.step_time_s == brute.predicted.step_time_s
    assert found.cuts == brute.cuts


def test_a_time_limit_stops_early_and_reports_the_gap(graphs):
    model = "tests/models/wide_gpt.py:build"
    graphs.setdefault(model, capture_graph(str(ROOT / model))[1])
    graph, cluster = graphs[model], load_cluster("dgx-a100-80gb", nodes=2)
    configs = candidate_configs(graph, cluster, 64, Pins())
    full = search(graph, cluster, configs, 64)
    assert full.report == {"candidates": len(configs), "priced": full.report["priced"], "optimal": True, "gap": 0.0}
    assert full.report["priced"] < len(configs)  # bounds prune without changing the answer (test above)
    cut = search(graph, cluster, configs, 64, time_limit_s=1e-9)  # stops once something fits
    assert not cut.report["optimal"] and cut.report["priced"] < full.report["priced"]
    assert cut.best.predicted.step_time_s >= full.best.predicted.step_time_s
    # the gap bounds how far the plan can be from the optimum: best·(1 − gap) <= optimum
    assert cut.best.predicted.step_time_s * (1 - cut.report["gap"]) <= full.best.predicted.step_time_s * (1 + 1e-12)


def test_bad_time_limit_is_one_line(in_repo, capsys):
    from autoshard.cli import main

    assert (
        main(["plan", "examples/gpt.py:build", "--cluster", "local-cpu", "--global-batch", "8", "--time-limit", "-1"])
        == 2
    )
    err = capsys.readouterr().err
    assert "--time-limit -1.0 must be a number of seconds > 0" in err and err.count("\n") == 1


def test_per_block_recompute_is_the_best_assignment_that_fits(graphs):
    """CP-SAT's per-block modes (``passes.planning.recompute``) against every split of the blocks over the three
    modes, each priced by the cost model: none that fits is faster."""
    from itertools import product

    from autoshard.ir.decisions import Decisions, Mesh
    from autoshard.passes.planning.recompute import assign, choose_recompute, signature_groups

    model = "tests/models/wide_gpt.py:build"
    graphs.setdefault(model, capture_graph(str(ROOT / model))[1])
    graph, cluster = graphs[model], load_cluster("dgx-a100-80gb", nodes=2)
    tables = CostTables(graph, cluster)
    base = Decisions(Mesh(4, 4, 1), 3, 16, 1)
    assert not price_config(graph, cluster, base, 64, tables).fits  # every activation kept does not fit
    chosen = choose_recompute(tables, base)
    assert chosen is not None and chosen.recompute == "mixed"
    best = price_config(graph, cluster, chosen, 64, tables)
    assert best.fits
    groups, blocks = signature_groups(tables), len(graph.blocks)
    (group,) = groups  # one signature: the split is a count per mode
    fitting = []
    for full, selective in product(range(blocks + 1), repeat=2):
        if full + selective > blocks:
            continue
        counts = {(group, "full"): full, (group, "selective"): selective, (group, "none"): blocks - full - selective}
        modes = assign(groups, counts, blocks)
        config = (
            Decisions(base.mesh, 3, 16, 1, recompute="mixed", recompute_blocks=modes)
            if len(set(modes)) > 1
            else Decisions(base.mesh, 3, 16, 1, recompute=modes[0])
        )
        p = price_config(graph, cluster, config, 64, tables)
        if p.fits:
            fitting.append(p.predicted.step_time_s)
    assert best.predicted.step_time_s <= min(fitting) * (1 + 1e-9)
