"""A two-layer MLP returned as ``torch.compile(nn.Sequential(...))``, as a training script builds it.

autoshard plans and runs the module it compiles (``model._orig_mod``), and says so. ``build_blocks`` compiles
each block instead (``torch.compile`` on submodules). The data are tests/models/mlp.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import mlp  # noqa: E402


def build():
    return torch.compile(nn.Sequential(nn.Linear(mlp.DIM, 4 * mlp.DIM), nn.GELU(), nn.Linear(4 * mlp.DIM, mlp.DIM)))


def build_blocks():
    return nn.Sequential(*(torch.compile(mlp.ResidualBlock()) for _ in range(2)))


def example_batch(batch_size: int):
    return mlp.example_batch(batch_size)
