"""benchmarks/gpu_session.sh's CPU path: the same steps a lent GPU runs (calibrate, plan, run, a hand-written loop,
its profile, DCP save and resume, the plans' dry runs), on the example GPT and one world-size-1 CPU rank."""

import json
import subprocess

import pytest

pytestmark = pytest.mark.e2e


def test_the_gpu_session_runs_its_cpu_path(in_repo, tmp_path):
    out = tmp_path / "session"
    command = [
        "bash",
        "benchmarks/gpu_session.sh",
        str(out),
        "--cpu",
        "--cluster",
        "local-cpu",  # calibrate: its own test
        "--profile",
        "2",
    ]
    proc = subprocess.run(command, cwd=in_repo, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    [row] = results["rows"]
    assert row["error"] is None and row["measured_step_s"] > 0 and row["predicted_step_s"] > 0
    assert row["predicted_parts"]["peak_bytes"] == row["predicted_peak_bytes"] > 0
    assert row["measured_peak_bytes"] is None  # a CPU rank has no device memory counter
    assert row["dryrun_peak_bytes"] > 0  # the plan's dry run ran after the runs
    [hand] = results["hand_loop"]
    assert hand["microbatch_size"] == 2 and hand["median_step_s"] > 0
    dcp = json.loads((out / "dcp.json").read_text())
    assert dcp["resumed"] and [r["steps_logged"] for r in dcp["runs"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    profile = json.loads((out / "kernels-mb2.json").read_text())  # the loop under torch.profiler (no CUDA kernels)
    assert profile["microbatch_size"] == 2 and profile["step_s"] > 0 and profile["kernel_count"] == 0
    table = (out / "results.md").read_text()
    assert "| ddp-mb2-full |" in table and "failed" not in table
