"""The package's import structure: the layers contract holds, and no module imports itself back.

Layers (pyproject.toml, ``[tool.importlinter]``), top to bottom: cli; the commands (api, verify,
calibrate, calibrate_nodes, show, launch, host_probes, model_probes); pipeline; passes; cost and
runtime (neither imports the other); modelfile; ir; errors. A module imports only its own layer
and lower ones; the runtime only ir, errors and modelfile. Inside passes: lowering; capturing and
planning (neither imports the other); the layout models (layouts) and forked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import networkx as nx

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    """``lint-imports`` (import-linter) on pyproject.toml's contracts exits 0."""
    lint = Path(sys.executable).parent / "lint-imports"
    run = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_no_module_imports_itself_back():
    """No cycle among the package's modules, function-local imports included (type-only imports aside:
    they never run)."""
    graph = grimp.build_graph("autoshard", exclude_type_checking_imports=True, cache_dir=None)
    edges = nx.DiGraph((m, t) for m in graph.modules for t in graph.find_modules_directly_imported_by(m))
    cycles = list(nx.simple_cycles(edges))
    assert not cycles, cycles[:5]
