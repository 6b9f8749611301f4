"""The Python API example runs under torchrun and trains."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_train_with_api_example(in_repo):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "examples/train_with_api.py",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(in_repo)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.5
