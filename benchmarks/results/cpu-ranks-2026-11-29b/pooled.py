"""Three 4-rank runs of the same 83 configurations pooled (`plans34-4ranks`, `plans36-4ranks` in
`../cpu-ranks-2026-11-29/`, `plans38-4ranks` here), each round priced on its own run's calibration: a
configuration's error is the median over the six rounds of predicted / measured − 1; Spearman's rho and the
pick's regret on the six rounds' median times against the runs' mean prediction. Also each run alone, read the
same way, and each pair.

    python benchmarks/results/cpu-ranks-2026-11-29b/pooled.py
"""

import itertools
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "cpu-ranks-2026-11-29"))
from pooled import ranks  # noqa: E402  (the two-run pooling's ranks, for Spearman's rho)

RUNS = (
    HERE.parent / "cpu-ranks-2026-11-29" / "plans34-4ranks.json",
    HERE.parent / "cpu-ranks-2026-11-29" / "plans36-4ranks.json",
    HERE / "plans38-4ranks.json",
)


def rows(path: Path) -> dict[str, dict]:
    return {r["key"]: r for r in json.loads(path.read_text())["rows"]}


def pooled(runs: list[dict[str, dict]], pick: str) -> str:
    """MAPE, Spearman's rho and the pick's regret of ``runs`` pooled (module doc)."""
    keys = sorted(set.intersection(*(set(r) for r in runs)))
    errors = {
        k: statistics.median(r[k]["predicted_s"] / m - 1 for r in runs for m in r[k]["measured_rounds_s"]) for k in keys
    }
    times = {k: statistics.median(m for r in runs for m in r[k]["measured_rounds_s"]) for k in keys}
    prices = {k: statistics.mean(r[k]["predicted_s"] for r in runs) for k in keys}
    m, q = ranks([times[k] for k in keys]), ranks([prices[k] for k in keys])
    rho = 1 - 6 * sum((x - y) ** 2 for x, y in zip(m, q)) / (len(keys) * (len(keys) ** 2 - 1))
    best = min(times, key=times.get)
    mape = statistics.mean(abs(e) for e in errors.values())
    worst = max(errors, key=lambda k: abs(errors[k]))
    return (
        f"{len(keys)} configurations, {sum(len(r[keys[0]]['measured_rounds_s']) for r in runs)} rounds: MAPE {mape:.1%} "
        f"(worst {worst} {errors[worst]:+.1%}), Spearman {rho:.3f}, pick {pick} regret {times[pick] / times[best]:.3f} "
        f"(best {best})"
    )


def main() -> None:
    runs = [rows(path) for path in RUNS]
    picks = {json.loads(path.read_text())["summary"]["pick"] for path in RUNS}
    print("the planner's picks:", sorted(picks))
    pick = sorted(picks)[0]
    print("all three pooled:", pooled(runs, pick))
    for (i, a), (j, b) in itertools.combinations(enumerate(runs), 2):
        print(f"{RUNS[i].stem} + {RUNS[j].stem}:", pooled([a, b], pick))
    for i, run in enumerate(runs):
        print(f"{RUNS[i].stem} alone:", pooled([run], pick))


if __name__ == "__main__":
    main()
