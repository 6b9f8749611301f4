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


def test_no_module_imports_another_modules_private_name():
    """A name with a leading underscore is its module's own: no module of the package imports one from another
    (``from autoshard.x import _y``); what others need is public, named as such."""
    import ast

    found = []
    for path in sorted((ROOT / "autoshard").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autoshard"):
                found += [
                    f"{path.relative_to(ROOT)}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    assert not found, "\n".join(found)
