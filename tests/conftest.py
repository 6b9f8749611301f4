import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The capture cache (passes.capture_cache) of this test session, not the user's; CLI subprocesses inherit it.
os.environ.setdefault("AUTOSHARD_CACHE_DIR", tempfile.mkdtemp(prefix="autoshard-test-cache-"))


@pytest.fixture(scope="module")
def in_repo_module():
    """``in_repo`` for a module's fixtures (captured graphs shared by its tests)."""
    here = os.getcwd()
    os.chdir(ROOT)
    yield ROOT
    os.chdir(here)


@pytest.fixture
def in_repo(monkeypatch):
    """Run in the repo root so model specs like examples/gpt.py:build resolve."""
    monkeypatch.chdir(ROOT)
    return ROOT
