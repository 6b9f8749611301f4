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
        "--text",  # a real text's bytes as the programs' data
        "examples/data/northanger_abbey.txt",
    ]
    proc = subprocess.run(command, cwd=in_repo, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    [row] = results["rows"]
    assert row["error"] is None and row["measured_step_s"] > 0 and row["predicted_step_s"] > 0
    assert row["predicted_parts"]["peak_bytes"] == row["predicted_peak_bytes"] > 0
    assert row["measured_peak_bytes"] is None  # a CPU rank has no device memory counter
    assert len(row["losses"]) == 3 and row["losses"][0] == row["first_loss"] and row["losses"][-1] == row["last_loss"]
    assert (out / "text-bytes.bin").stat().st_size == 2 * (
        in_repo / "examples/data/northanger_abbey.txt"
    ).stat().st_size
    assert row["dryrun_peak_bytes"] > 0  # the plan's dry run ran after the runs
    [hand] = results["hand_loop"]
    assert hand["microbatch_size"] == 2 and hand["median_step_s"] > 0
    dcp = json.loads((out / "dcp.json").read_text())
    assert dcp["resumed"] and [r["steps_logged"] for r in dcp["runs"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    profile = json.loads((out / "kernels-mb2.json").read_text())  # the loop under torch.profiler (no CUDA kernels)
    assert profile["microbatch_size"] == 2 and profile["step_s"] > 0 and profile["kernel_count"] == 0
    table = (out / "results.md").read_text()
    assert "| ddp-mb2-full |" in table and "failed" not in table


def test_each_float8_run_is_held_against_its_bf16_twin():
    """float8_curves pairs a float8 run with the run of the same pins and float8 off (or unpinned), and judges the
    largest per-step relative loss difference against FLOAT8_LOSS_TOLERANCE."""
    from benchmarks.gpu_session import FLOAT8_LOSS_TOLERANCE, Row, float8_curves

    eager = {"zero": 0, "microbatch_size": 4, "recompute": "none"}
    compiled = {**eager, "compile": "on"}
    rows = [
        Row("bf16", {**eager, "float8": "off"}, predicted_step_s=0.3, measured_step_s=0.32, losses=[10.0, 8.0, 6.0]),
        Row(
            "f8",
            {**eager, "float8": "tensorwise"},
            predicted_step_s=0.27,
            measured_step_s=0.28,
            losses=[10.0, 8.1, 6.0],
        ),
        Row("f8-row", {**eager, "float8": "rowwise"}, losses=[10.0, 9.0, 6.0]),
        Row("compiled", compiled, losses=[10.0, 8.0]),
        Row("f8-compiled", {**compiled, "float8": "tensorwise"}, losses=[10.0, 8.0, 5.0]),
        Row("f8-mb2", {**eager, "microbatch_size": 2, "float8": "tensorwise"}, losses=[10.0]),  # no twin ran
    ]
    by_case = {c["case"]: c for c in float8_curves(rows)}
    assert set(by_case) == {"f8", "f8-row", "f8-compiled"}
    assert by_case["f8"]["twin"] == by_case["f8-row"]["twin"] == "bf16" and by_case["f8-compiled"]["twin"] == "compiled"
    assert by_case["f8"]["max_relative_loss_difference"] == pytest.approx(0.1 / 8.0)
    assert by_case["f8"]["within_tolerance"] == (0.1 / 8.0 <= FLOAT8_LOSS_TOLERANCE)
    assert not by_case["f8-row"]["within_tolerance"]  # 12.5 % at step 1
    assert by_case["f8-compiled"]["steps"] == 2 and by_case["f8-compiled"]["last_loss"] == [8.0, 8.0]
    assert by_case["f8"]["measured_step_ratio"] == pytest.approx(0.28 / 0.32)
    assert by_case["f8"]["predicted_step_ratio"] == pytest.approx(0.9)
