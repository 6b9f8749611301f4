"""The model zoo as a table for a report: every model x case, verified against one process or refused.

    python benchmarks/bench_zoo.py [--models gpt2,llama] [--cases tp2,pp2]

Runs the same zoo as ``tests/e2e/test_zoo.py`` (``tests/e2e/zoo.py``: 2 CPU ranks, 2 steps, global
batch 8, dropout off in both runs) and prints the markdown table, then the time it took.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from e2e.zoo import CASES, MODELS, run_zoo, table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    models = {name: MODELS[name] for name in args.models.split(",")}
    cases = {name: CASES[name] for name in args.cases.split(",")}
    start_s = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autoshard-zoo-") as tmp:
        outcomes = run_zoo(models, cases, Path(tmp))
    print(table(outcomes, models, cases))
    for (model, case), outcome in outcomes.items():
        if outcome.status == "refused":
            print(f"- {model} / {case} refused: {outcome.detail}")
    print(f"\n{len(outcomes)} cases in {time.perf_counter() - start_s:.0f} s")


if __name__ == "__main__":
    main()
