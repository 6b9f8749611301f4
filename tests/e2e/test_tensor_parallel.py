"""Tensor parallelism (chosen by the planner, applied with DTensor) trains like one process (gloo, CPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoshard.ir.topology import DeviceSpec, LinkSpec
from autoshard.passes.tensor_parallel import choose_tp_styles
from autoshard.pipeline import capture_graph
from autoshard.runtime import load_model_file
from autoshard.verify import compare, train_reference

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "e2e" / "tp_driver.py"
STEPS, BATCH, LR = 3, 8, 1e-3
# The compute-bound regime, so that the planner shards (see tests/test_tensor_parallel_choice.py).
SLOW_DEVICE = DeviceSpec("slow-test-device", 0.05, 2**34, 20.0, 1.0, "test")
FAST_LINK = LinkSpec(100.0, 0.0, "test")

CASES = {  # name: (spec, dp, tp, expected sharded-module count or None for "any")
    "gpt-tp2": ("examples/gpt.py:build", 1, 2, 24),
    "llama-tp2": ("tests/models/hf_llama.py:build", 1, 2, 14),
    "llama-dp2-tp2": ("tests/models/hf_llama.py:build", 2, 2, 14),
}


def run_driver(spec: str, styles: dict, dp: int, tp: int, tmp: Path) -> subprocess.CompletedProcess:
    (tmp / "styles.json").write_text(json.dumps(styles))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dp * tp),
           str(DRIVER), spec, str(tmp / "styles.json"), str(tmp / "out"), "--tp", str(tp), "--dp", str(dp),
           "--steps", str(STEPS), "--batch", str(BATCH), "--lr", repr(LR)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def check_against_one_process(spec: str, styles: dict, dp: int, tp: int, tmp: Path) -> None:
    proc = run_driver(spec, styles, dp, tp, tmp)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    losses = json.loads((tmp / "out" / "losses.json").read_text())
    params = torch.load(tmp / "out" / "params.pt", weights_only=True)
    ref_losses, ref_params = train_reference(load_model_file(spec), BATCH, STEPS, 0, LR)
    report = compare(STEPS, losses, ref_losses, params, ref_params, LR)
    assert report.max_loss_diff < 1e-5, report
    assert report.ok, report.failure


@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_matches_one_process(in_repo, tmp_path, case):
    spec, dp, tp, sharded = CASES[case]
    choice = choose_tp_styles(capture_graph(spec)[1], tp, FAST_LINK, SLOW_DEVICE)
    assert len(choice.sharded) - ("lm_head" in choice.sharded) == sharded
    check_against_one_process(spec, choice.sharded, dp, tp, tmp_path)


def test_gpt2_conv1d_tp2_matches_one_process(in_repo, tmp_path):
    """transformers' Conv1D MLP split by the conv1d-colwise / conv1d-rowwise styles (c_attn, fused, replicated)."""
    spec = "tests/models/hf_gpt2.py:build"
    choice = choose_tp_styles(capture_graph(spec)[1], 2, FAST_LINK, SLOW_DEVICE)
    assert choice.sharded == {f"transformer.h.{i}.mlp.{m}": style for i in range(2)
                              for m, style in (("c_fc", "conv1d-colwise"), ("c_proj", "conv1d-rowwise"))}
    check_against_one_process(spec, choice.sharded, 1, 2, tmp_path)
