"""4 ranks: two plans priced on a calibration and run alternately, three times (16 steps each, as bench_plans runs them).

python benchmarks/results/cpu-ranks-2026-11-28d/pick4.py CLUSTER KEY... (output: pick4.out.txt, on
cluster30-4ranks.yaml, 2026-11-28 13:37 UTC, priced by the code at d842b9a)."""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "benchmarks")
from bench_plans import measure, plan_all

if __name__ == "__main__":
    cl = sys.argv[1]
    want = sys.argv[2:]
    plans, pick = plan_all("examples/gpt.py:build", cl, 4, 8)
    chosen = {k: p for k, p in plans if k in want}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(3):
            for key in want:
                m = measure(chosen[key], 4, 16, Path(tmp))[0]
                print(
                    r,
                    key,
                    "measured",
                    round(m * 1e3, 1),
                    "predicted",
                    round(chosen[key].predicted.step_time_s * 1e3, 1),
                    flush=True,
                )
