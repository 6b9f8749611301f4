"""What a plan does on a second core changes nothing it returns: the TP proof's degrees proved in forked children
(``passes.capturing.tp_proof._each_degree``) and the search's candidates priced ahead by a forked worker
(``passes.planning.price_ahead``) give the proofs and the search result of one process, field for field.

The test process may run threads (pytest-xdist), where neither forks by itself: here both are made to."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autoshard.cost.hardware import load_cluster
from autoshard.cost.tables import CostTables
from autoshard.passes.planning import price_ahead as ahead_module
from autoshard.passes.planning import search as search_module
from autoshard.passes.planning.price_ahead import price_ahead, units_on_two_cores
from autoshard.passes.planning.space import candidate_configs
from autoshard.passes.planning.strategies import Pins
from autoshard.pipeline import PlanRequest, capture_graph, plan_graph

ROOT = Path(__file__).resolve().parent.parent


PROVE_BOTH_WAYS = """
import copy, json, sys
from autoshard.modelfile import load_model_file
from autoshard.passes.capturing import tp_proof
from autoshard.passes.capturing.annotate import annotate
from autoshard.passes.forked import Forked
from autoshard.passes.capturing.capture import capture

model_file = load_model_file(sys.argv[1])
graph = annotate(capture(model_file, 2, True))
one = tp_proof.prove_tensor_parallel(model_file, copy.deepcopy(graph), (2, 4), parallel=False).tp_proofs
answers, result = [], Forked.result
Forked.result = lambda self: answers.append(result(self)) or answers[-1]
forked = tp_proof.prove_tensor_parallel(model_file, copy.deepcopy(graph), (2, 4), parallel=True).tp_proofs
print(json.dumps({"one": one, "forked": forked, "answered": [a is not None for a in answers]}))
"""


@pytest.mark.parametrize("spec", ["examples/gpt.py:build", "tests/models/tp_cases.py:build_constant_heads"])
def test_degrees_proved_in_forked_children_are_the_one_process_proofs(spec):
    """In a fresh interpreter, as the capture's child is (one thread: the test's worker may run others, and then
    the proof does not fork)."""
    proc = subprocess.run(
        [sys.executable, "-c", PROVE_BOTH_WAYS, str(ROOT / spec)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["answered"] == [True], "degree 4 was proved in a child, which answered"
    assert set(out["one"]) == {"2", "2sp", "4", "4sp"}
    assert out["forked"] == out["one"]
    if "constant_heads" in spec:  # the refusals the child found came back, not just empty proofs
        assert any("on a shard where the layout needs" in why for why in out["forked"]["4"].values())


def _plan_json(graph, cluster, batch, forks: bool, monkeypatch) -> tuple[str, int]:
    """The plan's JSON, and how many candidates this process priced itself."""
    monkeypatch.setattr(search_module, "forking_pays", lambda candidates: forks)
    parent, here, price = os.getpid(), [0], search_module.price_with_mixed

    def counted(*args, **kwargs):
        here[0] += os.getpid() == parent
        return price(*args, **kwargs)

    monkeypatch.setattr(search_module, "price_with_mixed", counted)
    request = PlanRequest(model_spec="m.py:build", cluster=cluster, global_batch=batch)
    return plan_graph(request, None, graph).to_json(), here[0]


@pytest.mark.parametrize(
    "model, cluster_name, nodes, batch",
    [("tests/models/wide_gpt.py:build", "dgx-a100-80gb", 2, 64), ("examples/gpt.py:build", "dgx-h100", 4, 128)],
)
def test_a_search_priced_on_two_cores_is_the_one_process_search(monkeypatch, model, cluster_name, nodes, batch):
    graph = capture_graph(str(ROOT / model))[1]
    cluster = load_cluster(cluster_name, nodes=nodes)
    one, priced_alone = _plan_json(copy.deepcopy(graph), cluster, batch, False, monkeypatch)
    two, priced_here = _plan_json(copy.deepcopy(graph), cluster, batch, True, monkeypatch)
    assert json.loads(one)["review"]["search"]["priced"] < len(candidate_configs(graph, cluster, batch, Pins()))
    assert two == one  # the whole plan: decisions, layout (TP styles), prediction, alternatives, search report
    assert 0 < priced_here < priced_alone, "the worker priced part of the candidates"


