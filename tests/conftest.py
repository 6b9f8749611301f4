import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def in_repo(monkeypatch):
    """Run in the repo root so model specs like examples/gpt.py:build resolve."""
    monkeypatch.chdir(ROOT)
    return ROOT
