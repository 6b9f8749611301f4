"""The code passes the project's linter and formatter: ``ruff check`` with the rules in pyproject.toml's ``[tool.ruff]``,
and ``ruff format``."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_ruff_format_changes_nothing():
    """The code is as ``ruff format`` writes it (pyproject.toml's ``[tool.ruff]``: line length 120)."""
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


MAX_MODULE_LINES = 800  # a package file a reader takes in at once


def test_no_package_file_is_over_800_lines():
    """Every file of the package stays at most ``MAX_MODULE_LINES`` long: a larger one is split by concern."""
    long = [
        f"{path.relative_to(ROOT)}: {lines} lines"
        for path in sorted((ROOT / "autoshard").rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, "\n".join(long)


def test_no_module_imports_another_modules_private_name():
    """A name with a leading underscore is its module's own: no module of the package, nor a benchmark harness,
    takes one from another module of the package, by import (``from autoshard.x import _y``) or through the module
    (``x._y``); what others need is public, named as such. (The tests may reach a module's own helpers.)"""
    paths = sorted((ROOT / "autoshard").rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
    found = [f"{path.relative_to(ROOT)}: {name}" for path in paths for name in private_names_taken(path)]
    assert not found, "\n".join(found)


def private_names_taken(path: Path) -> list[str]:
    """``autoshard.x._y`` names ``path`` imports, or reads through a module of the package it imported."""
    import ast
    import importlib.util

    tree, modules, taken = ast.parse(path.read_text()), set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autoshard"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    taken.append(f"{node.module}.{alias.name}")
                elif importlib.util.find_spec(f"{node.module}.{alias.name}") if _is_package(node.module) else False:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules |= {alias.asname for alias in node.names if alias.name.startswith("autoshard") and alias.asname}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                taken.append(f"{node.value.id}.{node.attr}")
    return taken


def _is_package(module: str) -> bool:
    import importlib.util

    spec = importlib.util.find_spec(module)
    return spec is not None and spec.submodule_search_locations is not None