def test_unit_tables_computed_half_in_a_worker_are_the_one_process_tables():
    graph = capture_graph(str(ROOT / "tests/models/wide_gpt.py:build"))[1]
    cluster = load_cluster("dgx-a100-80gb", nodes=2)
    configs = candidate_configs(graph, cluster, 64, Pins())
    two = CostTables(graph, cluster)
    units_on_two_cores(two, configs)
    args = {two.unit_args(c) for c in configs if c.recompute != "mixed"}
    assert len(args) >= 4 and len(two._units) == len(args)  # every table the bounds read, half from the worker
    one = CostTables(copy.deepcopy(graph), cluster)
    assert all(two.units(*a) == one.units(*a) for a in args)


def _loop(order, bounds, prices):
    """The search's loop: the positions it prices, on a table of prices."""
    reached, fastest = [], math.inf
    for i in order:
        if bounds[i] > fastest:
            break
        reached.append(i)
        fastest = min(fastest, prices[i])
    return reached


@pytest.mark.parametrize("seed", range(4))
def test_price_ahead_prices_every_position_the_loop_reaches(seed):
    """Prices at or above their bounds, in random order: whatever the two processes' timing, each position the
    one-process loop reaches was priced by one of them (module doc, "Why nothing it needs is missed")."""
    import random

    rng = random.Random(seed)
    n = 300
    bounds = [rng.uniform(1, 100) for _ in range(n)]
    prices = [b * rng.uniform(1, 3) for b in bounds]
    order = sorted(range(n), key=lambda i: (bounds[i], i))
    got = price_ahead(order, bounds, lambda i: [prices[i]], lambda ps: min(ps, default=math.inf))
    reached = _loop(order, bounds, prices)
    assert len(reached) < n  # the bound stops the loop early: not everything is priced
    assert set(reached) <= set(got)
    assert all(got[i] == [prices[i]] for i in got)


def test_a_search_whose_worker_dies_prices_alone(monkeypatch):
    """The worker dies on the first candidate it takes: the search prices that one itself, and returns what one
    process returns."""
    graph = capture_graph(str(ROOT / "tests/models/wide_gpt.py:build"))[1]
    cluster = load_cluster("dgx-a100-80gb", nodes=2)
    configs = candidate_configs(graph, cluster, 64, Pins())
    one = _search(graph, cluster, configs, 64, False, monkeypatch)
    parent, price = os.getpid(), search_module.price_with_mixed

    def dies_in_the_worker(*args, **kwargs):
        if os.getpid() != parent:
            os._exit(3)
        return price(*args, **kwargs)

    monkeypatch.setattr(search_module, "price_with_mixed", dies_in_the_worker)
    two = _search(copy.deepcopy(graph), cluster, configs, 64, True, monkeypatch)
    assert (two.best, two.alternatives, two.report) == (one.best, one.alternatives, one.report)
    assert (two.best.tp_choice, two.best.cuts) == (one.best.tp_choice, one.best.cuts)


def _search(graph, cluster, configs, batch, forks: bool, monkeypatch):
    monkeypatch.setattr(search_module, "forking_pays", lambda candidates: forks)
    return search_module.search(graph, cluster, configs, batch)


def test_forking_needs_enough_candidates_and_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(ahead_module.threading, "active_count", lambda: 1)
    monkeypatch.setattr(ahead_module.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("AUTOSHARD_PRICE_AHEAD", raising=False)
    assert ahead_module.forking_pays(ahead_module.MIN_CANDIDATES)
    assert not ahead_module.forking_pays(ahead_module.MIN_CANDIDATES - 1)
    monkeypatch.setenv("AUTOSHARD_PRICE_AHEAD", "0")
    assert not ahead_module.forking_pays(10_000)
    monkeypatch.delenv("AUTOSHARD_PRICE_AHEAD")
    monkeypatch.setattr(ahead_module.os, "sched_getaffinity", lambda pid: {0})
    assert not ahead_module.forking_pays(10_000)
