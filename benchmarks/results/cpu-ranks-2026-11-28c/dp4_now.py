"""4 ranks now: a calibration (fit as calibrate does), then the pick dp 4 b 2 and dp 4 b 1 run as bench_plans runs them;
predicted parts against measured step."""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "benchmarks")
from bench_plans import calibrate, measure, plan_all

path = calibrate(4, "examples/gpt.py:build", Path("/tmp/s/dp4cal.yaml"), 1)
plans, pick = plan_all("examples/gpt.py:build", path, 4, 8)
want = {"dp4 tp1 pp1 z0 b2 none", "dp4 tp1 pp1 z0 b1 none", "dp4 tp1 pp1 z0 b1 full"}
with tempfile.TemporaryDirectory() as tmp:
    for key, plan in plans:
        if key in want:
            ms = [measure(plan, 4, 16, Path(tmp))[0] for _ in range(2)]
            p = plan.predicted
            print(key, "measured", [round(m * 1e3, 1) for m in ms], "predicted", round(p.step_time_s * 1e3, 1))
            print(
                "   parts",
                {k: round(v * 1e3, 2) for k, v in vars(p).items() if k.endswith("_s") and isinstance(v, float) and v},
            )
