"""A GPU session's measured steps re-priced by the planner as it is now, on this machine, no GPU needed.

    python benchmarks/gpu_reprice.py CLUSTER_FILE RUN_DIR [RUN_DIR ...]

Each RUN_DIR is what ``benchmarks/gpu_session.sh`` wrote (``results.json``, or its stdout saved as
``stdout.txt`` where the results files did not come back); each measured case is planned again with its pins
(``gpu_session.GPU_CASES``) on CLUSTER_FILE, the cluster file that run calibrated, and printed beside its
measured step and peak as a markdown table.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_session import GPU, REPO, pin_flags  # noqa: E402

STDOUT_ROW = re.compile(r"^(?P<case>[\w-]+): predicted .* measured (?P<ms>[\d.]+) ms (?P<gib>[\d.]+) GiB", re.M)


def measured(run: Path) -> dict[str, tuple[float, float]]:
    """{case: (step s, peak GiB)} measured in one run directory."""
    if (run / "results.json").exists():
        rows = json.loads((run / "results.json").read_text())["rows"]
        return {
            r["case"]: (r["measured_step_s"], r["measured_peak_bytes"] / 2**30)
            for r in rows
            if r["measured_step_s"] is not None
        }
    text = (run / "stdout.txt").read_text()
    return {m["case"]: (float(m["ms"]) / 1e3, float(m["gib"])) for m in STDOUT_ROW.finditer(text)}


def predicted(cluster: str, pins: dict) -> tuple[float, float]:
    """(step s, allocated GiB: the parts' sum before the allocator slack) of the plan with these pins."""
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan.json"
        args = [GPU.model, "--cluster", cluster, "--devices-per-node", "1", "--global-batch", str(GPU.global_batch)]
        subprocess.run(
            [sys.executable, "-m", "autoshard", "plan", *args, "--dp", "1", *pin_flags(pins), "-o", str(plan)],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        out = json.loads(plan.read_text())["predicted"]
    return out["step_time_s"], sum(v for k, v in out["memory"].items() if k != "peak_bytes") / 2**30


def main(argv: list[str]) -> int:
    cluster, runs = argv[0], [Path(a) for a in argv[1:]]
    pins = {c.name: c.pins for c in GPU.cases}
    print("| case | predicted step | measured step | error | predicted allocated | measured max allocated | error |")
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        for case, (step_s, peak_gib) in measured(run).items():
            p_step, p_gib = predicted(cluster, pins[case])
            print(
                f"| {case} | {p_step * 1e3:.1f} ms | {step_s * 1e3:.1f} ms | {(p_step / step_s - 1) * 100:+.1f} % "
                f"| {p_gib:.2f} GiB | {peak_gib:.2f} GiB | {(p_gib / peak_gib - 1) * 100:+.1f} % |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
